-- The tasks awaiting an operator's review, by queue, for the `orbit_tasks` gauge: see
-- the PostgreSQL migration 0014_review_index.sql.
CREATE INDEX orbit_tasks_review ON orbit_tasks (queue) WHERE state = 'needs_review';
