-- Schedules: see the PostgreSQL migration 0011_schedules.sql. SQLite has one writer at
-- a time, so a fire's transaction needs no row lock.
CREATE TABLE orbit_schedules (
    name          text PRIMARY KEY,
    cron          text NOT NULL,
    timezone      text NOT NULL,
    template      text NOT NULL,
    misfire       text NOT NULL CHECK (misfire IN ('skip', 'run_once', 'catch_up')),
    max_catch_up  integer NOT NULL CHECK (max_catch_up BETWEEN 1 AND 1000),
    paused        integer NOT NULL DEFAULT 0,
    next_fire_at  integer NOT NULL,
    last_fire_at  integer,
    created_at    integer NOT NULL,
    updated_at    integer NOT NULL,
    version       integer NOT NULL DEFAULT 1
);
CREATE INDEX orbit_schedules_due ON orbit_schedules (next_fire_at) WHERE NOT paused;
