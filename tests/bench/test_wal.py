"""benchmarks.wal: the WAL PostgreSQL wrote inside a window, and never a failed run for it."""

from __future__ import annotations

import psycopg
import pytest

from benchmarks.wal import WalMeter, lsn_bytes
from tests.pg import temporary_database

# WAL is the whole cluster's: another test's writes would count inside the window.
pytestmark = pytest.mark.alone


def test_counts_the_wal_of_the_writes_inside_the_window() -> None:
    with temporary_database() as dsn, psycopg.connect(dsn, autocommit=True) as cx:
        cx.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        with WalMeter(dsn) as wal:
            cx.execute("INSERT INTO t SELECT i, 'x' FROM generate_series(1, 1000) AS i")
        # The first read of the new rows sets their hint bits, which a checkpoint just
        # before it (another database's DROP asks for one) makes PostgreSQL log as whole
        # pages (a CI run saw 49,504 bytes): that read goes outside the window.
        cx.execute("SELECT count(*) FROM t")
        with WalMeter(dsn) as idle:
            cx.execute("SELECT count(*) FROM t")
    # a heap tuple and a primary-key entry per row, each a WAL record of 50 bytes or more
    assert wal.result["bytes"] >= 1000 * 2 * 50
    # a read writes (next to) nothing; the cluster may write a little in the background
    assert idle.result["bytes"] < wal.result["bytes"] / 10


def test_a_position_is_two_hexadecimal_halves() -> None:
    assert lsn_bytes("0/0") == 0
    assert lsn_bytes("0/1F") == 31
    assert lsn_bytes("16/B374D848") == (0x16 << 32) + 0xB374D848


def test_an_unreachable_server_is_recorded_not_raised_and_keeps_its_secret() -> None:
    with WalMeter("postgresql://bench:s3cret-pw@127.0.0.1:1/nowhere?connect_timeout=2") as wal:
        pass
    assert set(wal.result) == {"error"}
    assert "s3cret-pw" not in wal.result["error"]
