-- Orbit's runtime SQL for PostgreSQL. Each query is named by its `-- name:` header and
-- referred to by that name; parameters are written `:name`. A `*_many` query takes one
-- parameter `rows`, a JSON array, and writes every row in one statement.

-- name: clock_now
SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint AS now;

-- name: claim_lock
-- Claims are serialised cluster-wide so that caps counted under this lock stay exact (I4).
-- A claim counts the live attempts through a partial index that keeps an entry for every
-- attempt version ever claimed or running until VACUUM removes it. A plain index scan
-- marks the entries it finds dead, so the next claim skips them; a bitmap scan never
-- does, and then every claim visits every attempt since the last VACUUM. So the claim's
-- statements use no bitmap scans (`set_config(..., true)`: this transaction only).
SELECT pg_advisory_xact_lock(7270601) AS locked,
       set_config('enable_bitmapscan', 'off', true) AS plain_scans;

-- name: schema_version_create
CREATE TABLE IF NOT EXISTS orbit_schema_version (
    version    integer PRIMARY KEY,
    applied_at bigint NOT NULL
);

-- name: schema_version_present
-- Whether the version table exists (on the search path, where CREATE TABLE puts it):
-- migrate reads it before it takes any lock.
SELECT to_regclass('orbit_schema_version') IS NOT NULL AS present;

-- name: schema_version_get
SELECT coalesce(max(version), 0) AS version FROM orbit_schema_version;

-- name: schema_version_insert
INSERT INTO orbit_schema_version (version, applied_at) VALUES (:version, :now);

-- name: migrate_lock
SELECT pg_advisory_xact_lock(7270600) AS locked;

-- name: queue_insert
INSERT INTO orbit_queues (name, max_concurrency, rate, burst, paused, tokens, tokens_at, created_at,
    max_queued)
VALUES (:name, :max_concurrency, :rate, :burst, false, :tokens, :now, :now, :max_queued)
ON CONFLICT (name) DO NOTHING
RETURNING name;

-- name: queue_get
SELECT * FROM orbit_queues WHERE name = :name;

-- name: queue_get_many
SELECT * FROM orbit_queues WHERE name = ANY(CAST(:names AS text[]));

-- name: queue_all
-- Every queue, for a claim and for a changed cap's wake-up.
SELECT * FROM orbit_queues ORDER BY name;

-- name: queue_list
-- A page of queues in name order after :after_name, a walk of the primary key. The
-- first page's :after_name is '', which sorts before every name, so the condition is
-- always a range of the key's index (an ":x IS NULL OR" form reads every row from the
-- start, on SQLite and in PostgreSQL's generic plan). A NULL limit is LIMIT ALL: every
-- row.
SELECT * FROM orbit_queues WHERE name > :after_name ORDER BY name LIMIT CAST(:limit AS bigint);

-- name: queue_lock
SELECT * FROM orbit_queues WHERE name = :name FOR UPDATE;

-- name: queue_share
SELECT * FROM orbit_queues WHERE name = :name FOR SHARE;

-- name: queue_share_for_attempts
-- The queues of these attempts' tasks, shared: read after the tasks are locked (their
-- queue never changes), in the order every transaction takes queue locks. An attempt
-- carries its task's queue (copied by the claim, and neither ever changes), so the
-- attempts alone name them: joining the tasks again cost a start's batch of 180 a
-- lookup of the tasks' key each, half of this read (EXPLAIN ANALYZE, 0.64 -> 0.27 ms).
SELECT * FROM orbit_queues
WHERE name IN (SELECT queue FROM orbit_attempts WHERE id = ANY(CAST(:ids AS text[])))
ORDER BY name FOR SHARE;

-- name: queue_set_paused
UPDATE orbit_queues SET paused = :paused WHERE name = :name;

-- name: queue_update_caps
-- An operator's change of the caps; the bucket is written settled (orbit.core.limits).
UPDATE orbit_queues
SET max_concurrency = :max_concurrency, rate = :rate, burst = :burst,
    tokens = :tokens, tokens_at = :tokens_at, max_queued = :max_queued
WHERE name = :name;

-- name: tenant_get
SELECT name, max_concurrency, max_queued FROM orbit_tenants WHERE name = :name;

-- name: queue_tokens_write_many
UPDATE orbit_queues AS q SET tokens = x.tokens, tokens_at = x.tokens_at
FROM (SELECT * FROM json_to_recordset(CAST(:rows AS json)) AS x(name text, tokens double precision, tokens_at bigint)
    LIMIT :rows_n) AS x
WHERE q.name = x.name
RETURNING q.name;

-- name: tenant_upsert
INSERT INTO orbit_tenants (name, max_concurrency, max_queued)
VALUES (:name, :max_concurrency, :max_queued)
ON CONFLICT (name) DO UPDATE
SET max_concurrency = excluded.max_concurrency, max_queued = excluded.max_queued;

-- name: tenant_limits
-- A page of the tenants with a cap of either kind (a tenant left out has neither), in
-- name order after :after_name ('' for the first page), a range of the primary key as
-- queue_list's is. A tenant whose caps were removed keeps its row and is skipped. A NULL
-- limit is LIMIT ALL: every row.
SELECT name, max_concurrency, max_queued FROM orbit_tenants
WHERE name > :after_name AND (max_concurrency IS NOT NULL OR max_queued IS NOT NULL)
ORDER BY name LIMIT CAST(:limit AS bigint);

-- name: tenant_queued_caps
-- The caps on waiting tasks of these tenants, where set: read by every submit with its
-- queues (one statement on PostgreSQL), a lookup of the primary key per tenant.
SELECT name, max_queued FROM orbit_tenants WHERE name = ANY(CAST(:names AS text[])) AND max_queued IS NOT NULL;

-- name: tenant_caps
SELECT name, max_concurrency FROM orbit_tenants WHERE max_concurrency IS NOT NULL;

-- name: setting_upsert
INSERT INTO orbit_settings (name, int_value) VALUES (:name, :int_value)
ON CONFLICT (name) DO UPDATE SET int_value = excluded.int_value;

-- name: setting_get
SELECT int_value FROM orbit_settings WHERE name = :name;

-- name: depth_lock
-- Serialises, cluster-wide, the submits to the queues and tenants that have a max_queued
-- (Store._check_depth): one transaction-scoped advisory lock per capped scope, taken in
-- the order of the keys so that two submits never wait for each other in a cycle. A key
-- is made from the scope's kind and name (orbit.store.store.depth_key); two scopes
-- sharing a key only wait for each other more. Its own statement, before the counts:
-- a statement's snapshot is taken when it begins, so a count in the statement that waited
-- would miss the rows of the submit it waited for.
SELECT count(pg_advisory_xact_lock(k)) AS locked FROM (
    SELECT CAST(k AS bigint) AS k FROM unnest(CAST(:keys AS text[])) AS u(k)
    ORDER BY 1 OFFSET 0) AS s;

-- name: idempotency_lock
-- Serialises, cluster-wide, the batches that may share idempotency keys (Store.submit_many):
-- one transaction-scoped advisory lock per stripe of the (tenant, queue)s its keys name
-- (orbit.store.store.key_lock, 64 stripes: a lock per key ran out of the shared lock
-- table), taken in order, before the batch reads which keys name tasks. Without it two
-- batches listing shared keys in different orders each inserted a key the other then
-- waited on (ON CONFLICT waits for the row's inserter), a cycle PostgreSQL broke as a
-- deadlock a second later. Its own statement, before the read of the keys' tasks, which
-- then sees the tasks of the batch it waited for.
SELECT count(pg_advisory_xact_lock(k)) AS locked FROM (
    SELECT CAST(k AS bigint) AS k FROM unnest(CAST(:keys AS text[])) AS u(k)
    ORDER BY 1 OFFSET 0) AS s;

-- name: queue_depth
-- A queue's max_queued as it is now and its waiting tasks (queued or scheduled), counted
-- up to the first that leaves no room for :adding more. The tasks are read through
-- orbit_tasks_ready, which holds only the waiting tasks of every queue (no index of its
-- own: see the max_queued migration): the ORDER BY is that index's, so that the planner
-- walks it and stops at the LIMIT, rather than scanning the whole table, ended tasks and
-- all, as it did without. No cap (NULL) counts nothing.
SELECT max_queued, (SELECT count(*) FROM (
    SELECT 1 FROM orbit_tasks WHERE queue = :name AND state IN ('queued', 'scheduled')
    ORDER BY priority DESC, id
    LIMIT (SELECT greatest(coalesce(max(max_queued) - :adding + 1, 0), 0) FROM orbit_queues
           WHERE name = :name)) AS w) AS depth
FROM orbit_queues WHERE name = :name;

-- name: tenant_depth
-- queue_depth for a tenant, across every queue.
SELECT max_queued, (SELECT count(*) FROM (
    SELECT 1 FROM orbit_tasks WHERE tenant = :name AND state IN ('queued', 'scheduled')
    ORDER BY priority DESC, id
    LIMIT (SELECT greatest(coalesce(max(max_queued) - :adding + 1, 0), 0) FROM orbit_tenants
           WHERE name = :name)) AS w) AS depth
FROM orbit_tenants WHERE name = :name;

-- name: task_submit_many
-- New tasks and the `submitted` event of each, in one statement: the events are made from
-- the rows the insert returns, so a task skipped because its idempotency key was taken
-- concurrently gets none (the count falls short and the store retries). The event data is
-- spelled as compact_json(sort_keys=True) spells it: handler names and digests need no
-- escaping (see check_name). The columns every new task starts with are literals here
-- (transitions.NEW_TASK_FIXED, in this order; updated_at is created_at): the rows carry the rest.
WITH new_tasks AS (
    INSERT INTO orbit_tasks (
        id, queue, handler, tenant, priority, payload, payload_digest, idempotency_key,
        parent_id, retry_safe, max_attempts, backoff_base_us, backoff_factor, backoff_max_us,
        attempt_timeout_us, deadline, run_after, state, attempts_used, fence, cancel_requested,
        result, error_code, error_message, error_retryable, result_digest, result_version,
        created_at, updated_at, finished_at, version)
    SELECT
        id, queue, handler, tenant, priority, payload, payload_digest, idempotency_key,
        parent_id, retry_safe, max_attempts, backoff_base_us, backoff_factor, backoff_max_us,
        attempt_timeout_us, deadline, run_after, state, 0, 0, false,
        NULL, NULL, NULL, NULL, NULL, 0,
        created_at, created_at, NULL, 1
    FROM json_to_recordset(CAST(:rows AS json)) AS x(
        id text, queue text, handler text, tenant text, priority integer, payload text,
        payload_digest text, idempotency_key text, parent_id text, retry_safe boolean,
        max_attempts integer, backoff_base_us bigint, backoff_factor double precision,
        backoff_max_us bigint, attempt_timeout_us bigint, deadline bigint, run_after bigint,
        state text, created_at bigint)
    ON CONFLICT (tenant, queue, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING id, queue, tenant, handler, payload_digest, state, created_at
)
INSERT INTO orbit_events (at, kind, task_id, attempt_id, session_id, queue, tenant,
    task_from, task_to, attempt_from, attempt_to, code, data)
SELECT created_at, 'submitted', id, NULL, NULL, queue, tenant, NULL, state, NULL, NULL, NULL,
    '{"handler":"' || handler || '","payload_digest":"' || payload_digest || '"}'
FROM new_tasks
RETURNING id;

-- name: task_submit_many_uniform
-- task_submit_many for a chunk of eight or more tasks whose columns read here as
-- :one__<column> each hold one value in every row, and whose other columns this does
-- not read (the idempotency key) are NULL in every row: the driver sends such a chunk
-- this way (``uniform_params``), as a batch of one queue's tasks usually is. Each of
-- those columns travels once instead of as an array of a value per task, which
-- PostgreSQL would split and cast row by row; and with no key there is nothing for
-- ON CONFLICT to find, so the insert goes without it (PostgreSQL's speculative insertion
-- costs each row a second WAL record). The rows and events written are
-- task_submit_many's, column for column.
WITH new_tasks AS (
    INSERT INTO orbit_tasks (
        id, queue, handler, tenant, priority, payload, payload_digest, idempotency_key,
        parent_id, retry_safe, max_attempts, backoff_base_us, backoff_factor, backoff_max_us,
        attempt_timeout_us, deadline, run_after, state, attempts_used, fence, cancel_requested,
        result, error_code, error_message, error_retryable, result_digest, result_version,
        created_at, updated_at, finished_at, version)
    SELECT
        id, CAST(:one__queue AS text), CAST(:one__handler AS text), CAST(:one__tenant AS text),
        CAST(:one__priority AS integer), payload, payload_digest, NULL,
        CAST(:one__parent_id AS text), CAST(:one__retry_safe AS boolean),
        CAST(:one__max_attempts AS integer), CAST(:one__backoff_base_us AS bigint),
        CAST(:one__backoff_factor AS double precision), CAST(:one__backoff_max_us AS bigint),
        CAST(:one__attempt_timeout_us AS bigint), CAST(:one__deadline AS bigint),
        CAST(:one__run_after AS bigint), CAST(:one__state AS text), 0, 0, false,
        NULL, NULL, NULL, NULL, NULL, 0,
        CAST(:one__created_at AS bigint), CAST(:one__created_at AS bigint), NULL, 1
    FROM json_to_recordset(CAST(:rows AS json)) AS x(id text, payload text, payload_digest text)
    RETURNING id, payload_digest
)
INSERT INTO orbit_events (at, kind, task_id, attempt_id, session_id, queue, tenant,
    task_from, task_to, attempt_from, attempt_to, code, data)
SELECT CAST(:one__created_at AS bigint), 'submitted', id, NULL, NULL,
    CAST(:one__queue AS text), CAST(:one__tenant AS text), NULL, CAST(:one__state AS text),
    NULL, NULL, NULL,
    '{"handler":"' || CAST(:one__handler AS text) || '","payload_digest":"' || payload_digest || '"}'
FROM new_tasks
RETURNING id;

-- name: task_get
SELECT * FROM orbit_tasks WHERE id = :id;

-- name: task_share
SELECT * FROM orbit_tasks WHERE id = :id FOR SHARE;

-- name: task_lock_many
SELECT * FROM orbit_tasks WHERE id = ANY(CAST(:ids AS text[])) ORDER BY id FOR UPDATE;

-- name: task_lock_for_attempts
-- Lock the tasks of these attempts, by id, in one round trip: workers' reports lock the
-- tasks first and then the attempts, always in that order (no deadlocks between batches).
-- Every column but the payload, which no report reads and which can be large: a TOASTed
-- value is fetched and decompressed by every read that selects it. The tasks come back
-- with an empty payload (Store._report_batch).
SELECT '' AS payload, id, queue, handler, tenant, priority, payload_digest, idempotency_key,
    parent_id, retry_safe, max_attempts, backoff_base_us, backoff_factor, backoff_max_us,
    attempt_timeout_us, deadline, run_after, state, attempts_used, fence, cancel_requested,
    result, error_code, error_message, error_retryable, result_digest, result_version,
    created_at, updated_at, finished_at, version
FROM orbit_tasks
WHERE id IN (SELECT task_id FROM orbit_attempts WHERE id = ANY(CAST(:ids AS text[])))
ORDER BY id FOR UPDATE;

-- name: task_lock_for_starts
-- task_lock_for_attempts for a batch of starts (Store.attempt_start_many): only the
-- columns a start reads or writes back; rows.start_tasks_from_table fills the others,
-- which it never reads. Each column selected costs every row its conversion.
SELECT id, queue, tenant, max_attempts, attempt_timeout_us, deadline, run_after, state,
    attempts_used, fence, cancel_requested, result, error_code, error_message,
    error_retryable, result_digest, result_version, updated_at, finished_at, version
FROM orbit_tasks
WHERE id IN (SELECT task_id FROM orbit_attempts WHERE id = ANY(CAST(:ids AS text[])))
ORDER BY id FOR UPDATE;

-- name: task_lock_many_skip_locked
SELECT * FROM orbit_tasks WHERE id = ANY(CAST(:ids AS text[])) ORDER BY id FOR UPDATE SKIP LOCKED;

-- name: task_by_idempotency_keys
SELECT * FROM orbit_tasks
WHERE tenant = :tenant AND queue = :queue AND idempotency_key = ANY(CAST(:keys AS text[]));

-- name: task_children
-- The children of these tasks, one level of a tree (store._lock_tree walks it a level
-- per statement): each level is planned for its own parents, so a chain's level reads
-- the partial index orbit_tasks_parent. A recursive CTE's step is planned once, blind
-- to them: where statistics showed a parent with thousands of children, it scanned
-- the whole table at every level of a deep tree.
SELECT id FROM orbit_tasks WHERE parent_id = ANY(CAST(:ids AS text[]));

-- name: task_tree_ended
-- A walked tree (store._tree_ended), checked in one statement, so at one instant: the
-- task's row version (NULL if there is none), and how many children the walked tasks
-- have, and how many of those have not ended (the task's own state the store has read).
SELECT
    (SELECT version FROM orbit_tasks WHERE id = :id) AS version,
    count(*) AS children,
    count(*) FILTER (WHERE state NOT IN ('succeeded', 'failed', 'cancelled')) AS live
FROM orbit_tasks WHERE parent_id = ANY(CAST(:ids AS text[]));

-- name: task_cancelled_lineage
-- For each of these tasks, the tasks among itself and its ancestors (parent_id, up to
-- the root) whose cancel was asked: a cancel cascades down a whole tree, so a task
-- under any of them may not be retried, nor take a new child. Unlocked: the caller
-- holds a lock on a task of the lineage, which every such cancel also locks. Its state
-- tells a cancel requested (cancelling) from one done, for the refusal's message.
WITH RECURSIVE up(start_id, id) AS (
    SELECT id, id FROM orbit_tasks WHERE id = ANY(CAST(:ids AS text[]))
    UNION ALL
    SELECT up.start_id, t.parent_id FROM up JOIN orbit_tasks t ON t.id = up.id
    WHERE t.parent_id IS NOT NULL
)
SELECT up.start_id AS id, t.id AS cancelled_id, t.state AS cancelled_state
FROM up JOIN orbit_tasks t ON t.id = up.id
WHERE t.cancel_requested OR t.state = 'cancelled'
ORDER BY up.start_id, t.id;

-- name: task_ready_select
-- Each row comes with `locked_at`, the clock read as the row leaves the subquery, after
-- its lock: the last row's is read after every lock this select took, which is the
-- clock a claim needs (a separate read cost a round trip per claim).
SELECT r.*, (extract(epoch FROM clock_timestamp()) * 1000000)::bigint AS locked_at FROM (
-- A queued task is due whatever its run_after says: it was made queued at or after its
-- run_after, so one later than now was written before a step back of the clock, and it
-- waited the step's length (docs/reliability.md, "Clock steps").
SELECT * FROM orbit_tasks
WHERE state IN ('queued', 'scheduled')
  AND (state = 'queued' OR run_after <= :now)
  AND (deadline IS NULL OR deadline > :now)
  AND handler = ANY(CAST(:handlers AS text[]))
  AND NOT (queue = ANY(CAST(:skip_queues AS text[])))
  AND NOT (tenant = ANY(CAST(:skip_tenants AS text[])))
  AND NOT (id = ANY(CAST(:skip_ids AS text[])))
ORDER BY priority DESC, id
LIMIT :limit
FOR UPDATE SKIP LOCKED) AS r;

-- name: task_write_many
UPDATE orbit_tasks AS t SET
    state = x.state, attempts_used = x.attempts_used, fence = x.fence,
    cancel_requested = x.cancel_requested, run_after = x.run_after,
    max_attempts = x.max_attempts, result = x.result, error_code = x.error_code,
    error_message = x.error_message, error_retryable = x.error_retryable,
    result_digest = x.result_digest, result_version = x.result_version,
    updated_at = x.updated_at, finished_at = x.finished_at, version = x.version
FROM (SELECT * FROM json_to_recordset(CAST(:rows AS json)) AS x(
    id text, expect_version bigint, state text, attempts_used integer, fence bigint,
    cancel_requested boolean, run_after bigint, max_attempts integer, result text,
    error_code text, error_message text, error_retryable boolean, result_digest text,
    result_version bigint, updated_at bigint, finished_at bigint, version bigint)
    LIMIT :rows_n) AS x
WHERE t.id = x.id AND t.version = x.expect_version
RETURNING t.id;

-- name: task_list
SELECT * FROM orbit_tasks
WHERE (CAST(:queue AS text) IS NULL OR queue = :queue)
  AND (CAST(:state AS text) IS NULL OR state = :state)
  AND (CAST(:tenant AS text) IS NULL OR tenant = :tenant)
  AND (CAST(:handler AS text) IS NULL OR handler = :handler)
  AND (CAST(:created_after AS bigint) IS NULL OR created_at >= :created_after)
  AND (CAST(:created_before AS bigint) IS NULL OR created_at < :created_before)
  AND (CAST(:after_id AS text) IS NULL OR id > :after_id)
ORDER BY id
LIMIT :limit;

-- name: task_list_range
-- task_list within the ids between :id_from and :id_to (both excluded), which the store
-- derives from after_id and the created_at window (ids are time-ordered: Store.task_list):
-- as plain conditions they bound the primary key's scan in a prepared statement's generic
-- plan, where task_list's "IS NULL OR" form is only a filter on every row from the first.
-- The created_at conditions stay: the id bounds only narrow what they allow.
SELECT * FROM orbit_tasks
WHERE id > :id_from AND id < :id_to
  AND (CAST(:queue AS text) IS NULL OR queue = :queue)
  AND (CAST(:state AS text) IS NULL OR state = :state)
  AND (CAST(:tenant AS text) IS NULL OR tenant = :tenant)
  AND (CAST(:handler AS text) IS NULL OR handler = :handler)
  AND (CAST(:created_after AS bigint) IS NULL OR created_at >= :created_after)
  AND (CAST(:created_before AS bigint) IS NULL OR created_at < :created_before)
ORDER BY id
LIMIT :limit;

-- name: task_list_by_parent
-- task_list with parent_id: its own query, because the equality must stand alone for the
-- partial index orbit_tasks_parent to be used by a prepared statement's generic plan.
SELECT * FROM orbit_tasks
WHERE parent_id = :parent_id
  AND (CAST(:queue AS text) IS NULL OR queue = :queue)
  AND (CAST(:state AS text) IS NULL OR state = :state)
  AND (CAST(:tenant AS text) IS NULL OR tenant = :tenant)
  AND (CAST(:handler AS text) IS NULL OR handler = :handler)
  AND (CAST(:created_after AS bigint) IS NULL OR created_at >= :created_after)
  AND (CAST(:created_before AS bigint) IS NULL OR created_at < :created_before)
  AND (CAST(:after_id AS text) IS NULL OR id > :after_id)
ORDER BY id
LIMIT :limit;

-- name: task_count_by_state
SELECT state, count(*) AS n FROM orbit_tasks GROUP BY state;

-- name: attempt_insert_many
INSERT INTO orbit_attempts (
    id, task_id, number, session_id, session_epoch, fence, state, claimed_at,
    claim_expires_at, started_at, lease_expires_at, ended_at, finish_digest, receipt,
    queue, tenant, handler)
SELECT
    id, task_id, number, session_id, session_epoch, fence, state, claimed_at,
    claim_expires_at, started_at, lease_expires_at, ended_at, finish_digest, receipt,
    queue, tenant, handler
FROM json_to_recordset(CAST(:rows AS json)) AS x(
    id text, task_id text, number integer, session_id text, session_epoch bigint,
    fence bigint, state text, claimed_at bigint, claim_expires_at bigint, started_at bigint,
    lease_expires_at bigint, ended_at bigint, finish_digest text, receipt text,
    queue text, tenant text, handler text)
RETURNING id;

-- name: attempt_write_many
UPDATE orbit_attempts AS a SET
    state = x.state, started_at = x.started_at, lease_expires_at = x.lease_expires_at,
    ended_at = x.ended_at, finish_digest = x.finish_digest, receipt = x.receipt
FROM (SELECT * FROM json_to_recordset(CAST(:rows AS json)) AS x(
    id text, expect_state text, expect_lease bigint, state text, started_at bigint,
    lease_expires_at bigint, ended_at bigint, finish_digest text, receipt text)
    LIMIT :rows_n) AS x
WHERE a.id = x.id AND a.state = x.expect_state
  AND a.lease_expires_at IS NOT DISTINCT FROM x.expect_lease
RETURNING a.id;

-- name: attempt_get
SELECT * FROM orbit_attempts WHERE id = :id;

-- name: attempt_lock_many
SELECT * FROM orbit_attempts WHERE id = ANY(CAST(:ids AS text[])) ORDER BY id FOR UPDATE;

-- name: attempt_live_for_tasks
SELECT * FROM orbit_attempts
WHERE task_id = ANY(CAST(:task_ids AS text[])) AND state IN ('claimed', 'running')
FOR UPDATE;

-- name: attempt_list
-- A page of a task's attempts in number order after :after_number (0 for the first
-- page: numbers start at 1), a range of the (task_id, number) unique index. A NULL
-- limit is LIMIT ALL: every row.
SELECT * FROM orbit_attempts
WHERE task_id = :task_id AND number > :after_number
ORDER BY number
LIMIT CAST(:limit AS bigint);

-- name: attempt_outcome_list
-- The events that ended these attempts of the task (claimed or running to any other
-- state), in the log's order: each attempt's end is written in the transaction that
-- ends it. A range of the task's event index, filtered; read for an attempt list only.
SELECT attempt_id, kind, code FROM orbit_events
WHERE task_id = :task_id AND attempt_id = ANY(CAST(:ids AS text[]))
  AND attempt_from IN ('claimed', 'running')
  AND attempt_to NOT IN ('claimed', 'running')
ORDER BY xid, id;

-- name: attempt_live_counts
SELECT queue, tenant, handler, session_id, count(*) AS n FROM orbit_attempts
WHERE state IN ('claimed', 'running')
GROUP BY queue, tenant, handler, session_id;

-- name: attempt_cancelling_for_sessions
-- The running attempts of these sessions whose task is cancelling: the cancels a node
-- may have missed while its LISTEN connection was away (orbit/server/listen.py). Reads
-- the live attempts (orbit_attempts_one_live, whose predicate is stated in full for
-- SQLite's planner, as in reap_candidates); no lock, it only decides what to push.
SELECT a.session_id, a.id FROM orbit_attempts AS a JOIN orbit_tasks AS t ON t.id = a.task_id
WHERE a.session_id = ANY(CAST(:session_ids AS text[]))
    AND a.state IN ('claimed', 'running') AND a.state = 'running' AND t.state = 'cancelling'
ORDER BY a.session_id, a.id;

-- name: attempt_claimed_for_session
-- A session's claimed attempts: a walk of the live ones (orbit_attempts_one_live, its
-- predicate stated in full for SQLite's planner, as in reap_candidates).
SELECT task_id FROM orbit_attempts
WHERE state IN ('claimed', 'running') AND state = 'claimed' AND session_id = :session_id;

-- name: attempt_claimed_for_sessions
-- The claimed attempts of several sessions (the reaper's session expiry, a batch of
-- sessions in one read): a walk of the live ones, as attempt_claimed_for_session.
SELECT session_id, task_id FROM orbit_attempts
WHERE state IN ('claimed', 'running') AND state = 'claimed'
    AND session_id = ANY(CAST(:session_ids AS text[]));

-- name: session_insert
INSERT INTO orbit_sessions (id, name, node_id, epoch, secret_hash, capabilities,
    max_concurrency, capacity_seq, draining, state, expires_at, created_at)
VALUES (:id, :name, :node_id, :epoch, :secret_hash, :capabilities, :max_concurrency,
    :capacity_seq, :draining, :state, :expires_at, :created_at);

-- name: session_get
SELECT * FROM orbit_sessions WHERE id = :id;

-- name: session_lock
SELECT * FROM orbit_sessions WHERE id = :id FOR UPDATE;

-- name: session_lock_many_skip_locked
SELECT * FROM orbit_sessions WHERE id = ANY(CAST(:ids AS text[])) ORDER BY id FOR UPDATE SKIP LOCKED;

-- name: session_share
SELECT * FROM orbit_sessions WHERE id = :id FOR SHARE;

-- name: session_list
-- In id order, which is the order sessions were opened in (uuid7 ids made from the
-- instant written as created_at), so a page is a walk of the primary key. A NULL limit
-- is LIMIT ALL: every session.
SELECT * FROM orbit_sessions
WHERE (CAST(:state AS text) IS NULL OR state = :state)
  AND (CAST(:after_id AS text) IS NULL OR id > :after_id)
ORDER BY id
LIMIT CAST(:limit AS bigint);

-- name: session_list_live
-- session_list's live sessions, read through the partial index of live sessions
-- (orbit_sessions_expiry) and sorted: a generic plan of session_list walks the primary
-- key through every expired session too, and they are never deleted (140-300 ms a page
-- at 225,000 of them).
SELECT * FROM orbit_sessions
WHERE state = 'live'
  AND (CAST(:after_id AS text) IS NULL OR id > :after_id)
ORDER BY id
LIMIT CAST(:limit AS bigint);

-- name: session_write_many
UPDATE orbit_sessions AS s SET
    node_id = x.node_id, epoch = x.epoch, secret_hash = x.secret_hash,
    capabilities = x.capabilities, max_concurrency = x.max_concurrency,
    capacity_seq = x.capacity_seq, draining = x.draining, state = x.state,
    expires_at = x.expires_at
FROM (SELECT * FROM json_to_recordset(CAST(:rows AS json)) AS x(
    id text, expect_epoch bigint, node_id text, epoch bigint, secret_hash text,
    capabilities text, max_concurrency integer, capacity_seq bigint, draining boolean,
    state text, expires_at bigint)
    LIMIT :rows_n) AS x
WHERE s.id = x.id AND s.epoch = x.expect_epoch
RETURNING s.id;

-- name: session_expired_select
SELECT id FROM orbit_sessions WHERE state = 'live' AND expires_at <= :now
ORDER BY expires_at LIMIT :limit;

-- name: event_insert_many
INSERT INTO orbit_events (at, kind, task_id, attempt_id, session_id, queue, tenant,
    task_from, task_to, attempt_from, attempt_to, code, data)
SELECT at, kind, task_id, attempt_id, session_id, queue, tenant, task_from, task_to,
    attempt_from, attempt_to, code, data
FROM json_to_recordset(CAST(:rows AS json)) AS x(
    at bigint, kind text, task_id text, attempt_id text, session_id text, queue text,
    tenant text, task_from text, task_to text, attempt_from text, attempt_to text,
    code text, data text)
RETURNING id;

-- name: activity_snapshot
-- Reads pg_stat_activity once, so that PostgreSQL keeps what it showed for the rest of
-- the transaction (a backend's status is read once a transaction): sent before an
-- event_list in one implicit transaction (PostgresDriver.read), it makes the horizon's
-- look at other databases older than the read's snapshot.
SELECT count(*) FROM pg_stat_activity;

-- name: event_list
-- The log after the event at (after_xid, after_id) ((0, 0): from the start) in (xid, id)
-- order, through the primary key, with the
-- horizon: the oldest transaction of this database still running when the statement's
-- snapshot was taken (pg_snapshot_xmin, but for the running transactions
-- pg_stat_activity shows in another database: one of those, a CREATE DATABASE next
-- door, can add no event here; a transaction it does not show counts, as it may be
-- this database's). pg_stat_activity is read before the snapshot is taken
-- (activity_snapshot): read after it, a transaction of another database that ended in
-- between was in the snapshot and no longer shown, so it counted and held back events
-- for nothing. Every transaction below the horizon has ended, so no event can
-- ever be added before the rows below it: the store returns those and waits for the
-- others (Store.event_list). A position no event has matches nothing. The xid
-- goes out as txid: named xid, ORDER BY xid would sort by that text ('10' < '9').
WITH snap AS (SELECT pg_current_snapshot() AS s),
elsewhere AS (
    SELECT backend_xid FROM pg_stat_activity
    WHERE backend_xid IS NOT NULL AND datname <> current_database()),
horizon AS (
    SELECT coalesce(
        (SELECT min(x) FROM snap, pg_snapshot_xip(s) AS x
         WHERE CAST(x AS xid) NOT IN (SELECT backend_xid FROM elsewhere)),
        (SELECT pg_snapshot_xmax(s) FROM snap)) AS h)
SELECT id, at, kind, task_id, attempt_id, session_id, queue, tenant, task_from, task_to,
    attempt_from, attempt_to, code, data, CAST(xid AS text) AS txid,
    (SELECT CAST(h AS text) FROM horizon) AS horizon
FROM orbit_events
WHERE (xid, id) > (CAST(CAST(CAST(:after_xid AS bigint) AS text) AS xid8), :after_id)
    AND ((CAST(:after_id AS bigint) = 0 AND CAST(:after_xid AS bigint) = 0)
        OR EXISTS (SELECT 1 FROM orbit_events c
        WHERE c.xid = CAST(CAST(CAST(:after_xid AS bigint) AS text) AS xid8)
            AND c.id = :after_id))
ORDER BY xid, id
LIMIT :limit;

-- name: event_list_task
-- event_list for one task, through orbit_events_task (task_id, xid, id).
WITH snap AS (SELECT pg_current_snapshot() AS s),
elsewhere AS (
    SELECT backend_xid FROM pg_stat_activity
    WHERE backend_xid IS NOT NULL AND datname <> current_database()),
horizon AS (
    SELECT coalesce(
        (SELECT min(x) FROM snap, pg_snapshot_xip(s) AS x
         WHERE CAST(x AS xid) NOT IN (SELECT backend_xid FROM elsewhere)),
        (SELECT pg_snapshot_xmax(s) FROM snap)) AS h)
SELECT id, at, kind, task_id, attempt_id, session_id, queue, tenant, task_from, task_to,
    attempt_from, attempt_to, code, data, CAST(xid AS text) AS txid,
    (SELECT CAST(h AS text) FROM horizon) AS horizon
FROM orbit_events
WHERE task_id = :task_id AND (xid, id) > (CAST(CAST(CAST(:after_xid AS bigint) AS text) AS xid8), :after_id)
    AND ((CAST(:after_id AS bigint) = 0 AND CAST(:after_xid AS bigint) = 0)
        OR EXISTS (SELECT 1 FROM orbit_events c
        WHERE c.xid = CAST(CAST(CAST(:after_xid AS bigint) AS text) AS xid8)
            AND c.id = :after_id))
ORDER BY xid, id
LIMIT :limit;

-- name: event_exists
SELECT id FROM orbit_events
WHERE xid = CAST(CAST(CAST(:xid AS bigint) AS text) AS xid8) AND id = :id;

-- name: reap_candidates
-- The tasks a reaper pass acts on: a claim or lease run out (one walk of the live
-- attempts, through orbit_attempts_one_live: the condition names the index's predicate
-- in full, which SQLite's planner needs to use it), a live task past its deadline, a
-- scheduled task due.
SELECT task_id AS id FROM orbit_attempts
WHERE state IN ('claimed', 'running')
    AND CASE state WHEN 'claimed' THEN claim_expires_at ELSE lease_expires_at END <= :now
UNION
SELECT id FROM orbit_tasks
WHERE deadline <= :now AND state IN ('queued', 'scheduled', 'claimed', 'running')
UNION
SELECT id FROM orbit_tasks WHERE state = 'scheduled' AND run_after <= :now
LIMIT :limit;

-- name: reap_next_due
-- The soonest instant a reaper pass has work, or NULL when nothing is pending: a claim or
-- a lease running out, a live task's deadline, a scheduled task falling due, a live
-- session or a committed artifact's grace after its expiry running out (:artifact_grace,
-- StoreConfig.artifact_grace_us; the live attempts' soonest expiry, walked as
-- reap_candidates walks them, and each other the head of its partial index, read as
-- reap_candidates, session_expired_select and artifact_expired_delete read them).
SELECT min(due) AS due FROM (
    SELECT min(CASE state WHEN 'claimed' THEN claim_expires_at ELSE lease_expires_at END)
        AS due
    FROM orbit_attempts WHERE state IN ('claimed', 'running')
    UNION ALL
    SELECT min(deadline) FROM orbit_tasks
    WHERE deadline IS NOT NULL AND state IN ('queued', 'scheduled', 'claimed', 'running')
    UNION ALL
    SELECT min(run_after) FROM orbit_tasks WHERE state = 'scheduled'
    UNION ALL
    SELECT min(expires_at) FROM orbit_sessions WHERE state = 'live'
    UNION ALL
    SELECT min(expires_at) + CAST(:artifact_grace AS bigint) FROM orbit_artifacts
    WHERE state = 'ready'
) AS heads;

-- name: token_insert
INSERT INTO orbit_tokens (id, name, secret_hash, scopes, created_at)
VALUES (:id, :name, :secret_hash, :scopes, :now);

-- name: token_get
SELECT * FROM orbit_tokens WHERE id = :id AND revoked_at IS NULL;

-- name: token_list
-- Every column but secret_hash: a listing never carries what a token is checked
-- against. A page in id order after :after_id ('' for the first page), a range of the
-- primary key. A token's id is the uuid7 of the instant written as created_at (dashes
-- left out), so id order is the (created_at, id) order the list was read in before it
-- was paged. A NULL limit is LIMIT ALL: every row.
SELECT id, name, scopes, created_at, revoked_at FROM orbit_tokens
WHERE id > :after_id
ORDER BY id
LIMIT CAST(:limit AS bigint);

-- name: token_lock
SELECT id, name, scopes, created_at, revoked_at FROM orbit_tokens WHERE id = :id FOR UPDATE;

-- name: token_live
-- Which of these token ids are still accepted (known, not revoked): a node re-checks the
-- tokens its open worker connections were opened with (orbit/server/revocation.py).
SELECT id FROM orbit_tokens WHERE id = ANY(CAST(:ids AS text[])) AND revoked_at IS NULL;

-- name: token_revoke
-- Only a token not revoked yet: a second revoke keeps the first revoked_at.
UPDATE orbit_tokens SET revoked_at = :now WHERE id = :id AND revoked_at IS NULL;

-- name: notify_many
-- Wakes the other server nodes when the transaction commits. Channel orbit_ready: a task
-- became ready or a permit was freed; the payload is `<origin>:<kind>:<queue>`, and a node
-- skips its own store's origin (it woke itself). Channel orbit_cancel: `<session>:<attempt>`.
-- Usually sent inside a plan's batched write (one round trip for both).
SELECT pg_notify(x.channel, x.payload) AS notified
FROM json_to_recordset(CAST(:rows AS json)) AS x(channel text, payload text);

-- name: task_stats_by_index
-- Before task_stats, in its transaction: sequential scans off until it ends
-- (set_config's `true`: like SET LOCAL, and a plain query that can be prepared). The
-- planner judges a bitmap scan of orbit_tasks_ready by the share of tasks waiting,
-- assuming them strewn over every page, and chose a parallel scan of the whole table for
-- a backlog of 160,000 among 2.5 million tasks (a scrape of 0.83-1.05 s, against
-- 0.25-0.31 s through the index: docs/operations.md, "Health and metrics"). The waiting
-- tasks are the newest, on the last pages, and the ended ones, which grow without end,
-- are what such a scan reads.
SELECT set_config('enable_seqscan', 'off', true) AS enable_seqscan;

-- name: task_stats
-- The tasks a state can still leave, by queue and state, with the oldest queued instant
-- (metrics, at every scrape on every node): each read through an index whose condition
-- holds only those tasks, never one that has ended (of which a store holds ever more:
-- Orbit deletes no task). The waiting ones through orbit_tasks_ready (each task's row
-- read for its queue: as many as the backlog, which the depth gauge needs anyway), the
-- ones awaiting review through orbit_tasks_review (the queue alone, its state named, so
-- an index-only scan), and the claimed, running and cancelling ones through their live
-- attempts (orbit_attempts_one_live: a claimed or running task has its one live attempt,
-- and a cancelling one keeps its running attempt until the task ends), each joined to
-- its task by id. One statement: one snapshot for all three.
SELECT queue, state, count(*) AS n, min(CASE WHEN state = 'queued' THEN run_after END) AS oldest
FROM orbit_tasks WHERE state IN ('queued', 'scheduled') GROUP BY queue, state
UNION ALL
SELECT queue, 'needs_review' AS state, count(*) AS n, NULL AS oldest
FROM orbit_tasks WHERE state = 'needs_review' GROUP BY queue
UNION ALL
SELECT t.queue, t.state, count(*) AS n, NULL AS oldest
FROM orbit_attempts a JOIN orbit_tasks t ON t.id = a.task_id
WHERE a.state IN ('claimed', 'running') AND t.state IN ('claimed', 'running', 'cancelling')
GROUP BY t.queue, t.state;

-- name: artifact_insert
INSERT INTO orbit_artifacts (id, task_id, attempt_id, name, content_type, size, sha256,
    state, created_at, expires_at)
VALUES (:id, :task_id, :attempt_id, :name, :content_type, 0, NULL, 'uploading', :now,
    :expires_at)
ON CONFLICT (attempt_id, name) DO NOTHING
RETURNING id;

-- name: artifact_ready_named
-- The attempt's committed artifact of this name: a begin that declares the digest it
-- holds is a repeat of the upload that stored it (its reply lost), answered with it.
SELECT * FROM orbit_artifacts
WHERE attempt_id = :attempt_id AND name = :name AND state = 'ready';

-- name: artifact_uploading_delete
-- A begin replaces an unfinished upload of its name: the attempt's earlier one was cut
-- off (its server killed mid-body, so never aborted) or is being given up by its worker.
DELETE FROM orbit_artifacts
WHERE attempt_id = :attempt_id AND name = :name AND state = 'uploading';

-- name: artifact_chunk_insert
-- The upload's row is read FOR SHARE: while a begin replacing it, an abort or a commit
-- holds it, the insert waits, then re-reads it (gone, or 'ready') and inserts nothing,
-- which the store answers INVALID_STATE. Unlocked, the insert saw the row whose delete
-- was not committed yet, and its foreign key check then failed once it was: a 500.
INSERT INTO orbit_artifact_chunks (artifact_id, seq, data)
SELECT :artifact_id, :seq, :data
WHERE EXISTS (SELECT 1 FROM orbit_artifacts WHERE id = :artifact_id AND state = 'uploading'
              FOR SHARE);

-- name: artifact_get
SELECT f.*, a.state AS attempt_state, t.state AS task_state FROM orbit_artifacts f
JOIN orbit_attempts a ON a.id = f.attempt_id
JOIN orbit_tasks t ON t.id = f.task_id
WHERE f.id = :id;

-- name: artifact_lock
SELECT * FROM orbit_artifacts WHERE id = :id FOR UPDATE;

-- name: artifact_ready_seq
-- The committing upload's place in its task's artifact list. Drawn while the commit
-- holds its task's row lock, so a task's commits draw in the order they commit
-- (migration 0010_artifact_order.sql).
SELECT nextval('orbit_artifacts_ready_seq') AS ready_seq;

-- name: artifact_ready
-- :expires_at is the commit's instant + the upload's TTL: an artifact is kept for its TTL
-- from when it became readable, however long its upload took.
UPDATE orbit_artifacts SET state = 'ready', size = :size, sha256 = :sha256,
    ready_seq = :ready_seq, expires_at = :expires_at
WHERE id = :id AND state = 'uploading';

-- name: artifact_seq
-- A ready artifact's place in its task's list: what a cursor issued before the list was
-- ordered by it (an artifact id) stands for.
SELECT ready_seq FROM orbit_artifacts
WHERE id = :id AND task_id = :task_id AND ready_seq IS NOT NULL;

-- name: artifact_delete
DELETE FROM orbit_artifacts WHERE id = :id;

-- name: artifact_list
-- Artifacts of cancelled attempts are never shown: cancel wins over everything an
-- attempt produced, its result and its blobs alike; nor are those of the live attempt
-- of a task being cancelled, which can only end cancelled. An expired one is gone by the
-- clock, whether or not the reaper has deleted it yet. Keyset pages in the order the
-- uploads were committed (ready_seq, 0 for the first page: numbers start at 1), a range
-- of the (task_id, ready_seq) index; an upload not yet committed has none.
SELECT f.* FROM orbit_artifacts f JOIN orbit_attempts a ON a.id = f.attempt_id
JOIN orbit_tasks t ON t.id = f.task_id
WHERE f.task_id = :task_id AND f.ready_seq > :after_seq AND f.state = 'ready'
  AND a.state <> 'cancelled' AND f.expires_at > :now
  AND NOT (t.state = 'cancelling' AND a.state IN ('claimed', 'running'))
ORDER BY f.ready_seq
LIMIT :limit;

-- name: artifact_chunk_get
SELECT data FROM orbit_artifact_chunks WHERE artifact_id = :artifact_id AND seq = :seq;

-- name: artifact_abandoned_delete
-- Uploads whose attempt no longer runs can never be committed (artifact_commit is guarded
-- like any report): their server died mid-body before it could abort them. A commit in
-- flight holds its row (and its attempt is running), so it is never dropped here. Nor is
-- an upload kept for ever while its attempt runs: one begun before :stale_before
-- (StoreConfig.upload_max_us, a day) is dropped too.
DELETE FROM orbit_artifacts
WHERE id IN (SELECT f.id FROM orbit_artifacts f JOIN orbit_attempts a ON a.id = f.attempt_id
             WHERE f.state = 'uploading'
               AND (a.state <> 'running' OR f.created_at <= :stale_before)
             LIMIT :limit FOR UPDATE OF f SKIP LOCKED)
RETURNING id;

-- name: artifact_expired_delete
-- Committed artifacts only: an upload's TTL counts from its commit, and one still
-- uploading is dropped once its attempt has ended (artifact_abandoned_delete). Those that
-- expired by :expired_before, the store's now less StoreConfig.artifact_grace_us: every
-- read treats an artifact as gone from its expiry, and a download begun before it reads
-- its chunks on meanwhile (a delete under it cut its body short).
DELETE FROM orbit_artifacts
WHERE id IN (SELECT id FROM orbit_artifacts WHERE state = 'ready'
               AND expires_at <= :expired_before
             ORDER BY expires_at LIMIT :limit FOR UPDATE SKIP LOCKED)
RETURNING id;

-- name: schedule_insert
INSERT INTO orbit_schedules (name, cron, timezone, template, misfire, max_catch_up, paused,
    next_fire_at, created_at, updated_at)
VALUES (:name, :cron, :timezone, :template, :misfire, :max_catch_up, :paused, :next_fire_at,
    :now, :now)
ON CONFLICT (name) DO NOTHING
RETURNING name;

-- name: schedule_get
SELECT * FROM orbit_schedules WHERE name = :name;

-- name: schedule_list
-- A page of schedules in name order after :after_name: keyset, as queue_list.
SELECT * FROM orbit_schedules WHERE name > :after_name ORDER BY name
LIMIT CAST(:limit AS bigint);

-- name: schedule_lock
SELECT * FROM orbit_schedules WHERE name = :name FOR UPDATE;

-- name: schedule_lock_due
-- A fire's row, as the duty read it (:version), if it is still due and no other node's
-- fire holds it: a node that finds it locked skips it rather than waiting to fire the
-- same instant, which the other's commit has already moved on. created_at tells a
-- schedule deleted and made again under its name (its version back at 1) from the one
-- read.
SELECT * FROM orbit_schedules
WHERE name = :name AND created_at = :created_at AND version = :version
    AND NOT paused AND next_fire_at <= :now
FOR UPDATE SKIP LOCKED;

-- name: schedule_due
-- A page of the schedules due at :now, soonest first, after (:after_at, :after_name):
-- a pass walks every due schedule, so that those a full queue keeps due (the oldest)
-- do not hide the others. Through orbit_schedules_due.
SELECT * FROM orbit_schedules
WHERE NOT paused AND next_fire_at <= :now
    AND (next_fire_at > :after_at OR (next_fire_at = :after_at AND name > :after_name))
ORDER BY next_fire_at, name LIMIT :limit;

-- name: schedule_due_in
SELECT min(next_fire_at) AS next_fire_at FROM orbit_schedules WHERE NOT paused;

-- name: schedule_write
-- A fire's or an operator's change, guarded by the row's version.
UPDATE orbit_schedules
SET paused = :paused, next_fire_at = :next_fire_at, last_fire_at = :last_fire_at,
    updated_at = :now, version = version + 1
WHERE name = :name AND version = :version;

-- name: schedule_delete
DELETE FROM orbit_schedules WHERE name = :name;

-- name: schedule_update
-- An operator's edit (Store.schedule_update), guarded by the row's version as read
-- under its lock.
UPDATE orbit_schedules
SET cron = :cron, timezone = :timezone, template = :template, misfire = :misfire,
    max_catch_up = :max_catch_up, next_fire_at = :next_fire_at, updated_at = :now,
    version = version + 1
WHERE name = :name AND version = :version;

-- name: artifact_ready_seq_last
-- The largest place in an artifact list ever drawn (artifact_ready_seq), by any task's
-- commit: a cursor past it is none the server issued. Expired artifacts are deleted, so
-- the sequence, not the rows, remembers it. Not is_called: nothing drawn since a setval
-- (the migration's, max + 1), whose value nextval hands out next.
SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END AS ready_seq
FROM orbit_artifacts_ready_seq;

-- name: attempt_expiry_pull_back
-- The reaper's pass after the store's clock went back: each live attempt whose claim
-- lease ends later than :claim_after, or whose run lease ends later than :lease_after
-- (now + twice StoreConfig.claim_ttl_us, lease_ttl_us: no node granted such an end, even
-- one whose TTL is up to twice this one's), gets :claim_until or :lease_until (now + the
-- TTL) as its end, so that a dead worker's attempt expires a TTL from now rather than
-- the step's length later. Normally it matches no row: a walk of the live attempts
-- (orbit_attempts_one_live, its predicate in full, as in reap_candidates), as many as
-- the workers' slots. A row another transaction holds is skipped: a renew writes
-- a lease from now itself, and the next pass takes any other.
UPDATE orbit_attempts SET
    claim_expires_at = CASE WHEN state = 'claimed' THEN CAST(:claim_until AS bigint)
        ELSE claim_expires_at END,
    lease_expires_at = CASE WHEN state = 'running' THEN CAST(:lease_until AS bigint)
        ELSE lease_expires_at END
WHERE id IN (SELECT id FROM orbit_attempts
             WHERE state IN ('claimed', 'running')
                 AND CASE state WHEN 'claimed' THEN claim_expires_at > :claim_after
                     ELSE lease_expires_at > :lease_after END
             FOR UPDATE SKIP LOCKED)
RETURNING state;

-- name: session_expiry_pull_back
-- The same for the live sessions whose expiry is later than :after (now + twice
-- StoreConfig.session_ttl_us), given :until (now + the TTL): a range of
-- orbit_sessions_expiry, empty but after a step.
UPDATE orbit_sessions SET expires_at = :until
WHERE id IN (SELECT id FROM orbit_sessions WHERE state = 'live' AND expires_at > :after
             FOR UPDATE SKIP LOCKED)
RETURNING id;
