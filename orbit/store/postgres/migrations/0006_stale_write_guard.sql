-- A transaction's last batched write travels with its COMMIT, in one round trip (the
-- driver's write_batch with commit_with). Each of its writes is guarded (every row names
-- the version or state it was planned from), and the store retries the transaction when
-- a write matches fewer rows than planned; with the COMMIT already behind the write, that
-- check must happen inside the statement. This function is the check's failure: it
-- raises, so the write fails, PostgreSQL skips the COMMIT sent after it, and the
-- transaction is rolled back before anything of it is visible. VOLATILE, so the planner
-- never evaluates it ahead of the rows it guards.
CREATE FUNCTION orbit_stale_write(detail text) RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RAISE EXCEPTION 'stale write: %', detail USING ERRCODE = 'OR409';
END
$$;
