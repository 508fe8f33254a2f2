"""The artifact routes in process: the app ``create_app`` builds over a real store (a
SQLite file or a PostgreSQL database), driven by starlette's TestClient. Cheaper than a
server process, and enough for what the routes themselves answer."""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from email.message import Message
from email.utils import collapse_rfc2231_value
from functools import partial
from typing import Any

import pytest
from starlette.exceptions import StarletteDeprecationWarning

from orbit.core.model import Outcome
from orbit.server import ServerSettings, create_app
from orbit.server.artifacts import attachment
from orbit.server.routes import encode_cursor
from orbit.store import Store, StoreConfig, open_store
from tests.store.helpers import run_one, submit, worker

with warnings.catch_warnings():  # starlette's TestClient warns at import about httpx
    warnings.simplefilter("ignore", StarletteDeprecationWarning)
    from fastapi.testclient import TestClient


@dataclass
class Served:
    url: str
    store: Store
    client: TestClient
    submit: dict[str, str]  # the headers of a client with scope submit
    upload: str  # the URL prefix of the running attempt's artifacts
    worker: dict[str, str]  # the headers an upload for it needs
    task_id: str
    finish: Callable[[], object]  # ends the running attempt (a success)


@contextmanager
def serving(db_url: str, config: StoreConfig | None = None) -> Iterator[Served]:
    """An app over a store with one running attempt, its task's id, and tokens."""
    store = open_store(db_url, config)
    try:
        store.queue_create("q", max_concurrency=10, rate=0)
        task_id = submit(store)
        session, _ = worker(store)
        attempt = run_one(store, session).attempt
        submit_token = store.token_create("s", ["submit"])[1]
        worker_token = store.token_create("w", ["worker"])[1]
        app = create_app(ServerSettings(db_url=db_url, poll_interval=3600), store=store)
        with TestClient(app, raise_server_exceptions=False) as client:
            yield Served(
                db_url,
                store,
                client,
                {"Authorization": f"Bearer {submit_token}"},
                f"/v1/attempts/{attempt.id}/artifacts",
                {
                    "Authorization": f"Bearer {worker_token}",
                    "X-Orbit-Session": session.id,
                    "X-Orbit-Epoch": str(session.epoch),
                    "X-Orbit-Fence": str(attempt.fence),
                },
                task_id,
                partial(
                    store.attempt_finish,
                    session.id,
                    session.epoch,
                    attempt.id,
                    attempt.fence,
                    Outcome.success(None),
                ),
            )
    finally:
        store.close()


@pytest.fixture
def served(db_url: str) -> Iterator[Served]:
    with serving(db_url) as it:
        yield it


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _put(served: Served, name: str, body: bytes, content_type: str = "text/plain") -> Any:
    return served.client.put(
        f"{served.upload}/{name}",
        content=body,
        headers={**served.worker, "Content-Type": content_type},
    )


def test_a_download_is_an_attachment_the_browser_may_not_sniff(served: Served) -> None:
    """An uploaded page is served as what its uploader said, to be saved, never run: it
    had no ``X-Content-Type-Options: nosniff``, so a browser could sniff an artifact
    as HTML and render it as a page of the API's own origin."""
    page = b"<html><script>alert(1)</script></html>"
    made = _put(served, "page.txt", page)
    assert made.status_code == 201, made.text
    reply = served.client.get(f"/v1/artifacts/{made.json()['id']}/content", headers=served.submit)
    assert reply.status_code == 200 and reply.content == page
    assert reply.headers["x-content-type-options"] == "nosniff"
    assert reply.headers["content-type"] == "text/plain"
    assert reply.headers["content-disposition"] == 'attachment; filename="page.txt"'


@pytest.mark.parametrize(
    "content_type", ["text/plain; charset=shift_jis", "text/html", "image/png", "a/b; x=1"]
)
def test_a_download_has_the_content_type_it_was_uploaded_with(
    served: Served, content_type: str
) -> None:
    """Exactly as uploaded: Starlette added ``; charset=utf-8`` to a ``text/*`` type
    given as the response's media type, so a Shift_JIS file was labelled UTF-8."""
    made = _put(served, "typed.bin", "日本".encode("shift_jis"), content_type)
    assert made.status_code == 201, made.text
    reply = served.client.get(f"/v1/artifacts/{made.json()['id']}/content", headers=served.submit)
    assert reply.status_code == 200
    assert reply.headers["content-type"] == content_type


@pytest.mark.parametrize(
    "name", ['a"b.png', "r\u00e9sum\u00e9.pdf", "x\\y", 'q";x=1', "l\u00ednea\r\nX: 1", "\u65e5"]
)
def test_the_attachment_header_quotes_any_name_safely(name: str) -> None:
    """The header never lets a name end its quoted string or the header, and says the
    exact name in ``filename*`` (RFC 5987) when the plain one had to change it. Artifact
    names are ASCII letters, digits and ``_.:-`` today (``NAME_RE``), so the header was
    never broken; it was built by pasting the name between quotes all the same."""
    header = attachment(name)
    header.encode("latin-1")  # what an HTTP header must be
    assert "\r" not in header and "\n" not in header
    parsed = Message()
    parsed["Content-Disposition"] = header
    # exactly three parts: nothing in the name made a parameter of its own
    [kind, (key, plain), (key_exact, exact)] = parsed.get_params(header="content-disposition")
    assert kind == ("attachment", "") and key == key_exact == "filename"
    assert isinstance(plain, str) and plain.isascii() and '"' not in plain
    assert isinstance(exact, tuple) and collapse_rfc2231_value(exact) == name
    assert attachment("shot.png") == 'attachment; filename="shot.png"'


@pytest.mark.parametrize("name", ["a%22b.png", "r%C3%A9sum%C3%A9.pdf"])
def test_a_name_with_a_quote_or_a_non_ascii_letter_is_refused(served: Served, name: str) -> None:
    reply = _put(served, name, b"x")
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["code"] == "INVALID_ARGUMENT"
    assert served.store.artifact_list(served.task_id) == []


def test_an_upper_case_sha256_header_is_checked_as_any_other(served: Served) -> None:
    """``X-Orbit-Sha256`` in upper-case hex (what certutil or .NET's
    ``Convert.ToHexString`` give) is checked like lower-case: it was refused "must be 64
    hex digits", which it is. A digest that does not match is still refused."""
    digest = _sha(b"data").upper()
    made = served.client.put(
        f"{served.upload}/upper.bin",
        content=b"data",
        headers={**served.worker, "Content-Type": "a/b", "X-Orbit-Sha256": digest},
    )
    assert made.status_code == 201, made.text
    assert made.json()["sha256"] == _sha(b"data")  # stored and served lower-case
    wrong = served.client.put(
        f"{served.upload}/wrong.bin",
        content=b"other data",
        headers={**served.worker, "Content-Type": "a/b", "X-Orbit-Sha256": digest},
    )
    assert wrong.status_code == 400, wrong.text
    assert wrong.json()["error"]["code"] == "DIGEST_MISMATCH"
    for bad in (digest[:-1], digest[:-1] + "G"):
        reply = served.client.put(
            f"{served.upload}/bad.bin",
            content=b"data",
            headers={**served.worker, "Content-Type": "a/b", "X-Orbit-Sha256": bad},
        )
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["message"] == "X-Orbit-Sha256 must be 64 hex digits"
    assert [a.name for a in served.store.artifact_list(served.task_id)] == ["upper.bin"]


def test_a_tasks_artifacts_are_listed_a_page_at_a_time(served: Served) -> None:
    """``GET /v1/tasks/{id}/artifacts`` pages as ``GET /v1/tasks`` does: ``limit`` (1-1000,
    100 by default) and an opaque ``cursor``, answered as ``{"items", "next_cursor"}``.
    It answered a bare list of every artifact, however many."""
    made = []
    for i in range(3):
        reply = _put(served, f"part-{i}", b"x")
        assert reply.status_code == 201, reply.text
        made.append(reply.json()["id"])
    path = f"/v1/tasks/{served.task_id}/artifacts"
    whole = served.client.get(path, headers=served.submit)
    assert whole.status_code == 200, whole.text
    assert {a["id"] for a in whole.json()["items"]} == set(made)
    assert whole.json()["next_cursor"] is None
    seen, cursor = [], None
    for _ in range(4):  # three full pages of one, then the empty page their cursor gives
        query: dict[str, Any] = {"limit": 1, **({"cursor": cursor} if cursor else {})}
        page = served.client.get(path, params=query, headers=served.submit).json()
        seen += [a["id"] for a in page["items"]]
        cursor = page["next_cursor"]
    assert seen == [a["id"] for a in whole.json()["items"]] and cursor is None


def test_a_reader_asking_again_from_its_cursor_gets_an_upload_committed_late(
    served: Served,
) -> None:
    """A reader of a running task's artifacts that pages to the end and later asks again
    with the cursor of its last page gets every artifact committed since: the list is in
    the order uploads were committed. It was in id order, and an id is made when an
    upload begins, so a long upload, begun before an artifact the reader had read and
    committed after its page, sorted before the cursor: that reader never saw it."""
    session, epoch = served.worker["X-Orbit-Session"], int(served.worker["X-Orbit-Epoch"])
    fence, attempt_id = int(served.worker["X-Orbit-Fence"]), served.upload.split("/")[-2]
    slow = served.store.artifact_begin(
        session, epoch, attempt_id, fence, name="slow.bin", content_type="a/b"
    )
    served.store.artifact_write(slow, 0, b"a long upload")  # still uploading
    quick = _put(served, "quick.txt", b"done at once")
    assert quick.status_code == 201, quick.text
    path = f"/v1/tasks/{served.task_id}/artifacts"
    page = served.client.get(path, params={"limit": 1}, headers=served.submit).json()
    assert [a["id"] for a in page["items"]] == [quick.json()["id"]]
    cursor = page["next_cursor"]
    end = served.client.get(path, params={"limit": 1, "cursor": cursor}, headers=served.submit)
    assert end.json() == {"items": [], "next_cursor": None}  # the end, for now
    data = b"a long upload"
    served.store.artifact_commit(
        session, epoch, attempt_id, fence, slow, size=len(data), sha256=_sha(data)
    )
    again = served.client.get(path, params={"cursor": cursor}, headers=served.submit).json()
    assert [a["id"] for a in again["items"]] == [slow]
    whole = served.client.get(path, headers=served.submit).json()
    assert [a["id"] for a in whole["items"]] == [quick.json()["id"], slow]


def test_a_bad_artifact_page_request_is_refused(served: Served) -> None:
    """Every refusal the other listings give, with the same codes and fields: a limit out
    of 1-1000 or not a number, a cursor this server did not issue (or that does not
    decode to an artifact id), a parameter given twice, and an unknown task."""
    made = _put(served, "only", b"x").json()["id"]
    path = f"/v1/tasks/{served.task_id}/artifacts"
    bad_cursor = {
        "code": "INVALID_CURSOR",
        "message": "the cursor is not one this server issued",
        "field": "cursor",
    }
    cases: list[tuple[Any, dict[str, Any]]] = [
        ({"limit": "0"}, {"code": "INVALID_ARGUMENT", "field": "limit"}),
        ({"limit": "1001"}, {"code": "INVALID_ARGUMENT", "field": "limit"}),
        ({"limit": "ten"}, {"code": "INVALID_ARGUMENT", "field": "limit"}),
        ({"limit": "-1"}, {"code": "INVALID_ARGUMENT", "field": "limit"}),
        ({"cursor": "%%%"}, bad_cursor),
        ({"cursor": ""}, bad_cursor),
        ({"cursor": encode_cursor("hello")}, bad_cursor),
        ({"cursor": encode_cursor("0")}, bad_cursor),
        ({"cursor": encode_cursor(made.upper())}, bad_cursor),
        ({"cursor": encode_cursor(made + "0")}, bad_cursor),
        # a place in the list: plain ASCII digits, 1 to 2^63 - 1, no sign, no leading zero
        ({"cursor": encode_cursor("01")}, bad_cursor),
        ({"cursor": encode_cursor("+1")}, bad_cursor),
        ({"cursor": encode_cursor(" 1")}, bad_cursor),
        ({"cursor": encode_cursor("\u0661")}, bad_cursor),
        ({"cursor": encode_cursor(str(2**63))}, bad_cursor),
        # an artifact id (a cursor from before the commit order) naming none of the task's
        ({"cursor": encode_cursor("01a3185c-5000-7000-8000-000000000000")}, bad_cursor),
        ([("limit", "1"), ("limit", "2")], {"code": "INVALID_ARGUMENT", "field": "limit"}),
        ([("cursor", "MQ"), ("cursor", "Mg")], {"code": "INVALID_ARGUMENT", "field": "cursor"}),
    ]
    for query, expected in cases:
        reply = served.client.get(path, params=query, headers=served.submit)
        assert reply.status_code == 400, (query, reply.text)
        error = reply.json()["error"]
        assert {k: error[k] for k in expected} == expected, (query, error)
    unknown = served.client.get(
        "/v1/tasks/01a3185c-5000-7000-8000-000000000000/artifacts", headers=served.submit
    )
    assert unknown.status_code == 404, unknown.text
    assert unknown.json()["error"]["code"] == "TASK_NOT_FOUND"
    after = served.client.get(path, params={"cursor": encode_cursor(made)}, headers=served.submit)
    assert after.json() == {"items": [], "next_cursor": None}
    place = served.store.artifact_list(served.task_id)[-1].ready_seq
    assert place is not None  # the last place drawn: the end, for now
    reply = served.client.get(
        path, params={"cursor": encode_cursor(str(place))}, headers=served.submit
    )
    assert reply.json() == {"items": [], "next_cursor": None}
    # a place never drawn: its empty page read as "nothing new yet" for ever after
    for never in (str(place + 1), str(2**63 - 1)):
        reply = served.client.get(
            path, params={"cursor": encode_cursor(never)}, headers=served.submit
        )
        assert reply.status_code == 400, (never, reply.text)
        assert reply.json()["error"] == bad_cursor, never


#: no RFC 9110 media type, each once passed ``content_type_problem``: a space or tab at
#: an end (h11 then refused the worker's header: a retryable Unreachable in the handler)
#: or not ``type/subtype`` (stored and served back)
NOT_MEDIA_TYPES = [
    "text/plain ",
    " text/plain",
    "\ttext/x",
    "ab/",
    "/ab",
    "a b/c d",
    "text/plain/extra",
    "a/b;x",
]
#: media types the rule keeps taking
MEDIA_TYPES = ["application/json; charset=utf-8", 'a/b; x="y z"', "text/plain;\tq=1"]


def test_the_upload_route_refuses_a_content_type_that_is_no_media_type(
    served: Served,
) -> None:
    """400 INVALID_ARGUMENT naming the rule, nothing stored: a space or tab at an end, or
    no ``type/subtype``, each once stored and served back. A media type with parameters
    is still stored and served back as given."""
    for i, content_type in enumerate(NOT_MEDIA_TYPES):
        reply = _put(served, f"bad-{i}", b"x", content_type)
        assert reply.status_code == 400, (content_type, reply.text)
        error = reply.json()["error"]
        assert error["code"] == "INVALID_ARGUMENT", content_type
        assert "content_type must be a media type" in error["message"], content_type
    for i, content_type in enumerate(MEDIA_TYPES):
        reply = _put(served, f"good-{i}", b"x", content_type)
        assert reply.status_code == 201, (content_type, reply.text)
        got = served.client.get(
            f"/v1/artifacts/{reply.json()['id']}/content", headers=served.submit
        )
        assert got.headers["content-type"] == content_type
    kept = sorted(a.content_type for a in served.store.artifact_list(served.task_id))
    assert kept == sorted(MEDIA_TYPES)
