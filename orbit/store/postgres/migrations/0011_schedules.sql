-- Schedules (docs/concepts.md, "Schedules"): a cron expression in a time zone that
-- submits its template at each fire instant. A new table and a partial index on the due
-- instant of those not paused, which every node's schedule duty reads once a second
-- (Store.schedule_due): nothing existing is rewritten, so this migration takes no
-- time on a large database. A fire locks its row (FOR UPDATE SKIP LOCKED), inserts
-- the task and advances next_fire_at in one transaction.
CREATE TABLE orbit_schedules (
    name          text COLLATE "C" PRIMARY KEY,
    cron          text NOT NULL,
    timezone      text NOT NULL,
    template      text NOT NULL,  -- canonical JSON: a submit's fields (orbit.store.rows)
    misfire       text NOT NULL CHECK (misfire IN ('skip', 'run_once', 'catch_up')),
    max_catch_up  integer NOT NULL CHECK (max_catch_up BETWEEN 1 AND 1000),
    paused        boolean NOT NULL DEFAULT false,
    next_fire_at  bigint NOT NULL,
    last_fire_at  bigint,
    created_at    bigint NOT NULL,
    updated_at    bigint NOT NULL,
    version       bigint NOT NULL DEFAULT 1
);
CREATE INDEX orbit_schedules_due ON orbit_schedules (next_fire_at) WHERE NOT paused;
