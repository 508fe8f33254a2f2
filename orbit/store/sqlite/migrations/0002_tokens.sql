-- API tokens. Only a hash of the secret part is stored; the token is shown once.
CREATE TABLE orbit_tokens (
    id          text PRIMARY KEY,
    name        text NOT NULL,
    secret_hash text NOT NULL,
    scopes      text NOT NULL,
    created_at  bigint NOT NULL,
    revoked_at  bigint
);
