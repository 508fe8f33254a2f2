-- Orbit's runtime SQL for SQLite. Each query is named by its `-- name:` header and
-- referred to by that name; parameters are written `:name`. A list parameter arrives as
-- a JSON array and is read with json_each. A `*_many` query is a one-row statement
-- that the store runs with executemany inside the same transaction. There is no row
-- locking: every write transaction holds the database's write lock (BEGIN IMMEDIATE).

-- name: commit_relaxed
-- The next commit skips its fsync of the WAL (claims only): a crash of the process
-- loses nothing, a crash of the machine may undo it.
PRAGMA synchronous = NORMAL;

-- name: commit_durable
-- Back to the default: every commit is on disk before it returns.
PRAGMA synchronous = FULL;

-- name: claim_lock
SELECT 1 AS locked;

-- name: schema_version_create
CREATE TABLE IF NOT EXISTS orbit_schema_version (
    version    integer PRIMARY KEY,
    applied_at bigint NOT NULL
);

-- name: schema_version_present
-- Whether the version table exists: migrate reads it before it takes any lock.
SELECT count(*) > 0 AS present FROM sqlite_master
WHERE type = 'table' AND name = 'orbit_schema_version';

-- name: schema_version_get
SELECT coalesce(max(version), 0) AS version FROM orbit_schema_version;

-- name: schema_version_insert
INSERT INTO orbit_schema_version (version, applied_at) VALUES (:version, :now);

-- name: migrate_lock
SELECT 1 AS locked;

-- name: queue_insert
INSERT INTO orbit_queues (name, max_concurrency, rate, burst, paused, tokens, tokens_at, created_at,
    max_queued)
VALUES (:name, :max_concurrency, :rate, :burst, 0, :tokens, :now, :now, :max_queued)
ON CONFLICT (name) DO NOTHING
RETURNING name;

-- name: queue_get
SELECT * FROM orbit_queues WHERE name = :name;

-- name: queue_get_many
SELECT * FROM orbit_queues WHERE name IN (SELECT value FROM json_each(:names));

-- name: queue_all
-- Every queue, for a claim and for a changed cap's wake-up.
SELECT * FROM orbit_queues ORDER BY name;

-- name: queue_list
-- A page of queues in name order after :after_name, a walk of the primary key. The
-- first page's :after_name is '', which sorts before every name, so the condition is
-- always a range of the key's index (an ":x IS NULL OR" form reads every row from the
-- start, on SQLite and in PostgreSQL's generic plan). A NULL limit is every row (SQLite
-- refuses LIMIT NULL, and reads a negative one as no limit).
SELECT * FROM orbit_queues WHERE name > :after_name ORDER BY name LIMIT coalesce(:limit, -1);

-- name: queue_lock
SELECT * FROM orbit_queues WHERE name = :name;

-- name: queue_share
SELECT * FROM orbit_queues WHERE name = :name;

-- name: queue_share_for_attempts
-- An attempt carries its task's queue (copied by the claim; neither ever changes): the
-- attempts alone name the queues, without a second lookup of each task.
SELECT * FROM orbit_queues
WHERE name IN (SELECT queue FROM orbit_attempts WHERE id IN (SELECT value FROM json_each(:ids)))
ORDER BY name;

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
UPDATE orbit_queues SET tokens = :tokens, tokens_at = :tokens_at WHERE name = :name;

-- name: tenant_upsert
INSERT INTO orbit_tenants (name, max_concurrency, max_queued)
VALUES (:name, :max_concurrency, :max_queued)
ON CONFLICT (name) DO UPDATE
SET max_concurrency = excluded.max_concurrency, max_queued = excluded.max_queued;

-- name: tenant_limits
-- A page of the tenants with a cap of either kind (a tenant left out has neither), in
-- name order after :after_name ('' for the first page), a range of the primary key as
-- queue_list's is. A tenant whose caps were removed keeps its row and is skipped. A NULL
-- limit is every row (SQLite refuses LIMIT NULL, and reads a negative one as no limit).
SELECT name, max_concurrency, max_queued FROM orbit_tenants
WHERE name > :after_name AND (max_concurrency IS NOT NULL OR max_queued IS NOT NULL)
ORDER BY name LIMIT coalesce(:limit, -1);

-- name: tenant_queued_caps
-- The caps on waiting tasks of these tenants, where set: read by every submit with its
-- queues (one statement on PostgreSQL), a lookup of the primary key per tenant.
SELECT name, max_queued FROM orbit_tenants WHERE name IN (SELECT value FROM json_each(:names)) AND max_queued IS NOT NULL;

-- name: tenant_caps
SELECT name, max_concurrency FROM orbit_tenants WHERE max_concurrency IS NOT NULL;

-- name: setting_upsert
INSERT INTO orbit_settings (name, int_value) VALUES (:name, :int_value)
ON CONFLICT (name) DO UPDATE SET int_value = excluded.int_value;

-- name: setting_get
SELECT int_value FROM orbit_settings WHERE name = :name;

-- name: depth_lock
-- SQLite has one writer: BEGIN IMMEDIATE serialises the submits already.
SELECT 1 AS locked;

-- name: idempotency_lock
-- SQLite has one writer: BEGIN IMMEDIATE serialises the submits already.
SELECT 1 AS locked;

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
    LIMIT (SELECT max(coalesce(max(max_queued) - :adding + 1, 0), 0) FROM orbit_queues
           WHERE name = :name)) AS w) AS depth
FROM orbit_queues WHERE name = :name;

-- name: tenant_depth
-- queue_depth for a tenant, across every queue.
SELECT max_queued, (SELECT count(*) FROM (
    SELECT 1 FROM orbit_tasks WHERE tenant = :name AND state IN ('queued', 'scheduled')
    ORDER BY priority DESC, id
    LIMIT (SELECT max(coalesce(max(max_queued) - :adding + 1, 0), 0) FROM orbit_tenants
           WHERE name = :name)) AS w) AS depth
FROM orbit_tenants WHERE name = :name;

-- name: task_submit_many
-- New tasks and the `submitted` event of each: two statements, each run over every row
-- (the driver splits a query on the ';' that ends a line). The event is made from the row
-- the first statement wrote, so a task skipped for a taken idempotency key gets none. The
-- event data is spelled as compact_json(sort_keys=True) spells it: handler names and
-- digests need no escaping (see check_name). The columns every new task starts with are
-- literals (transitions.NEW_TASK_FIXED, in this order; updated_at is created_at).
INSERT INTO orbit_tasks (
    id, queue, handler, tenant, priority, payload, payload_digest, idempotency_key,
    parent_id, retry_safe, max_attempts, backoff_base_us, backoff_factor, backoff_max_us,
    attempt_timeout_us, deadline, run_after, state, attempts_used, fence, cancel_requested,
    result, error_code, error_message, error_retryable, result_digest, result_version,
    created_at, updated_at, finished_at, version)
VALUES (
    :id, :queue, :handler, :tenant, :priority, :payload, :payload_digest, :idempotency_key,
    :parent_id, :retry_safe, :max_attempts, :backoff_base_us, :backoff_factor,
    :backoff_max_us, :attempt_timeout_us, :deadline, :run_after, :state, 0,
    0, 0, NULL, NULL, NULL, NULL,
    NULL, 0, :created_at, :created_at, NULL, 1)
ON CONFLICT (tenant, queue, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING;
INSERT INTO orbit_events (at, kind, task_id, attempt_id, session_id, queue, tenant,
    task_from, task_to, attempt_from, attempt_to, code, data)
SELECT created_at, 'submitted', id, NULL, NULL, queue, tenant, NULL, state, NULL, NULL, NULL,
    '{"handler":"' || handler || '","payload_digest":"' || payload_digest || '"}'
FROM orbit_tasks WHERE id = :id;

-- name: task_get
SELECT * FROM orbit_tasks WHERE id = :id;

-- name: task_share
SELECT * FROM orbit_tasks WHERE id = :id;

-- name: task_lock_many
SELECT * FROM orbit_tasks WHERE id IN (SELECT value FROM json_each(:ids)) ORDER BY id;

-- name: task_lock_for_attempts
-- The tasks of these attempts, as task_lock_many would lock them (SQLite's write lock is
-- already held by the transaction).
-- Every column but the payload, which no report reads and which can be large: such a
-- value is read from its overflow pages by every read that selects it. The tasks come
-- back with an empty payload (Store._report_batch).
SELECT '' AS payload, id, queue, handler, tenant, priority, payload_digest, idempotency_key,
    parent_id, retry_safe, max_attempts, backoff_base_us, backoff_factor, backoff_max_us,
    attempt_timeout_us, deadline, run_after, state, attempts_used, fence, cancel_requested,
    result, error_code, error_message, error_retryable, result_digest, result_version,
    created_at, updated_at, finished_at, version
FROM orbit_tasks
WHERE id IN (SELECT task_id FROM orbit_attempts WHERE id IN (SELECT value FROM json_each(:ids)))
ORDER BY id;

-- name: task_lock_for_starts
-- task_lock_for_attempts for a batch of starts (Store.attempt_start_many): only the
-- columns a start reads or writes back; rows.start_tasks_from_table fills the others,
-- which it never reads. Each column selected costs every row its conversion.
SELECT id, queue, tenant, max_attempts, attempt_timeout_us, deadline, run_after, state,
    attempts_used, fence, cancel_requested, result, error_code, error_message,
    error_retryable, result_digest, result_version, updated_at, finished_at, version
FROM orbit_tasks
WHERE id IN (SELECT task_id FROM orbit_attempts WHERE id IN (SELECT value FROM json_each(:ids)))
ORDER BY id;

-- name: task_lock_many_skip_locked
SELECT * FROM orbit_tasks WHERE id IN (SELECT value FROM json_each(:ids)) ORDER BY id;

-- name: task_by_idempotency_keys
SELECT * FROM orbit_tasks
WHERE tenant = :tenant AND queue = :queue
  AND idempotency_key IN (SELECT value FROM json_each(:keys));

-- name: task_children
-- The children of these tasks, one level of a tree, through the partial index
-- orbit_tasks_parent (store._lock_tree walks a tree a level per statement; see
-- PostgreSQL's task_children for why not a recursive CTE).
SELECT id FROM orbit_tasks WHERE parent_id IN (SELECT value FROM json_each(:ids));

-- name: task_tree_ended
-- A walked tree (store._tree_ended), checked in one statement, so at one instant: the
-- task's row version (NULL if there is none), and how many children the walked tasks
-- have, and how many of those have not ended (the task's own state the store has read).
SELECT
    (SELECT version FROM orbit_tasks WHERE id = :id) AS version,
    count(*) AS children,
    coalesce(sum(state NOT IN ('succeeded', 'failed', 'cancelled')), 0) AS live
FROM orbit_tasks WHERE parent_id IN (SELECT value FROM json_each(:ids));

-- name: task_cancelled_lineage
-- For each of these tasks, the tasks among itself and its ancestors (parent_id, up to
-- the root) whose cancel was asked: a cancel cascades down a whole tree, so a task
-- under any of them may not be retried, nor take a new child. Unlocked: the caller
-- holds a lock on a task of the lineage, which every such cancel also locks. Its state
-- tells a cancel requested (cancelling) from one done, for the refusal's message.
WITH RECURSIVE up(start_id, id) AS (
    SELECT id, id FROM orbit_tasks WHERE id IN (SELECT value FROM json_each(:ids))
    UNION ALL
    SELECT up.start_id, t.parent_id FROM up JOIN orbit_tasks t ON t.id = up.id
    WHERE t.parent_id IS NOT NULL
)
SELECT up.start_id AS id, t.id AS cancelled_id, t.state AS cancelled_state
FROM up JOIN orbit_tasks t ON t.id = up.id
WHERE t.cancel_requested OR t.state = 'cancelled'
ORDER BY up.start_id, t.id;

-- name: task_ready_select
-- `locked_at` is NULL: the store reads the clock in-process (the write lock is held).
-- A queued task is due whatever its run_after says (postgres/queries.sql says why).
SELECT *, NULL AS locked_at FROM orbit_tasks
WHERE state IN ('queued', 'scheduled')
  AND (state = 'queued' OR run_after <= :now)
  AND (deadline IS NULL OR deadline > :now)
  AND handler IN (SELECT value FROM json_each(:handlers))
  AND queue NOT IN (SELECT value FROM json_each(:skip_queues))
  AND tenant NOT IN (SELECT value FROM json_each(:skip_tenants))
  AND id NOT IN (SELECT value FROM json_each(:skip_ids))
ORDER BY priority DESC, id
LIMIT :limit;

-- name: task_write_many
UPDATE orbit_tasks SET
    state = :state, attempts_used = :attempts_used, fence = :fence,
    cancel_requested = :cancel_requested, run_after = :run_after,
    max_attempts = :max_attempts, result = :result, error_code = :error_code,
    error_message = :error_message, error_retryable = :error_retryable,
    result_digest = :result_digest, result_version = :result_version,
    updated_at = :updated_at, finished_at = :finished_at, version = :version
WHERE id = :id AND version = :expect_version;

-- name: task_list
SELECT * FROM orbit_tasks
WHERE (:queue IS NULL OR queue = :queue)
  AND (:state IS NULL OR state = :state)
  AND (:tenant IS NULL OR tenant = :tenant)
  AND (:handler IS NULL OR handler = :handler)
  AND (:created_after IS NULL OR created_at >= :created_after)
  AND (:created_before IS NULL OR created_at < :created_before)
  AND (:after_id IS NULL OR id > :after_id)
ORDER BY id
LIMIT :limit;

-- name: task_list_range
-- task_list within the ids between :id_from and :id_to (both excluded), which the store
-- derives from after_id and the created_at window (ids are time-ordered: Store.task_list):
-- as plain conditions they bound the search of the primary key, where task_list's
-- ":x IS NULL OR" form scans it from the first task. The created_at conditions stay: the
-- id bounds only narrow what they allow.
SELECT * FROM orbit_tasks
WHERE id > :id_from AND id < :id_to
  AND (:queue IS NULL OR queue = :queue)
  AND (:state IS NULL OR state = :state)
  AND (:tenant IS NULL OR tenant = :tenant)
  AND (:handler IS NULL OR handler = :handler)
  AND (:created_after IS NULL OR created_at >= :created_after)
  AND (:created_before IS NULL OR created_at < :created_before)
ORDER BY id
LIMIT :limit;

-- name: task_list_by_parent
-- task_list with parent_id: its own query, because the equality must stand alone for the
-- partial index orbit_tasks_parent to be used (an ":x IS NULL OR" form walks every task).
SELECT * FROM orbit_tasks
WHERE parent_id = :parent_id
  AND (:queue IS NULL OR queue = :queue)
  AND (:state IS NULL OR state = :state)
  AND (:tenant IS NULL OR tenant = :tenant)
  AND (:handler IS NULL OR handler = :handler)
  AND (:created_after IS NULL OR created_at >= :created_after)
  AND (:created_before IS NULL OR created_at < :created_before)
  AND (:after_id IS NULL OR id > :after_id)
ORDER BY id
LIMIT :limit;

-- name: task_count_by_state
SELECT state, count(*) AS n FROM orbit_tasks GROUP BY state;

-- name: attempt_insert_many
INSERT INTO orbit_attempts (
    id, task_id, number, session_id, session_epoch, fence, state, claimed_at,
    claim_expires_at, started_at, lease_expires_at, ended_at, finish_digest, receipt,
    queue, tenant, handler)
VALUES (
    :id, :task_id, :number, :session_id, :session_epoch, :fence, :state, :claimed_at,
    :claim_expires_at, :started_at, :lease_expires_at, :ended_at, :finish_digest, :receipt,
    :queue, :tenant, :handler);

-- name: attempt_write_many
UPDATE orbit_attempts SET
    state = :state, started_at = :started_at, lease_expires_at = :lease_expires_at,
    ended_at = :ended_at, finish_digest = :finish_digest, receipt = :receipt
WHERE id = :id AND state = :expect_state AND lease_expires_at IS :expect_lease;

-- name: attempt_get
SELECT * FROM orbit_attempts WHERE id = :id;

-- name: attempt_lock_many
SELECT * FROM orbit_attempts WHERE id IN (SELECT value FROM json_each(:ids)) ORDER BY id;

-- name: attempt_live_for_tasks
SELECT * FROM orbit_attempts
WHERE task_id IN (SELECT value FROM json_each(:task_ids)) AND state IN ('claimed', 'running');

-- name: attempt_list
-- A page of a task's attempts in number order after :after_number (0 for the first
-- page: numbers start at 1), a range of the (task_id, number) unique index. A NULL
-- limit is every row (SQLite refuses LIMIT NULL, and reads a negative one as no limit).
SELECT * FROM orbit_attempts
WHERE task_id = :task_id AND number > :after_number
ORDER BY number
LIMIT coalesce(:limit, -1);

-- name: attempt_outcome_list
-- The events that ended these attempts of the task (claimed or running to any other
-- state), in the log's order: each attempt's end is written in the transaction that
-- ends it. A range of the task's event index, filtered; read for an attempt list only.
SELECT attempt_id, kind, code FROM orbit_events
WHERE task_id = :task_id AND attempt_id IN (SELECT value FROM json_each(:ids))
  AND attempt_from IN ('claimed', 'running')
  AND attempt_to NOT IN ('claimed', 'running')
ORDER BY id;

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
WHERE a.session_id IN (SELECT value FROM json_each(:session_ids))
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
    AND session_id IN (SELECT value FROM json_each(:session_ids));

-- name: session_insert
INSERT INTO orbit_sessions (id, name, node_id, epoch, secret_hash, capabilities,
    max_concurrency, capacity_seq, draining, state, expires_at, created_at)
VALUES (:id, :name, :node_id, :epoch, :secret_hash, :capabilities, :max_concurrency,
    :capacity_seq, :draining, :state, :expires_at, :created_at);

-- name: session_get
SELECT * FROM orbit_sessions WHERE id = :id;

-- name: session_lock
SELECT * FROM orbit_sessions WHERE id = :id;

-- name: session_lock_many_skip_locked
SELECT * FROM orbit_sessions WHERE id IN (SELECT value FROM json_each(:ids)) ORDER BY id;

-- name: session_share
SELECT * FROM orbit_sessions WHERE id = :id;

-- name: session_list
-- In id order, which is the order sessions were opened in (uuid7 ids made from the
-- instant written as created_at), so a page is a walk of the primary key. A NULL limit
-- is every session (SQLite refuses LIMIT NULL, and reads a negative one as no limit).
SELECT * FROM orbit_sessions
WHERE (:state IS NULL OR state = :state)
  AND (:after_id IS NULL OR id > :after_id)
ORDER BY id
LIMIT coalesce(:limit, -1);

-- name: session_list_live
-- session_list's live sessions, read through the partial index of live sessions
-- (orbit_sessions_expiry) and sorted: the walk of the primary key read every expired
-- session too, and they are never deleted (48-118 ms a page at 225,000 of them).
SELECT * FROM orbit_sessions INDEXED BY orbit_sessions_expiry
WHERE state = 'live'
  AND (:after_id IS NULL OR id > :after_id)
ORDER BY id
LIMIT coalesce(:limit, -1);

-- name: session_write_many
UPDATE orbit_sessions SET
    node_id = :node_id, epoch = :epoch, secret_hash = :secret_hash,
    capabilities = :capabilities, max_concurrency = :max_concurrency,
    capacity_seq = :capacity_seq, draining = :draining, state = :state,
    expires_at = :expires_at
WHERE id = :id AND epoch = :expect_epoch;

-- name: session_expired_select
SELECT id FROM orbit_sessions WHERE state = 'live' AND expires_at <= :now
ORDER BY expires_at LIMIT :limit;

-- name: event_insert_many
INSERT INTO orbit_events (at, kind, task_id, attempt_id, session_id, queue, tenant,
    task_from, task_to, attempt_from, attempt_to, code, data)
VALUES (:at, :kind, :task_id, :attempt_id, :session_id, :queue, :tenant, :task_from,
    :task_to, :attempt_from, :attempt_to, :code, :data);

-- name: event_list
-- One writer at a time: ids are in commit order and every visible event is settled, so
-- each row's txid is 0, below the horizon 1 (the PostgreSQL query's columns, Store.event_list).
-- Every event's xid is 0 (the column is PostgreSQL's): a position (after_xid, after_id)
-- with another xid, or that names no event, matches nothing, as there.
SELECT *, '0' AS txid, '1' AS horizon FROM orbit_events
WHERE id > :after_id AND :after_xid = 0
    AND (:after_id = 0 OR EXISTS (SELECT 1 FROM orbit_events c WHERE c.id = :after_id))
ORDER BY id
LIMIT :limit;

-- name: event_list_task
SELECT *, '0' AS txid, '1' AS horizon FROM orbit_events
WHERE task_id = :task_id AND id > :after_id AND :after_xid = 0
    AND (:after_id = 0 OR EXISTS (SELECT 1 FROM orbit_events c WHERE c.id = :after_id))
ORDER BY id
LIMIT :limit;

-- name: event_exists
SELECT id FROM orbit_events WHERE id = :id AND :xid = 0;

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
    SELECT min(expires_at) + :artifact_grace FROM orbit_artifacts
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
-- was paged. A NULL limit is every row (SQLite refuses LIMIT NULL, and reads a negative
-- one as no limit).
SELECT id, name, scopes, created_at, revoked_at FROM orbit_tokens
WHERE id > :after_id
ORDER BY id
LIMIT coalesce(:limit, -1);

-- name: token_lock
SELECT id, name, scopes, created_at, revoked_at FROM orbit_tokens WHERE id = :id;

-- name: token_live
-- Which of these token ids are still accepted (known, not revoked): a node re-checks the
-- tokens its open worker connections were opened with (orbit/server/revocation.py).
SELECT id FROM orbit_tokens WHERE id IN (SELECT value FROM json_each(:ids)) AND revoked_at IS NULL;

-- name: token_revoke
-- Only a token not revoked yet: a second revoke keeps the first revoked_at.
UPDATE orbit_tokens SET revoked_at = :now WHERE id = :id AND revoked_at IS NULL;

-- name: task_stats
-- The tasks a state can still leave, by queue and state, with the oldest queued instant,
-- each read through an index that holds only those tasks, never one that has ended: see
-- PostgreSQL's. INDEXED BY holds each read to its partial index (an error, not a scan of
-- every task, should one no longer serve), and CROSS JOIN walks the live attempts first,
-- each task then by its id, whatever statistics an ANALYZE left.
SELECT queue, state, count(*) AS n, min(CASE WHEN state = 'queued' THEN run_after END) AS oldest
FROM orbit_tasks INDEXED BY orbit_tasks_ready WHERE state IN ('queued', 'scheduled')
GROUP BY queue, state
UNION ALL
SELECT queue, 'needs_review' AS state, count(*) AS n, NULL AS oldest
FROM orbit_tasks INDEXED BY orbit_tasks_review WHERE state = 'needs_review' GROUP BY queue
UNION ALL
SELECT t.queue, t.state, count(*) AS n, NULL AS oldest
FROM orbit_attempts a INDEXED BY orbit_attempts_one_live CROSS JOIN orbit_tasks t
    ON t.id = a.task_id
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
INSERT INTO orbit_artifact_chunks (artifact_id, seq, data)
SELECT :artifact_id, :seq, :data
WHERE EXISTS (SELECT 1 FROM orbit_artifacts WHERE id = :artifact_id AND state = 'uploading');

-- name: artifact_get
SELECT f.*, a.state AS attempt_state, t.state AS task_state FROM orbit_artifacts f
JOIN orbit_attempts a ON a.id = f.attempt_id
JOIN orbit_tasks t ON t.id = f.task_id
WHERE f.id = :id;

-- name: artifact_lock
SELECT * FROM orbit_artifacts WHERE id = :id;

-- name: artifact_ready_seq
-- The committing upload's place in its task's artifact list: the next number of a
-- counter that one writer at a time bumps, so in commit order, and never one an
-- artifact had before (migration 0006_artifact_order.sql). No row: the counter was
-- deleted by hand, and artifact_ready_seq_first starts it again.
UPDATE orbit_settings SET int_value = int_value + 1 WHERE name = 'artifact_ready_seq'
RETURNING int_value AS ready_seq;

-- name: artifact_ready_seq_first
-- The counter started again after every place given: a statement of its own, as the
-- max() reads every artifact (an upsert evaluated it on every commit).
INSERT INTO orbit_settings (name, int_value)
VALUES ('artifact_ready_seq', (SELECT coalesce(max(ready_seq), 0) + 1 FROM orbit_artifacts))
RETURNING int_value AS ready_seq;

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
             LIMIT :limit)
RETURNING id;

-- name: artifact_chunks_shed
-- Some of an artifact's chunks, before its row goes (Store._shed_chunks): SQLite built
-- with SECURE_DELETE overwrites every page a delete frees, so one transaction that
-- deleted a large upload whole wrote as much to the -wal as the upload had.
DELETE FROM orbit_artifact_chunks
WHERE artifact_id = :artifact_id
  AND seq IN (SELECT seq FROM orbit_artifact_chunks WHERE artifact_id = :artifact_id
              ORDER BY seq LIMIT :limit);

-- name: database_free_bytes
-- The pages free inside the database file, in bytes: SQLite fills them before it grows
-- the file, which never shrinks (Store.artifact_disk_room counts them as free).
SELECT f.freelist_count * p.page_size AS free
FROM pragma_freelist_count() AS f, pragma_page_size() AS p;

-- name: artifact_abandoned_select
-- What artifact_abandoned_delete drops for an ended attempt, read first so that their
-- chunks go a few at a time (Store._shed_chunks). Not the uploads past
-- StoreConfig.upload_max_us whose attempt runs: one of them may still be committed, and
-- only the delete of its row, which a commit in flight holds, is safe from that.
SELECT f.id FROM orbit_artifacts f JOIN orbit_attempts a ON a.id = f.attempt_id
WHERE f.state = 'uploading' AND a.state <> 'running'
LIMIT :limit;

-- name: artifact_expired_select
-- What artifact_expired_delete drops, read first as artifact_abandoned_select is.
SELECT id FROM orbit_artifacts WHERE state = 'ready' AND expires_at <= :expired_before
ORDER BY expires_at LIMIT :limit;

-- name: artifact_expired_delete
-- Committed artifacts only: an upload's TTL counts from its commit, and one still
-- uploading is dropped once its attempt has ended (artifact_abandoned_delete). Those that
-- expired by :expired_before, the store's now less StoreConfig.artifact_grace_us: every
-- read treats an artifact as gone from its expiry, and a download begun before it reads
-- its chunks on meanwhile (a delete under it cut its body short).
DELETE FROM orbit_artifacts
WHERE id IN (SELECT id FROM orbit_artifacts WHERE state = 'ready'
               AND expires_at <= :expired_before
             ORDER BY expires_at LIMIT :limit)
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
SELECT * FROM orbit_schedules WHERE name > :after_name ORDER BY name LIMIT coalesce(:limit, -1);

-- name: schedule_lock
-- SQLite's write transaction holds the whole database: no row lock to take.
SELECT * FROM orbit_schedules WHERE name = :name;

-- name: schedule_lock_due
SELECT * FROM orbit_schedules
WHERE name = :name AND created_at = :created_at AND version = :version
    AND NOT paused AND next_fire_at <= :now;

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
-- the counter, not the rows, remembers it; with the counter's row deleted by hand, the
-- largest place an artifact still has (where artifact_ready_seq_first starts again).
SELECT coalesce(
    (SELECT int_value FROM orbit_settings WHERE name = 'artifact_ready_seq'),
    (SELECT max(ready_seq) FROM orbit_artifacts),
    0
) AS ready_seq;

-- name: attempt_expiry_pull_back
-- The reaper's pass after the store's clock went back: each live attempt whose claim
-- lease ends later than :claim_after, or whose run lease ends later than :lease_after
-- (now + twice StoreConfig.claim_ttl_us, lease_ttl_us: no node granted such an end, even
-- one whose TTL is up to twice this one's), gets :claim_until or :lease_until (now + the
-- TTL) as its end, so that a dead worker's attempt expires a TTL from now rather than
-- the step's length later. Normally it matches no row: a walk of the live attempts
-- (orbit_attempts_one_live, its predicate in full, as in reap_candidates), as many as
-- the workers' slots.
UPDATE orbit_attempts SET
    claim_expires_at = CASE WHEN state = 'claimed' THEN :claim_until
        ELSE claim_expires_at END,
    lease_expires_at = CASE WHEN state = 'running' THEN :lease_until
        ELSE lease_expires_at END
WHERE state IN ('claimed', 'running')
    AND CASE state WHEN 'claimed' THEN claim_expires_at > :claim_after
        ELSE lease_expires_at > :lease_after END
RETURNING state;

-- name: session_expiry_pull_back
-- The same for the live sessions whose expiry is later than :after (now + twice
-- StoreConfig.session_ttl_us), given :until (now + the TTL): a range of
-- orbit_sessions_expiry, empty but after a step.
UPDATE orbit_sessions SET expires_at = :until
WHERE state = 'live' AND expires_at > :after
RETURNING id;
