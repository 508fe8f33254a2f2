"""Which certificate authorities the SDK trusts without ``cafile=``: the system's, for
``Client``, ``AsyncClient`` and a worker's uploads alike (``docs/quickstart.md``).
``AsyncClient`` and the uploads went through httpx, whose ``verify=True`` trusts
certifi's bundle instead: a server whose CA is in the system's store (a company's own,
installed with ``update-ca-certificates``) was refused by them, and one whose CA is in
certifi's bundle only was trusted by them alone.

Against a real HTTPS server on a loopback port, with a certificate from a test CA
(``trustme``) that is put in certifi's bundle only."""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import certifi
import pytest
import trustme

from orbit.client import AsyncClient, Client, Unreachable
from orbit.worker.runner import Worker
from tests.http_servers import serving


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *_: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._answer()

    def do_PUT(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._answer()

    def _answer(self) -> None:
        payload = json.dumps({"id": "x", "path": self.path}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a handshake the client refused, on purpose


@pytest.fixture
def only_certifi_trusts_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """An HTTPS server's URL, its CA in certifi's bundle and nowhere else."""
    ca = trustme.CA()
    bundle = tmp_path / "certifi.pem"
    ca.cert_pem.write_to_path(str(bundle))
    monkeypatch.setattr(certifi, "where", lambda: str(bundle))
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    srv = _Server(("127.0.0.1", 0), _Handler)
    srv.socket = context.wrap_socket(srv.socket, server_side=True)
    with serving(srv):
        yield f"https://127.0.0.1:{srv.server_address[1]}"


def test_client_does_not_trust_a_ca_of_certifis_alone(only_certifi_trusts_it: str) -> None:
    with Client(only_certifi_trusts_it, "t0ken") as c, pytest.raises(Unreachable) as caught:
        c.queues()
    assert "CERTIFICATE_VERIFY_FAILED" in str(caught.value)


def test_async_client_trusts_what_client_trusts(only_certifi_trusts_it: str) -> None:
    async def main() -> None:
        async with AsyncClient(only_certifi_trusts_it, "t0ken") as c:
            with pytest.raises(Unreachable) as caught:
                await c.queues()
        assert "CERTIFICATE_VERIFY_FAILED" in str(caught.value)

    asyncio.run(main())


def test_a_workers_upload_trusts_what_its_connection_trusts(only_certifi_trusts_it: str) -> None:
    async def main() -> None:
        worker = Worker(only_certifi_trusts_it, "t0ken")
        worker._conn = SimpleNamespace(session_id="s1", epoch="1")  # type: ignore[assignment]
        with pytest.raises(ConnectionError) as caught:
            await worker._upload("a1", "1", "out.txt", b"data", "text/plain", None)
        assert "CERTIFICATE_VERIFY_FAILED" in str(caught.value)

    asyncio.run(main())


def test_wait_raises_an_untrusted_certificate_at_once(only_certifi_trusts_it: str) -> None:
    """``wait`` rides over an outage, but a certificate that fails verification is a
    client set up wrong: it is raised at the first poll on both clients, not as an
    outage once the whole timeout has run out."""
    with Client(only_certifi_trusts_it, "t0ken") as c, pytest.raises(Unreachable) as caught:
        c.wait("t1", timeout=30)
    # the first poll's own error, not the one a wait raises at its end after an outage
    assert "CERTIFICATE_VERIFY_FAILED" in str(caught.value)
    assert "was unreachable for the last" not in str(caught.value)

    async def main() -> None:
        async with AsyncClient(only_certifi_trusts_it, "t0ken") as c:
            with pytest.raises(Unreachable) as caught:
                await c.wait("t1", timeout=30)
        assert "CERTIFICATE_VERIFY_FAILED" in str(caught.value)
        assert "was unreachable for the last" not in str(caught.value)

    asyncio.run(main())
