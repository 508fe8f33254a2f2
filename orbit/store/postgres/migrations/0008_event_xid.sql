-- The event feed's order: each event carries the id of the transaction that wrote it,
-- and event_list reads only events whose transaction is older than every transaction
-- still running (pg_snapshot_xmin of the reader's snapshot), ordered by (xid, id). A
-- transaction that commits late can hold a lower event id than an event already
-- visible, but never an xid below that horizon, so a reader resuming from the last
-- (xid, id) it returned never steps past an event (docs/concepts.md, "The event log").
-- Rows written before this migration get xid 0: a constant default is stored once in
-- the catalog, not written into every row, and all of them committed long ago, so they
-- come first, in id order. Rows written from now on take their transaction's id.
ALTER TABLE orbit_events ADD COLUMN xid xid8 NOT NULL DEFAULT '0';
ALTER TABLE orbit_events ALTER COLUMN xid SET DEFAULT pg_current_xact_id();
-- Each feed walks an index in its order: the whole log's the primary key, a task's the
-- task index. The key is (xid, id) in place of id's, as a cursor carries both (an event
-- is never looked up by its id alone): one index entry an event, not two, keeps the
-- insert every state change ends with as cheap as before (benchmarks.event_cost).
ALTER TABLE orbit_events DROP CONSTRAINT orbit_events_pkey, ADD PRIMARY KEY (xid, id);
DROP INDEX orbit_events_task;
CREATE INDEX orbit_events_task ON orbit_events (task_id, xid, id) WHERE task_id IS NOT NULL;
