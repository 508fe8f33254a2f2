"""The benchmark commands' edges: bad input refused in one line before anything starts,
a run with an unavailable system exiting non-zero, the recovered share counted, and
SIGTERM cleaning up as Ctrl-C does (``python -m benchmarks`` in a process of its own)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import psycopg
import pytest

from benchmarks import harness, probe, report, stmt_cost, summary
from benchmarks.__main__ import main
from tests.pg import ADMIN_DSN

REPO = Path(__file__).resolve().parents[2]


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def no_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refusal must come before anything starts: should one not, the test fails at
    once instead of running a benchmark (or, for stmt_cost's --live 0, spinning)."""

    def started(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("bad input was not refused: the run started")

    monkeypatch.setattr(harness.Harness, "run", started)
    monkeypatch.setattr(stmt_cost, "drain", started)


def _refused(capsys: pytest.CaptureFixture[str], run: object, argv: list[str]) -> str:
    """Exit status 2 and the one-line error argparse printed."""
    with pytest.raises(SystemExit) as exit_:
        run(argv)  # type: ignore[operator]
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("option", "value", "said"),
    [
        ("--systems", "nope", "unknown systems nope"),
        ("--workloads", "nope", "unknown workloads nope"),
        ("--systems", ",", "no systems named"),
        ("--workloads", " , ", "no workloads named"),
        ("--systems", "orbit-sqlite,orbit-sqlite", "more than once: orbit-sqlite"),
        ("--workloads", "latency,enqueue,latency", "more than once: latency"),
        ("--redis-db-base", "-1", "--redis-db-base: must be at least 0"),
    ],
)
@pytest.mark.usefixtures("no_start")
def test_run_refuses_bad_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str, value: str, said: str
) -> None:
    out = tmp_path / "out"
    line = _refused(capsys, main, ["run", option, value, "--out", str(out)])
    assert said in line
    assert not out.exists()


@pytest.mark.usefixtures("no_start")
def test_run_refuses_an_out_it_cannot_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    used = tmp_path / "used"
    (used / "runs").mkdir(parents=True)
    (used / "runs" / "throughput-orbit-pg-1.json").write_text("{}")
    for out, said in [
        (a_file, "not a directory"),
        (a_file / "below", f"{a_file} is not a directory"),
        (used, "already holds runs"),
    ]:
        line = _refused(capsys, main, ["run", "--systems", "orbit-sqlite", "--out", str(out)])
        assert f"--out {out}: {said}" in line
    assert sorted(p.name for p in (used / "runs").iterdir()) == ["throughput-orbit-pg-1.json"]


def test_report_refuses_a_missing_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _refused(capsys, main, ["report", str(tmp_path / "missing"), "--no-latest"])
    assert f"{tmp_path / 'missing'}: no summary.json there" in line


@pytest.mark.parametrize(
    ("option", "value"), [("--live", "0"), ("--batch", "0"), ("--tasks", "0"), ("--tasks", "-3")]
)
@pytest.mark.usefixtures("no_start")
def test_stmt_cost_refuses_counts_below_one(
    capsys: pytest.CaptureFixture[str], option: str, value: str
) -> None:
    line = _refused(capsys, stmt_cost.main, [option, value])
    assert f"argument {option}: must be at least 1, not {value}" in line


def test_stmt_cost_help_names_its_command_and_database(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_:
        stmt_cost.main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: python -m benchmarks.stmt_cost")
    assert "$BENCH_PG_DSN" in text and "tasks to drain" in text


def test_probe_refuses_a_database_it_cannot_reach(capsys: pytest.CaptureFixture[str]) -> None:
    dsn = f"postgresql://postgres:hush@127.0.0.1:{_closed_port()}/x"
    line = _refused(capsys, probe.main, ["--pg-dsn", dsn, "--tasks", "10"])
    assert line.startswith("python -m benchmarks.probe: error: --pg-dsn: cannot connect")
    assert "hush" not in line


def test_an_unavailable_system_fails_the_run_and_the_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """PostgreSQL down: the run still writes its summary, says why in one line (no
    password) and exits 1; the report then refuses a summary with nothing measured."""
    out = tmp_path / "out"
    dsn = f"postgresql://postgres:hush@127.0.0.1:{_closed_port()}/test"
    argv = ["run", "--scale", "smoke", "--runs", "1", "--no-physical", "--pg-dsn", dsn]
    code = main([*argv, "--systems", "orbit-pg", "--workloads", "enqueue", "--out", str(out)])

    assert code == 1
    said = capsys.readouterr()
    assert "orbit-pg unavailable: OperationalError: connection failed:" in said.out
    assert "Is the server running" in said.out.split("orbit-pg unavailable:")[1].splitlines()[0]
    assert "Traceback" not in said.out + said.err and "hush" not in said.out + said.err
    record = json.loads((out / "runs" / "enqueue-orbit-pg-1.json").read_text())
    assert record["error"].startswith("system unavailable: OperationalError")

    docs = tmp_path / "benchmarks.md"
    docs.write_text(f"# B\n\n{report.BEGIN}\npublished\n{report.END}\n")
    images, latest = tmp_path / "i", tmp_path / "latest"  # never the repository's
    argv = ["report", str(out), "--docs", str(docs), "--images", str(images)]
    line = _refused(capsys, main, [*argv, "--latest", str(latest)])
    assert "holds no measured value" in line
    assert "published" in docs.read_text()
    assert not images.exists() and not latest.exists()


def test_runs_recovered_counts_the_runs_not_a_median() -> None:
    made = {
        "results": {
            "recovery": {
                "a": {
                    "runs": 5,
                    "errors": [],
                    "metrics": {"recovered": summary.aggregate([1.0, 0.0, 1.0, 0.0, 1.0])},
                },
                "b": {
                    "runs": 5,
                    "errors": [{"run": 2, "error": "x"}],
                    "metrics": {"recovered": summary.aggregate([1.0, None, 1.0, 0.0, 1.0])},
                },
            }
        }
    }
    text = summary.table(made)
    assert "runs recovered (k of n runs)" in text
    assert "3 of 5" in text and "3 of 4 (4/5)" in text
    assert "1 [0" not in text


def test_the_cpu_note_says_when_nothing_was_sampled() -> None:
    made = {
        "results": {
            "throughput": {"a": {"metrics": {"host_cpu_percent": summary.aggregate([5.0])}}}
        },
        "meta": {"scale": {"cpu_interval_s": 0.0}},
    }
    text = report._cpu(made)
    assert "every 0.0 s" not in text and "start and end of each phase" in text
    made["meta"] = {"scale": {"cpu_interval_s": 0.25}}
    assert "Sampled every 0.25 s" in report._cpu(made)


def _databases(pid: int) -> list[str]:
    with psycopg.connect(ADMIN_DSN, autocommit=True) as cx:
        rows = cx.execute(
            "SELECT datname FROM pg_database WHERE datname LIKE %s", [f"orbit_bench_{pid}_%"]
        ).fetchall()
    return [r[0] for r in rows]


def _first_child_gone(children: list[psutil.Process]) -> None:
    """Wait until the clean-up has stopped one of the run's processes."""
    gone: list[psutil.Process] = []
    while not gone:
        gone, _ = psutil.wait_procs(children, timeout=0.05)


@pytest.mark.parametrize("second", [None, signal.SIGINT], ids=["once", "then-ctrl-c"])
def test_sigterm_closes_every_system(tmp_path: Path, second: signal.Signals | None) -> None:
    """What ``timeout`` and ``kill`` send: the run exits 143 with its server and workers
    stopped and its database dropped, as after Ctrl-C; a second signal during that
    clean-up (an impatient Ctrl-C) does not cut it short."""
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "benchmarks", "run", "--scale", "smoke", "--runs", "1"),
            *("--no-physical", "--systems", "orbit-pg", "--workloads", "throughput"),
            *("--out", str(tmp_path / "out")),
        ],
        cwd=REPO,
        env={**os.environ, "BENCH_PG_DSN": ADMIN_DSN, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    seen: list[str] = []
    children: list[psutil.Process] = []
    try:
        for line in proc.stdout:  # the system is prepared: its server and database exist
            seen.append(line)
            if "throughput orbit-pg #1 …" in line:
                break
        else:
            pytest.fail("the run ended before its first step:\n" + "".join(seen))
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children and _databases(proc.pid)

        proc.send_signal(signal.SIGTERM)
        if second is not None:
            _first_child_gone(children)
            proc.send_signal(second)
        rest = proc.communicate(timeout=120)[0]

        assert proc.returncode == 128 + signal.SIGTERM, "".join(seen) + rest
        assert _databases(proc.pid) == []
        alive = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        assert alive == []
    finally:  # a failure must not leave its processes and database behind
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for child in children:
            if child.is_running():
                child.kill()
        for name in _databases(proc.pid):
            with psycopg.connect(ADMIN_DSN, autocommit=True) as cx:
                cx.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
