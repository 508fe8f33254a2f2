"""``Client.artifact_content`` reads an artifact as ``artifact_stream`` does: the client's
timeout bounds the answer's head, then each read of the body, never the whole download
(a large artifact on a slow link could never be fetched with it, and the Unreachable it
raised blamed the server). Against real loopback servers that answer slowly."""

from __future__ import annotations

from collections.abc import Callable

from orbit.client import Client, Unreachable
from tests.http_servers import serving
from tests.unit.test_client_deadline import _ended, _Server, slow

__all__ = ["slow"]  # the fixture, shared with test_client_deadline


def test_a_download_slower_than_the_timeout_as_a_whole_comes_whole(
    slow: Callable[[str], _Server],
) -> None:
    """Ten bytes 0.2 s apart, 2 s in all, with a 1 s timeout: each read comes in time,
    so the bytes come whole, as AsyncClient's ``artifact_content`` gets them."""
    srv = slow("stream")
    with serving(srv), Client(srv.url, "t0ken", timeout=1.0) as c:
        got = _ended(lambda: c.artifact_content("a"))
    assert got == b"0123456789"


def test_a_download_whose_answer_never_comes_is_unreachable_within_the_timeout(
    slow: Callable[[str], _Server],
) -> None:
    """The answer's head is still a request's: trickled for ever, Unreachable once the
    timeout is up; and a body that stops coming fails its read within the timeout."""
    for mode in ("head", "withheld"):
        srv = slow(mode)
        with serving(srv), Client(srv.url, "t0ken", timeout=0.5) as c:
            exc = _ended(lambda c=c: c.artifact_content("a"))  # type: ignore[misc]
            assert isinstance(exc, Unreachable) and "within 0.5 s" in str(exc), (mode, exc)
