-- The physical limit: the least SQL one Orbit task needs on PostgreSQL, on Orbit's own
-- tables (applied by Orbit's migrations), as a pgbench custom script.
--
-- One script iteration moves `batch` tasks through their whole life in four transactions,
-- the four durable steps Orbit cannot merge (each is acknowledged to a different party
-- before the next can begin): submit, claim, start, finish. Each step is ONE
-- auto-committed statement (data-modifying CTEs), so a step costs one round trip and one
-- commit: that is the floor a perfect implementation of Orbit's schema could reach.
-- Each iteration submits the tasks it then claims, so the queue keeps the depth it was
-- preloaded with (the claim takes the oldest ready tasks, FIFO, under SKIP LOCKED, so
-- concurrent clients claim each other's submissions and never wait on one another).
--
-- Run it with `-M prepared` (the `:names` become bind parameters). benchmarks/physical.py
-- rewrites the `\set batch` line below to the batch size under test; by hand:
--   pgbench -n -M prepared -f benchmarks/pgbench/pipeline.sql -c 4 -j 4 -T 10 <db url>
-- on a database migrated by `orbit db migrate` holding a queue named 'bench'.
--
-- The steps must stay in this order, one SQL command each: pgbench's per-step latencies
-- are read by position (submit, claim, start, finish), and the report's drain-only bound
-- (benchmarks.summary.drain_only_jobs_per_s: rate x total / (total - submit)) takes the
-- submit step out, since Orbit's throughput drains tasks queued before its clock starts.
--
-- Identifiers are time-ordered like Orbit's UUIDv7 (hex microseconds, then random), so the
-- primary-key indexes grow at their right edge as Orbit's do.

\set batch 64

-- 1. submit: `batch` queued tasks in one INSERT (Orbit: task_submit_many, which also
-- writes each task's `submitted` event; submit.sql measures that).
INSERT INTO orbit_tasks (
    id, queue, handler, tenant, priority, payload, payload_digest, idempotency_key,
    parent_id, retry_safe, max_attempts, backoff_base_us, backoff_factor, backoff_max_us,
    attempt_timeout_us, deadline, run_after, state, attempts_used, fence, cancel_requested,
    result, error_code, error_message, error_retryable, result_digest, result_version,
    created_at, updated_at, finished_at, version)
SELECT
    lpad(to_hex((extract(epoch FROM clock_timestamp()) * 1000000)::bigint), 14, '0')
        || substr(md5(random()::text), 1, 22),
    'bench', 'noop', 'default', 0, '{"kind":"noop"}',
    'sha256:3b3f8e0ad2dfd4d0f4a4e0ef1e6b1b0a3f1d3e2c9d8a7b6c5d4e3f2a1b0c9d8e', NULL,
    NULL, false, 3, 1000000, 2.0, 300000000,
    NULL, NULL, c.now, 'queued', 0, 0, false,
    NULL, NULL, NULL, NULL, NULL, 0,
    c.now, c.now, NULL, 1
FROM (SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint AS now) AS c,
     generate_series(1, CAST(:batch AS integer));

-- 2. claim: lock the oldest `batch` ready tasks (SKIP LOCKED), mark them claimed and
-- insert one claimed attempt each (Orbit: task_ready_select, task_write_many,
-- attempt_insert_many). The attempt ids go back to the worker, as Orbit's grants do.
WITH c AS (
    SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint AS now
), ready AS (
    SELECT id FROM orbit_tasks
    WHERE state IN ('queued', 'scheduled') AND run_after <= (SELECT now FROM c)
    ORDER BY priority DESC, id
    LIMIT CAST(:batch AS integer)
    FOR UPDATE SKIP LOCKED
), claimed AS (
    UPDATE orbit_tasks AS t
    SET state = 'claimed', fence = t.fence + 1, updated_at = c.now, version = t.version + 1
    FROM ready, c
    WHERE t.id = ready.id
    RETURNING t.id, t.fence, t.queue, t.tenant, t.handler, c.now
), granted AS (
    INSERT INTO orbit_attempts (
        id, task_id, number, session_id, session_epoch, fence, state, claimed_at,
        claim_expires_at, started_at, lease_expires_at, ended_at, finish_digest, receipt,
        queue, tenant, handler)
    SELECT
        lpad(to_hex((extract(epoch FROM clock_timestamp()) * 1000000)::bigint), 14, '0')
            || substr(md5(random()::text), 1, 22),
        k.id, k.fence, 'bench-session-' || :client_id, 1, k.fence, 'claimed', k.now,
        k.now + 30000000, NULL, NULL, NULL, NULL, NULL,
        k.queue, k.tenant, k.handler
    FROM claimed AS k
    RETURNING id
)
SELECT coalesce(array_agg(id), '{}') AS attempt_ids FROM granted
\gset

-- 3. start: claimed -> running for every granted attempt and its task, in one statement
-- (Orbit: attempt_write_many + task_write_many over jsonb_to_recordset).
WITH c AS (
    SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint AS now
), started AS (
    UPDATE orbit_attempts AS a
    SET state = 'running', started_at = c.now, lease_expires_at = c.now + 30000000
    FROM c
    WHERE a.id = ANY(CAST(:attempt_ids AS text[])) AND a.state = 'claimed'
    RETURNING a.task_id, c.now
)
UPDATE orbit_tasks AS t
SET state = 'running', attempts_used = t.attempts_used + 1, updated_at = s.now,
    version = t.version + 1
FROM started AS s
WHERE t.id = s.task_id;

-- 4. finish: running -> succeeded for every attempt and its task, with the receipt, the
-- result and one 'succeeded' event per task (Orbit: attempt_write_many, task_write_many,
-- event_insert_many).
WITH c AS (
    SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint AS now
), ended AS (
    UPDATE orbit_attempts AS a
    SET state = 'succeeded', ended_at = c.now,
        finish_digest = 'sha256:74234e98afe7498fb5daf1f36ac2d78acc339464f950703b8c019892f982b90b',
        receipt = '{"attempt_id":"' || a.id || '","attempt_state":"succeeded","digest":'
            || '"sha256:74234e98afe7498fb5daf1f36ac2d78acc339464f950703b8c019892f982b90b",'
            || '"fence":' || a.fence || ',"result_version":1,"task_id":"' || a.task_id
            || '","task_state":"succeeded"}'
    FROM c
    WHERE a.id = ANY(CAST(:attempt_ids AS text[])) AND a.state = 'running'
    RETURNING a.id, a.task_id, a.session_id, a.queue, a.tenant, c.now
), done AS (
    UPDATE orbit_tasks AS t
    SET state = 'succeeded', result = 'null',
        result_digest = 'sha256:74234e98afe7498fb5daf1f36ac2d78acc339464f950703b8c019892f982b90b',
        result_version = t.result_version + 1, updated_at = e.now, finished_at = e.now,
        version = t.version + 1
    FROM ended AS e
    WHERE t.id = e.task_id
)
INSERT INTO orbit_events (at, kind, task_id, attempt_id, session_id, queue, tenant,
    task_from, task_to, attempt_from, attempt_to, code, data)
SELECT e.now, 'succeeded', e.task_id, e.id, e.session_id, e.queue, e.tenant,
    'running', 'succeeded', 'running', 'succeeded', NULL,
    '{"digest":"sha256:74234e98afe7498fb5daf1f36ac2d78acc339464f950703b8c019892f982b90b"}'
FROM ended AS e;
