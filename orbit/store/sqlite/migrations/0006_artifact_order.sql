-- The artifact list's order: each artifact gets its place in its task's list when its
-- upload is committed (ready_seq), not when it begins (its id). See the PostgreSQL
-- migration 0010_artifact_order.sql. SQLite has one writer, so a counter in
-- orbit_settings bumped by each commit numbers them in commit order; unlike max() + 1,
-- it never hands out again the number of an artifact that expired and was deleted.
ALTER TABLE orbit_artifacts ADD COLUMN ready_seq bigint;
-- Artifacts already ready keep the order they were listed in (id order) and come first.
UPDATE orbit_artifacts SET ready_seq = o.n
FROM (SELECT id, row_number() OVER (ORDER BY id) AS n FROM orbit_artifacts
      WHERE state = 'ready') AS o
WHERE orbit_artifacts.id = o.id;
INSERT INTO orbit_settings (name, int_value)
VALUES ('artifact_ready_seq', (SELECT coalesce(max(ready_seq), 0) FROM orbit_artifacts));
DROP INDEX orbit_artifacts_task;
CREATE INDEX orbit_artifacts_task ON orbit_artifacts (task_id, ready_seq);
