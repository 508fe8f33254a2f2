-- The live attempts are read through one index, orbit_attempts_one_live (I1's), in place
-- of four. Each index on orbit_attempts gains an entry for every version of an attempt
-- its predicate holds: a claim inserted an attempt into claim_expiry and live_session
-- besides one_live and the keys, and a start (a new version, as its state is in the
-- predicates) into lease_expiry and live_session again. Those were 4 of the ~25 index
-- entries a task's life wrote, and adding index entries was the largest share of
-- PostgreSQL's CPU in a drain (docs/benchmarks.md, round 42). Without them a claim, start
-- and finish write 5 % less WAL (benchmarks/stmt_cost.py), and PostgreSQL spent 3-8 % less
-- CPU a task in four alternating pairs of drains (benchmarks/probe.py; docs/benchmarks.md,
-- round 43).
-- Their readers (the reaper's expiry reads, a session's claimed attempts, the cancels a
-- node may have missed) now walk the live attempts, which are as many as the workers'
-- slots, not as many as the tasks: each says `state IN ('claimed', 'running')` in full,
-- the index's own predicate, so that SQLite's planner uses it too.
DROP INDEX orbit_attempts_claim_expiry;
DROP INDEX orbit_attempts_lease_expiry;
DROP INDEX orbit_attempts_live_session;
