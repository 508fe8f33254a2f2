"""A node serving https:// and wss:// with a certificate from a test CA (``trustme``).

Clients verify the certificate: a full task life runs over TLS when the client trusts
the CA, and both HTTP and WebSocket clients that do not trust it are refused.
"""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import httpx
import pytest
import trustme

from orbit.client import AsyncClient, Client, Unreachable
from orbit.worker import WorkerConnection
from tests.e2e.servers import Node, Tokens, database, make_tokens, start_server


def write_pki(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A fresh test CA and a server certificate for 127.0.0.1: (cert, key, ca) PEM files."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    paths = (tmp_path / "server.pem", tmp_path / "server.key", tmp_path / "ca.pem")
    cert.cert_chain_pems[0].write_to_path(str(paths[0]))
    for blob in cert.cert_chain_pems[1:]:
        blob.write_to_path(str(paths[0]), append=True)
    cert.private_key_pem.write_to_path(str(paths[1]))
    ca.cert_pem.write_to_path(str(paths[2]))
    paths[1].chmod(0o600)
    return paths


def trusting(cafile: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(cafile))


def task_life(node: Node, tokens: Tokens, cafile: Path) -> None:
    """Queue, submit, push, start, renew, finish — all over https:// and wss://."""
    verify = trusting(cafile)
    headers = {"Authorization": f"Bearer {tokens.admin}"}
    with httpx.Client(base_url=node.http, timeout=30, verify=verify, headers=headers) as admin:
        assert admin.get("/healthz").json()["status"] == "ok"
        created = admin.post("/v1/queues", json={"name": "tls", "max_concurrency": 2, "rate": 0})
        assert created.status_code == 201, created.text
        submitted = admin.post(
            "/v1/tasks", json={"queue": "tls", "handler": "h", "payload": {"over": "tls"}}
        )
        assert submitted.status_code == 201, submitted.text
        task_id = submitted.json()["task"]["id"]

        async def work() -> dict[str, object]:
            conn = await WorkerConnection.connect(node.ws, tokens.worker, cafile=str(cafile))
            try:
                assert conn.ws.transport.get_extra_info("ssl_object") is not None
                welcome = await conn.hello("tls-worker", {"h": 1}, max_concurrency=1)
                assert welcome["epoch"] == "1"
                pushed = await conn.next_push(timeout=10)
                assert pushed["type"] == "tasks", pushed
                [task] = pushed["tasks"]
                assert task["task_id"] == task_id and task["payload"] == {"over": "tls"}
                assert (await conn.start(task["attempt_id"], task["fence"]))["status"] == "ok"
                [renewed] = await conn.renew([task["attempt_id"]])
                assert renewed["status"] == "ok"
                return await conn.finish(task["attempt_id"], task["fence"], result={"ok": 1})
            finally:
                await conn.close()

        receipt = asyncio.run(work())
        assert receipt["task_state"] == "succeeded"
        got = admin.get(f"/v1/tasks/{task_id}").json()
        assert got["state"] == "succeeded" and got["result"] == {"ok": 1}
        assert got["attempts_used"] == 1


def refused_without_trust(node: Node, tokens: Tokens, ca: Path, tmp_path: Path) -> None:
    """Clients that do not trust the test CA cannot connect, and the host name is checked
    too: verification is really on."""
    other_ca = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other_ca))
    for verify in (True, trusting(other_ca)):  # the system store; an unrelated CA
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{node.http}/healthz", verify=verify, timeout=10)

    async def connect(url: str, cafile: str | None) -> None:
        conn = await WorkerConnection.connect(url, tokens.worker, cafile=cafile)
        await conn.close()  # pragma: no cover - only reached if verification is off

    for cafile in (None, str(other_ca)):
        with pytest.raises(ssl.SSLCertVerificationError):
            asyncio.run(connect(node.ws, cafile))
    # The certificate names 127.0.0.1 only: "localhost" fails the host name check even
    # for a client that trusts the CA.
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"https://localhost:{node.port}/healthz", verify=trusting(ca), timeout=10)
    with pytest.raises(ssl.SSLCertVerificationError, match=r"[Hh]ostname mismatch"):
        asyncio.run(connect(f"wss://localhost:{node.port}/v1/worker", str(ca)))
    # Plain http:// to the TLS port is not served either.
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{node.port}/healthz", timeout=10)
    plain_to_tls(node, tokens)


def plain_to_tls(node: Node, tokens: Tokens) -> None:
    """Orbit's clients asked over http:// of a TLS port said only "RemoteDisconnected:
    Remote end closed connection without response", which sent users looking for a
    crashed server: both now say the URL of a TLS server is https://."""
    plain = f"http://127.0.0.1:{node.port}"
    with Client(plain, tokens.admin) as c, pytest.raises(Unreachable) as caught:
        c.queues()
    assert "its URL is https://" in str(caught.value), caught.value

    async def queues() -> None:
        async with AsyncClient(plain, tokens.admin) as c:
            await c.queues()

    with pytest.raises(Unreachable) as caught:
        asyncio.run(queues())
    assert "its URL is https://" in str(caught.value), caught.value


def orbit_clients_over_tls(node: Node, tokens: Tokens, ca: Path) -> None:
    """Orbit's own clients verify too: with ``cafile`` they work, and without it, or for
    a name the certificate does not hold, they raise Unreachable with the TLS cause."""
    with Client(node.http, tokens.admin, cafile=str(ca)) as c:
        made = c.submit("tls", "h", {"by": "Client"})
        assert c.get(made["id"])["payload"] == {"by": "Client"}
        assert [q["name"] for q in c.queues()] == ["tls"]

    async def async_submit() -> str:
        async with AsyncClient(node.http, tokens.admin, cafile=str(ca)) as c:
            return str((await c.submit("tls", "h", {"by": "AsyncClient"}))["state"])

    assert asyncio.run(async_submit()) == "queued"
    # an event stream over wss:// (``subscribe``) trusts the same CA
    with Client(node.http, tokens.admin, cafile=str(ca)) as c:
        _, first = next(c.subscribe(outage=0))
        assert first["kind"] == "queue.created"

    async def async_subscribe() -> str:
        async with AsyncClient(node.http, tokens.admin, cafile=str(ca)) as c:
            events = c.subscribe(outage=0)
            _, event = await anext(events)
            await events.aclose()
            return str(event["kind"])

    assert asyncio.run(async_subscribe()) == "queue.created"
    for url, cafile in (
        (node.http, None),
        (f"https://localhost:{node.port}", str(ca)),
    ):
        with Client(url, tokens.admin, cafile=cafile) as c, pytest.raises(Unreachable) as caught:
            c.queues()
        assert isinstance(caught.value.__cause__, ssl.SSLCertVerificationError)
        assert tokens.admin not in str(caught.value)
        assert "https://" not in str(caught.value)  # the plain-URL hint is for http:// only
        # nor does a subscription wait out its outage: a certificate refused is raised
        with Client(url, tokens.admin, cafile=cafile) as c, pytest.raises(Unreachable) as caught:
            next(c.subscribe(outage=600))
        assert isinstance(caught.value.__cause__, ssl.SSLCertVerificationError)

        async def refused(url: str = url, cafile: str | None = cafile) -> None:
            async with AsyncClient(url, tokens.admin, cafile=cafile) as c:
                await c.queues()

        with pytest.raises(Unreachable):
            asyncio.run(refused())


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_task_life_over_verified_tls(backend: str, tmp_path: Path) -> None:
    cert, key, ca = write_pki(tmp_path)
    with database(backend, tmp_path, "orbit_tls") as url:
        tokens = make_tokens(url)
        node = start_server(url, tmp_path, node_id=f"tls-{backend}", tls=(cert, key, ca))
        try:
            assert node.http.startswith("https://") and node.ws.startswith("wss://")
            task_life(node, tokens, ca)
            orbit_clients_over_tls(node, tokens, ca)
            refused_without_trust(node, tokens, ca, tmp_path)
        except BaseException:
            print(node.log_text())
            raise
        finally:
            node.stop()


def test_orbit_worker_trusts_the_ca_its_cafile_option_names(tmp_path: Path) -> None:
    """``orbit worker MODULE:OBJ --cafile ca.pem`` (or ``ORBIT_CAFILE``) runs the worker
    with that CA, as the other commands use it: the option was accepted and ignored, so
    a worker of a server with a private CA failed verification and retried for ever."""
    import os
    import signal
    import subprocess
    import sys

    cert, key, ca = write_pki(tmp_path)
    url = f"sqlite:///{tmp_path}/orbit.db"
    tokens = make_tokens(url)
    node = start_server(url, tmp_path, node_id="tls-cli", tls=(cert, key, ca))
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "ORBIT_TOKEN": tokens.worker, "ORBIT_TEST_MARKS": str(tmp_path)}
    env.pop("ORBIT_CAFILE", None)
    proc = None
    try:
        with Client(node.http, tokens.admin, cafile=str(ca)) as c:
            c.queue_create("q", max_concurrency=1, rate=0)
            task = c.submit("q", "sleep", {"seconds": 0})
            command = ["worker", "tests.e2e.worker_app:worker", "--url", node.http]
            proc = subprocess.Popen(
                [sys.executable, "-m", "orbit.cli", *command, "--cafile", str(ca)],
                env=env,
                cwd=root,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            assert c.wait(task["id"], timeout=30)["state"] == "succeeded"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        assert "CERTIFICATE_VERIFY_FAILED" not in out and "SSLCert" not in out, out
        # A cafile it cannot load, or none for a private CA: one line and exit 2, where the
        # worker retried for ever saying FileNotFoundError or SSLCertVerificationError,
        # and the other commands said "cannot reach …: SSLCertVerificationError", exit 4
        # (unreachable), or "[Errno 2] No such file or directory".
        (tmp_path / "not-a-ca.pem").write_text("not a certificate\n")
        missing = ["--cafile", str(tmp_path / "missing.pem")]
        not_a_ca = ["--cafile", str(tmp_path / "not-a-ca.pem")]
        queue_ls = ["queue", "ls", "--url", node.http]
        admin_env = {**env, "ORBIT_TOKEN": tokens.admin}
        for args, run_env, said in (
            (command + missing, env, "missing.pem: cannot load"),
            (command + not_a_ca, env, "not-a-ca.pem: cannot load"),
            (command, env, "certificate is not trusted"),
            (queue_ls + missing, admin_env, "missing.pem: cannot load"),
            (queue_ls, admin_env, "certificate is not trusted"),
        ):
            wrong = subprocess.run(
                [sys.executable, "-m", "orbit.cli", *args],
                env=run_env,
                cwd=root,
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert wrong.returncode == 2 and said in wrong.stderr, (args, wrong.stderr)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            print(proc.communicate()[0])
        node.stop()
