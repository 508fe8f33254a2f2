-- Backpressure (docs/concepts.md, "Backpressure"): a queue's and a tenant's cap on
-- waiting tasks (state queued or scheduled). NULL: no cap, which every queue and tenant
-- has until one is set. No index is added for it: a submit to a scope without a cap
-- reads nothing more and writes nothing more (one more index on orbit_tasks cost every
-- batch submit a tenth of its rate, measured with benchmarks.probe); a submit to a
-- capped scope counts that scope's waiting tasks through orbit_tasks_ready.
ALTER TABLE orbit_queues ADD COLUMN max_queued integer CHECK (max_queued >= 1);
ALTER TABLE orbit_tenants ADD COLUMN max_queued integer CHECK (max_queued >= 1);
