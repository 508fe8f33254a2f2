-- Keys compare byte by byte. A text column takes the database's collation, and for any
-- collation but "C" or "POSIX" (the "C.UTF-8" of a Debian cluster included) PostgreSQL
-- compares two keys through strcoll(): every B-tree descent of a claim, start or finish
-- and every index entry a transition adds paid for a locale-aware comparison of ids and
-- names (text comparisons were 7 % of PostgreSQL's CPU in a drain, `perf`; the batched
-- insert of 1,000 tasks took 9 % less without them). With "C" a comparison is a memcmp.
-- Equality is unchanged (these collations are all deterministic); the order becomes
-- code-point order, the order of Python's sorted(), which the store locks rows in. The
-- indexes on these columns are rebuilt; the tables are not rewritten.
ALTER TABLE orbit_queues ALTER COLUMN name TYPE text COLLATE "C";
ALTER TABLE orbit_tenants ALTER COLUMN name TYPE text COLLATE "C";
ALTER TABLE orbit_settings ALTER COLUMN name TYPE text COLLATE "C";
ALTER TABLE orbit_tasks
    ALTER COLUMN id TYPE text COLLATE "C",
    ALTER COLUMN queue TYPE text COLLATE "C",
    ALTER COLUMN tenant TYPE text COLLATE "C",
    ALTER COLUMN idempotency_key TYPE text COLLATE "C",
    ALTER COLUMN parent_id TYPE text COLLATE "C";
ALTER TABLE orbit_attempts
    ALTER COLUMN id TYPE text COLLATE "C",
    ALTER COLUMN task_id TYPE text COLLATE "C",
    ALTER COLUMN session_id TYPE text COLLATE "C";
ALTER TABLE orbit_sessions ALTER COLUMN id TYPE text COLLATE "C";
ALTER TABLE orbit_events ALTER COLUMN task_id TYPE text COLLATE "C";
ALTER TABLE orbit_tokens ALTER COLUMN id TYPE text COLLATE "C";
ALTER TABLE orbit_artifacts
    ALTER COLUMN id TYPE text COLLATE "C",
    ALTER COLUMN task_id TYPE text COLLATE "C",
    ALTER COLUMN attempt_id TYPE text COLLATE "C",
    ALTER COLUMN name TYPE text COLLATE "C";
ALTER TABLE orbit_artifact_chunks ALTER COLUMN artifact_id TYPE text COLLATE "C";
