-- The live attempts read through orbit_attempts_one_live alone: see the PostgreSQL
-- migration 0013_live_attempt_index.sql.
DROP INDEX orbit_attempts_claim_expiry;
DROP INDEX orbit_attempts_lease_expiry;
DROP INDEX orbit_attempts_live_session;
