-- Unfinished uploads, for the reaper's pass that drops those whose attempt has ended
-- (artifact_abandoned_delete): a handful of rows at any time, read every pass.
CREATE INDEX orbit_artifacts_uploading ON orbit_artifacts (attempt_id)
WHERE state = 'uploading';
