"""The PostgreSQL driver: pooled psycopg 3 connections, row locks, SKIP LOCKED claims."""

from orbit.store.postgres.driver import PostgresDriver

__all__ = ["PostgresDriver"]
