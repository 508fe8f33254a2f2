-- The tasks awaiting an operator's review, by queue: the `orbit_tasks` gauge counts them
-- through this index at every scrape, as it counts the waiting tasks through
-- orbit_tasks_ready and the claimed, running and cancelling ones through their live
-- attempts (orbit_attempts_one_live), never reading a task that has ended
-- (docs/operations.md, "Metrics"). A task enters `needs_review` only when a lease ends
-- under a handler that is not retry_safe, so a drain writes nothing more: no submit,
-- claim, start or finish adds an entry (the state was already in an index's condition,
-- orbit_tasks_ready's, so no update that was HOT stops being one).
CREATE INDEX orbit_tasks_review ON orbit_tasks (queue) WHERE state = 'needs_review';
