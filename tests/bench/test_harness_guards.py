"""What the benchmark run must not do to the machine it shares, and what it must refuse:
flush Redis databases that hold someone's keys, write a password anywhere, leave a
worker running after an interrupt, pass a failed physical-limit step as a success, or
answer bad input with a traceback. Real Redis, PostgreSQL and processes; the runs are
smoke-scale single workloads of one system."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis

from benchmarks import harness, physical, report, workloads
from benchmarks.__main__ import main
from benchmarks.cpu import _label
from benchmarks.scale import SMOKE
from benchmarks.systems.base import Env, System, WorkerSpec
from benchmarks.systems.celery_system import CelerySystem
from benchmarks.systems.orbit_system import OrbitSystem
from benchmarks.systems.pgqueuer_system import PgQueuerSystem
from benchmarks.systems.procrastinate_system import ProcrastinateSystem
from tests.pg import ADMIN_DSN

REPO = Path(__file__).resolve().parents[2]
#: Redis databases of these tests: clear of a real run's (1, 2), the smoke test's (7, 8)
#: and tests/bench/test_peers.py's (15)
REDIS = os.environ.get("BENCH_TEST_REDIS", "redis://127.0.0.1:6379")
DB = 11
SECRET = "hunter2-not-to-be-seen"
SMOKE_RUN = ["run", "--scale", "smoke", "--runs", "1"]


def _with_password(dsn: str) -> str:
    """``dsn`` (a URL) with a password added: the local server trusts, so it still works."""
    scheme, rest = dsn.split("://", 1)
    auth, where = rest.split("@", 1) if "@" in rest else ("postgres", rest)
    return f"{scheme}://{auth.split(':')[0]}:{SECRET}@{where}"


def _refused(capsys: pytest.CaptureFixture[str], run: Any, argv: list[str]) -> str:
    """Exit status 2 and the one-line error argparse printed."""
    with pytest.raises(SystemExit) as exit_:
        run(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.fixture
def no_start(monkeypatch: pytest.MonkeyPatch) -> None:
    def started(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("bad input was not refused: the run started")

    monkeypatch.setattr(harness.Harness, "run", started)
    monkeypatch.setattr(physical, "measure", started)


@pytest.fixture
def redis_db() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(f"{REDIS}/{DB}")
    try:
        client.ping()
    except redis.ConnectionError:
        pytest.fail(f"Redis is not running at {REDIS}")
    client.flushdb()
    try:
        yield client
    finally:
        client.flushdb()
        client.close()


# ---------------------------------------------------------------- Redis is not flushed


@pytest.mark.usefixtures("no_start")
def test_run_refuses_redis_databases_that_hold_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], redis_db: redis.Redis
) -> None:
    redis_db.set("someone-else", "data")
    out = tmp_path / "out"
    argv = [*SMOKE_RUN, "--systems", "celery", "--redis-url", REDIS, "--redis-db-base", str(DB)]
    line = _refused(capsys, main, [*argv, "--out", str(out)])
    assert f"Redis database(s) {DB} (1 keys) would be flushed" in line
    assert "--flush-redis" in line
    assert redis_db.get("someone-else") == b"data" and not out.exists()


def test_celery_refuses_to_prepare_on_keys_and_flushes_only_when_told(
    tmp_path: Path, redis_db: redis.Redis
) -> None:
    """The system's own guard (the CLI's check could be raced): nothing flushed, not even
    by the close that follows a failed prepare; with ``flush_redis`` it takes the db."""
    redis_db.set("someone-else", "data")
    system = CelerySystem()
    env = Env(ADMIN_DSN, f"{REDIS}/{DB}", tmp_path / "work")
    with pytest.raises(RuntimeError, match=f"Redis database {DB} holds 1 key"):
        system.prepare(env)
    system.close()
    assert redis_db.get("someone-else") == b"data"

    system = CelerySystem()
    system.prepare(Env(ADMIN_DSN, f"{REDIS}/{DB}", tmp_path / "work", flush_redis=True))
    try:
        assert redis_db.dbsize() == 0
    finally:
        system.close()


def test_a_run_is_not_refused_by_its_own_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], redis_db: redis.Redis
) -> None:
    """Two runs on an empty database: the first run's messages, flushed by the second's
    reset, never stop it."""
    out = tmp_path / "out"
    argv = ["run", "--scale", "smoke", "--runs", "2", "--no-physical", "--systems", "celery"]
    argv += ["--workloads", "enqueue", "--redis-url", REDIS, "--redis-db-base", str(DB)]
    assert main([*argv, "--out", str(out)]) == 0, capsys.readouterr()
    for run in (1, 2):
        record = json.loads((out / "runs" / f"enqueue-celery-{run}.json").read_text())
        assert not record.get("error") and record["metrics"]["batch_jobs_per_s"] > 0
    assert redis_db.dbsize() == 0


@pytest.mark.usefixtures("no_start")
def test_run_refuses_a_redis_url_naming_a_database_or_one_beyond_the_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    base = [*SMOKE_RUN, "--systems", "celery", "--out", str(out)]
    line = _refused(capsys, main, [*base, "--redis-url", f"{REDIS}/3"])
    assert f"--redis-url {REDIS}/3: must not name a database" in line
    line = _refused(capsys, main, [*base, "--redis-url", REDIS, "--redis-db-base", "99"])
    assert "Redis database 99: ResponseError: DB index is out of range" in line
    assert not out.exists()


# ---------------------------------------------------------------- no password written


def test_a_run_with_a_password_in_its_dsn_writes_it_nowhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command line in summary.json, the Orbit server's --db URL in the CPU labels,
    the log and the report's "This run" line: the password is masked in each."""
    dsn = _with_password(ADMIN_DSN)
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["benchmarks", "run", "--pg-dsn", dsn])
    lines: list[str] = []
    opts = harness.Options(
        runs=1,
        scale=SMOKE,
        out=out,
        systems=["orbit-pg"],
        workloads=["enqueue"],
        pg_dsn=dsn,
        physical=False,
        log=lines.append,
    )
    bench = harness.Harness(opts)
    bench.run()
    assert not bench.failed, lines

    record = json.loads((out / "runs" / "enqueue-orbit-pg-1.json").read_text())
    labels = [p["label"] for phase in record["cpu"].values() for p in phase["processes"]]
    assert any("orbit.cli server --db postgresql://postgres:***@" in x for x in labels), labels
    summary = json.loads((out / "summary.json").read_text())
    assert summary["meta"]["argv"][-1] == dsn.replace(SECRET, "***")
    written = [p.read_text() for p in out.rglob("*.json")]
    assert written and not any(SECRET in text for text in written)
    assert not any(SECRET in line for line in lines)

    # a summary written before the masking: the report masks its command line itself
    summary["meta"]["argv"] = ["benchmarks", "run", "--pg-dsn", dsn]
    (out / "summary.json").write_text(json.dumps(summary))
    docs = tmp_path / "benchmarks.md"
    report.write(out, docs=docs, images=tmp_path / "img")
    text = docs.read_text()
    assert "This run: `python -m benchmarks run --pg-dsn postgresql://postgres:***@" in text
    assert SECRET not in text


def test_a_process_label_masks_the_password_before_it_is_shortened(tmp_path: Path) -> None:
    """The label keeps 120 characters: cut first, the password's end would be kept."""
    dsn = f"postgresql://postgres:{SECRET}@127.0.0.1:5432/db"
    code = "import time; print(flush=True); time.sleep(60)"
    head = f"{os.path.basename(sys.executable)} -c {code} "
    pad = "x" * (108 - len(head) - len(" postgresql://postgres:"))  # the password at 108-130
    proc = subprocess.Popen([sys.executable, "-c", code, pad, dsn], stdout=subprocess.PIPE)
    try:
        # Its line says the interpreter runs: just after exec, before the kernel has set
        # the new image's arguments, /proc shows an empty command line (the label: "python")
        assert proc.stdout is not None and proc.stdout.readline() == b"\n"
        label = _label(psutil.Process(proc.pid))
    finally:
        proc.kill()
        proc.wait()
    assert "postgresql://postgres:***@" in label or label.endswith("postgresql://postgres:***")
    assert not any(SECRET[:n] in label for n in range(4, len(SECRET) + 1))


def test_help_names_the_variables_not_their_values() -> None:
    env = {
        **os.environ,
        "BENCH_PG_DSN": f"postgresql://postgres:{SECRET}@127.0.0.1:5432/test",
        "BENCH_REDIS_URL": f"redis://:{SECRET}@127.0.0.1:6379",
    }
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "run", "--help"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert SECRET not in done.stdout + done.stderr
    assert "$BENCH_PG_DSN" in done.stdout and "$BENCH_REDIS_URL" in done.stdout
    assert "database named test" in done.stdout
    assert f"the {len(harness.REGISTRY)} registered systems" in done.stdout
    assert "--flush-redis" in done.stdout and "WIPES" in done.stdout


# ---------------------------------------------------------------- workers never left behind


SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


class InterruptedStart(System):
    """Its workers are real processes; the interrupt comes after the ``interrupt_at``-th
    has started, before ``start_workers`` returns (where a Ctrl-C or SIGTERM between two
    starts, or just after the last, lands)."""

    name = "interrupted"
    uses_postgres = False

    def __init__(self, interrupt_at: int) -> None:
        self.interrupt_at = interrupt_at
        self.started: list[subprocess.Popen[bytes]] = []

    def start_workers(
        self, spec: WorkerSpec, into: list[subprocess.Popen[bytes]] | None = None
    ) -> list[subprocess.Popen[bytes]]:
        def start_one() -> subprocess.Popen[bytes]:
            if len(self.started) == self.interrupt_at:
                raise KeyboardInterrupt
            proc = subprocess.Popen(SLEEPER)
            self.started.append(proc)
            return proc

        procs = self._start_each(spec.processes, into, start_one)
        if len(self.started) == self.interrupt_at:
            raise KeyboardInterrupt
        return procs

    def versions(self) -> dict[str, str]:
        return {}

    def settings(self) -> dict[str, Any]:
        return {}

    def prepare(self, env: Env) -> None:
        pass

    def reset(self) -> None:
        pass

    def enqueue(self, jobs: list[dict[str, Any]], batch: int) -> None:
        pass

    def done_count(self) -> int:
        return -1

    def close(self) -> None:
        pass


def _ctx(system: System, tmp_path: Path) -> workloads.RunContext:
    return workloads.RunContext(system, SMOKE, 1, tmp_path / "rec", {})


@pytest.mark.parametrize(
    ("where", "processes", "interrupt_at"),
    [
        ("running", 3, 1),  # between the first and the second start
        ("launched", 2, 2),  # after the last start, before start_workers returned
        ("recovery", 1, 1),  # the victim started, start_workers not returned
    ],
)
def test_an_interrupted_start_stops_every_started_worker(
    tmp_path: Path, where: str, processes: int, interrupt_at: int
) -> None:
    system = InterruptedStart(interrupt_at)
    spec = WorkerSpec(processes, 1, tmp_path)
    try:
        with pytest.raises(KeyboardInterrupt):
            if where == "running":
                with workloads.running(system, spec):
                    pass
            elif where == "launched":
                with workloads.launched(_ctx(system, tmp_path), spec, None):
                    pass
            else:
                workloads.recovery(_ctx(system, tmp_path))
        assert len(system.started) == interrupt_at
        assert [p.poll() is not None for p in system.started] == [True] * interrupt_at
    finally:
        for proc in system.started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


class SignalledInsideStart(InterruptedStart):
    """Ctrl-C arrives while a worker starts, after its process exists and before
    ``start_one`` hands it back: where a signal lands inside ``Popen``, after its fork."""

    def start_workers(
        self, spec: WorkerSpec, into: list[subprocess.Popen[bytes]] | None = None
    ) -> list[subprocess.Popen[bytes]]:
        def start_one() -> subprocess.Popen[bytes]:
            proc = subprocess.Popen(SLEEPER)
            self.started.append(proc)
            signal.raise_signal(signal.SIGINT)
            return proc

        return self._start_each(spec.processes, into, start_one)


@pytest.fixture
def python_sigint() -> Iterator[None]:
    """Python's own SIGINT handler (KeyboardInterrupt) for the test, as a harness run
    from a terminal has: a process started in the background (a CI runner's job) may
    inherit SIGINT ignored, and a raised SIGINT is then no KeyboardInterrupt at all."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_signal_inside_a_worker_start_waits_until_the_caller_holds_it(
    tmp_path: Path, python_sigint: None
) -> None:
    system = SignalledInsideStart(0)
    try:
        with (
            pytest.raises(KeyboardInterrupt),
            workloads.running(system, WorkerSpec(2, 1, tmp_path)),
        ):
            pass
        assert len(system.started) == 1  # the interrupt came before the second start
        assert system.started[0].poll() is not None
    finally:
        for proc in system.started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


class _Started:
    """What the patched ``Popen`` hands back for the first worker."""

    pid = 0


def _unprepared(cls: type[System], tmp_path: Path) -> System:
    """A system with just what ``start_workers`` reads, as ``prepare`` would set it."""
    system = cls()
    (tmp_path / "logs").mkdir(exist_ok=True)
    system._env = Env(ADMIN_DSN, f"{REDIS}/{DB}", tmp_path)  # type: ignore[attr-defined]
    if isinstance(system, OrbitSystem):
        system._token_file = tmp_path / "token"
        system._port = 1
    return system


@pytest.mark.parametrize(
    "cls",
    [OrbitSystem, CelerySystem, PgQueuerSystem, ProcrastinateSystem],
    ids=lambda c: c.__name__,
)
def test_every_system_hands_each_worker_over_as_it_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cls: type[System]
) -> None:
    """The interrupt after the first of three starts: the caller's list holds it."""
    first = _Started()
    calls: list[object] = []

    def popen(*_args: object, **_kwargs: object) -> object:
        calls.append(_args)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return first

    system = _unprepared(cls, tmp_path)
    monkeypatch.setattr(subprocess, "Popen", popen)
    into: list[Any] = []
    with pytest.raises(KeyboardInterrupt):
        system.start_workers(WorkerSpec(3, 1, tmp_path), into)
    assert into == [first]


# ---------------------------------------------------------------- failures are failures


def test_a_failed_physical_limit_fails_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PGBENCH", "/bin/false")
    argv = [*SMOKE_RUN, "--systems", "orbit-sqlite", "--workloads", "enqueue"]
    argv += ["--pg-dsn", ADMIN_DSN]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "1 failure(s):" in err and "physical limit: RuntimeError: pgbench failed" in err
    assert "(--no-physical skips it)" in err
    assert "error" in json.loads((tmp_path / "out" / "summary.json").read_text())["physical"]


@pytest.mark.usefixtures("no_start")
def test_run_refuses_an_out_that_cannot_be_created(capsys: pytest.CaptureFixture[str]) -> None:
    out = "/proc/no-such-bench-out/x"
    line = _refused(capsys, main, ["run", "--systems", "orbit-sqlite", "--out", out])
    # root may write anywhere, so it fails at mkdir; anyone else at the permission check
    assert line.startswith(f"python -m benchmarks run: error: --out {out}: ")
    assert "cannot be created" in line or "is not writable" in line


@pytest.mark.parametrize(
    ("option", "value", "said"),
    [
        ("--clients", "0", "must be at least 1, not 0"),
        ("--clients", "a", "not a whole number: 'a'"),
        ("--clients", ",", "no client count given"),
        ("--seconds", "0", "must be at least 1, not 0"),
        ("--seconds", "0.2", "not a whole number: '0.2'"),
        ("--batch", "0", "must be at least 1, not 0"),
        ("--submit-batch", "0", "must be at least 1, not 0"),
        ("--commits", "-1", "must be at least 1, not -1"),
        ("--backlog", "-1", "must be at least 0, not -1"),
    ],
)
@pytest.mark.usefixtures("no_start")
def test_physical_refuses_bad_counts(
    capsys: pytest.CaptureFixture[str], option: str, value: str, said: str
) -> None:
    line = _refused(capsys, physical.main, [option, value])
    assert line == f"python -m benchmarks.physical: error: argument {option}: {said}"


def test_physical_measure_refuses_a_fraction_of_a_second() -> None:
    with pytest.raises(ValueError, match="whole number"):
        physical.measure(ADMIN_DSN, batch=1, clients=[1], seconds=0.2, backlog=0)
