-- Artifacts: blobs attached to an attempt's result (a PNG, a ZIP), stored in chunks so
-- that neither upload nor download holds a large one in memory. An artifact is
-- 'uploading' until its last chunk is in and its digest checked, then 'ready'.
CREATE TABLE orbit_artifacts (
    id           text PRIMARY KEY,
    task_id      text NOT NULL REFERENCES orbit_tasks (id),
    attempt_id   text NOT NULL,
    name         text NOT NULL,
    content_type text NOT NULL,
    size         bigint NOT NULL,
    sha256       text,
    state        text NOT NULL,
    created_at   bigint NOT NULL,
    expires_at   bigint NOT NULL
);
CREATE UNIQUE INDEX orbit_artifacts_name ON orbit_artifacts (attempt_id, name);
CREATE INDEX orbit_artifacts_task ON orbit_artifacts (task_id);
CREATE INDEX orbit_artifacts_expiry ON orbit_artifacts (expires_at);

CREATE TABLE orbit_artifact_chunks (
    artifact_id text NOT NULL REFERENCES orbit_artifacts (id) ON DELETE CASCADE,
    seq         integer NOT NULL,
    data        BLOB NOT NULL,
    PRIMARY KEY (artifact_id, seq)
);
