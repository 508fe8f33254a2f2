-- The batch-enqueue ceiling: the least SQL Orbit needs to accept `batch` tasks, on its
-- own tables, as a pgbench custom script: the tasks (as pipeline.sql's submit step) and
-- the `submitted` event Orbit writes for each, in ONE auto-committed statement. Orbit
-- also validates each task, computes its payload digest and answers over HTTP; none of
-- that is here, so no implementation of Orbit's schema can enqueue faster on this server.
--
-- Run it with `-M prepared`; benchmarks/physical.py rewrites the `\set batch` line below
-- to the batch size under test (by default the enqueue workload's 1,000); by hand:
--   pgbench -n -M prepared -f benchmarks/pgbench/submit.sql -c 2 -j 2 -T 10 <db url>
-- on a database migrated by `orbit db migrate` holding a queue named 'bench'.

\set batch 1000

WITH c AS (
    SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint AS now
), inserted AS (
    INSERT INTO orbit_tasks (
        id, queue, handler, tenant, priority, payload, payload_digest, idempotency_key,
        parent_id, retry_safe, max_attempts, backoff_base_us, backoff_factor,
        backoff_max_us, attempt_timeout_us, deadline, run_after, state, attempts_used,
        fence, cancel_requested, result, error_code, error_message, error_retryable,
        result_digest, result_version, created_at, updated_at, finished_at, version)
    SELECT
        lpad(to_hex((extract(epoch FROM clock_timestamp()) * 1000000)::bigint), 14, '0')
            || substr(md5(random()::text), 1, 22),
        'bench', 'noop', 'default', 0, '{"kind":"noop"}',
        'sha256:3b3f8e0ad2dfd4d0f4a4e0ef1e6b1b0a3f1d3e2c9d8a7b6c5d4e3f2a1b0c9d8e', NULL,
        NULL, false, 3, 1000000, 2.0, 300000000,
        NULL, NULL, c.now, 'queued', 0, 0, false,
        NULL, NULL, NULL, NULL, NULL, 0,
        c.now, c.now, NULL, 1
    FROM c, generate_series(1, CAST(:batch AS integer))
    RETURNING id, queue, tenant, created_at
)
INSERT INTO orbit_events (at, kind, task_id, attempt_id, session_id, queue, tenant,
    task_from, task_to, attempt_from, attempt_to, code, data)
SELECT i.created_at, 'submitted', i.id, NULL, NULL, i.queue, i.tenant,
    NULL, 'queued', NULL, NULL, NULL,
    '{"handler":"noop","payload_digest":"sha256:3b3f8e0ad2dfd4d0f4a4e0ef1e6b1b0a3f1d3e2c9d8a7b6c5d4e3f2a1b0c9d8e"}'
FROM inserted AS i;
