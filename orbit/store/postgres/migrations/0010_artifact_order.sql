-- The artifact list's order (docs/concepts.md, "Artifacts"): each artifact gets its
-- place in its task's list when its upload is committed, not when it begins. An id is
-- made when an upload begins, so a long upload that began before an artifact already
-- listed, and was committed after, sorted before a reader's cursor and was never seen by
-- a reader paging on from it. ready_seq is drawn from this sequence by artifact_commit
-- while it holds its task's row lock: the commits of one task's artifacts take turns, so
-- within a task a later commit always draws a larger number, and nothing is ever added
-- before a position a read has returned. NULL while uploading. The sequence keeps the
-- default CACHE 1: a cached block per session would hand numbers out of order.
CREATE SEQUENCE orbit_artifacts_ready_seq;
ALTER TABLE orbit_artifacts ADD COLUMN ready_seq bigint;
ALTER SEQUENCE orbit_artifacts_ready_seq OWNED BY orbit_artifacts.ready_seq;
-- Artifacts already ready keep the order they were listed in (id order) and come first.
UPDATE orbit_artifacts f SET ready_seq = o.n
FROM (SELECT id, row_number() OVER (ORDER BY id) AS n FROM orbit_artifacts
      WHERE state = 'ready') o
WHERE f.id = o.id;
SELECT setval('orbit_artifacts_ready_seq',
              (SELECT coalesce(max(ready_seq), 0) + 1 FROM orbit_artifacts), false);
-- A task's list walks this index in its order; it replaces the index on task_id alone
-- (one entry an artifact, as before).
DROP INDEX orbit_artifacts_task;
CREATE INDEX orbit_artifacts_task ON orbit_artifacts (task_id, ready_seq);
