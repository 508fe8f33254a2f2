-- Backpressure: a queue's and a tenant's cap on waiting tasks (state queued or
-- scheduled); NULL: no cap. See the PostgreSQL migration 0009_max_queued.sql.
ALTER TABLE orbit_queues ADD COLUMN max_queued integer CHECK (max_queued >= 1);
ALTER TABLE orbit_tenants ADD COLUMN max_queued integer CHECK (max_queued >= 1);
