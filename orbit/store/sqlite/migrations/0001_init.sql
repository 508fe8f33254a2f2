-- Orbit schema v1 (SQLite). Instants and durations are bigint microseconds since
-- the Unix epoch, read from the clock after the write lock (BEGIN IMMEDIATE) is held.

CREATE TABLE orbit_queues (
    name            text PRIMARY KEY,
    max_concurrency integer NOT NULL CHECK (max_concurrency >= 1),
    rate            REAL NOT NULL CHECK (rate >= 0),
    burst           integer NOT NULL CHECK (burst >= 1),
    paused          INTEGER NOT NULL DEFAULT 0,
    tokens          REAL NOT NULL,
    tokens_at       bigint NOT NULL,
    created_at      bigint NOT NULL
);

CREATE TABLE orbit_tenants (
    name            text PRIMARY KEY,
    max_concurrency integer CHECK (max_concurrency >= 1)
);

CREATE TABLE orbit_settings (
    name      text PRIMARY KEY,
    int_value bigint
);

CREATE TABLE orbit_tasks (
    id                 text PRIMARY KEY,
    queue              text NOT NULL REFERENCES orbit_queues (name),
    handler            text NOT NULL,
    tenant             text NOT NULL,
    priority           integer NOT NULL,
    payload            text NOT NULL,
    payload_digest     text NOT NULL,
    idempotency_key    text,
    parent_id          text REFERENCES orbit_tasks (id),
    retry_safe         INTEGER NOT NULL,
    max_attempts       integer NOT NULL CHECK (max_attempts >= 1),
    backoff_base_us    bigint NOT NULL,
    backoff_factor     REAL NOT NULL,
    backoff_max_us     bigint NOT NULL,
    attempt_timeout_us bigint,
    deadline           bigint,
    run_after          bigint NOT NULL,
    state              text NOT NULL,
    attempts_used      integer NOT NULL CHECK (attempts_used >= 0),
    fence              bigint NOT NULL,
    cancel_requested   INTEGER NOT NULL,
    result             text,
    error_code         text,
    error_message      text,
    error_retryable    INTEGER,
    result_digest      text,
    result_version     bigint NOT NULL,
    created_at         bigint NOT NULL,
    updated_at         bigint NOT NULL,
    finished_at        bigint,
    version            bigint NOT NULL
);
CREATE UNIQUE INDEX orbit_tasks_idempotency ON orbit_tasks (tenant, queue, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX orbit_tasks_ready ON orbit_tasks (priority DESC, id)
    WHERE state IN ('queued', 'scheduled');
CREATE INDEX orbit_tasks_parent ON orbit_tasks (parent_id) WHERE parent_id IS NOT NULL;
CREATE INDEX orbit_tasks_deadline ON orbit_tasks (deadline)
    WHERE deadline IS NOT NULL AND state IN ('queued', 'scheduled', 'claimed', 'running');
CREATE INDEX orbit_tasks_scheduled ON orbit_tasks (run_after) WHERE state = 'scheduled';

CREATE TABLE orbit_attempts (
    id               text PRIMARY KEY,
    task_id          text NOT NULL REFERENCES orbit_tasks (id),
    number           integer NOT NULL,
    session_id       text NOT NULL,
    session_epoch    bigint NOT NULL,
    fence            bigint NOT NULL,
    state            text NOT NULL,
    claimed_at       bigint NOT NULL,
    claim_expires_at bigint NOT NULL,
    started_at       bigint,
    lease_expires_at bigint,
    ended_at         bigint,
    finish_digest    text,
    receipt          text,
    queue            text NOT NULL,
    tenant           text NOT NULL,
    handler          text NOT NULL,
    UNIQUE (task_id, number)
);
-- I1, enforced by the database itself: at most one live attempt per task.
CREATE UNIQUE INDEX orbit_attempts_one_live ON orbit_attempts (task_id)
    WHERE state IN ('claimed', 'running');
CREATE INDEX orbit_attempts_claim_expiry ON orbit_attempts (claim_expires_at)
    WHERE state = 'claimed';
CREATE INDEX orbit_attempts_lease_expiry ON orbit_attempts (lease_expires_at)
    WHERE state = 'running';
CREATE INDEX orbit_attempts_live_session ON orbit_attempts (session_id)
    WHERE state IN ('claimed', 'running');

CREATE TABLE orbit_sessions (
    id              text PRIMARY KEY,
    name            text NOT NULL,
    node_id         text NOT NULL,
    epoch           bigint NOT NULL,
    secret_hash     text NOT NULL,
    capabilities    text NOT NULL,
    max_concurrency integer NOT NULL,
    capacity_seq    bigint NOT NULL,
    draining        INTEGER NOT NULL,
    state           text NOT NULL,
    expires_at      bigint NOT NULL,
    created_at      bigint NOT NULL
);
CREATE INDEX orbit_sessions_expiry ON orbit_sessions (expires_at) WHERE state = 'live';

CREATE TABLE orbit_events (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    at           bigint NOT NULL,
    kind         text NOT NULL,
    task_id      text,
    attempt_id   text,
    session_id   text,
    queue        text,
    tenant       text,
    task_from    text,
    task_to      text,
    attempt_from text,
    attempt_to   text,
    code         text,
    data         text
);
CREATE INDEX orbit_events_task ON orbit_events (task_id, id) WHERE task_id IS NOT NULL;
