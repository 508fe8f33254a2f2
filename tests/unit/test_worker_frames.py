"""The worker's hot paths written the cheap way mean what the plain way meant: a request
frame written by orjson (``connection.frame_text``) is the JSON value ``json.dumps``
writes, and the attempt's wait for its handler (``runner._ended_or_timed_out``) ends as
``asyncio.wait((task,), timeout=…)`` does."""

from __future__ import annotations

import asyncio
import enum
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orbit.core.model import parse_json
from orbit.protocol.decode import decode_json
from orbit.worker import outcomes
from orbit.worker.connection import (
    ServerError,
    WorkerConnection,
    frame_text,
    outcome,
    outcome_wire,
    read_frame,
)
from orbit.worker.runner import _ended_or_timed_out, _item, _items, _sendable
from tests.unit.fake_gateway import FakeGateway


def _json(message: dict[str, Any]) -> str:
    return json.dumps(message, separators=(",", ":"))


_chars = st.characters(codec=None, exclude_categories=[])  # surrogates and NUL included


def _values(leaves: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.recursive(
        leaves,
        lambda inner: (
            st.lists(inner, max_size=3)
            | st.tuples(inner)
            | st.dictionaries(st.text(_chars, max_size=4), inner, max_size=3)
        ),
        max_leaves=10,
    )


_plain_leaves = (
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(_chars, max_size=6)
)
_plain = _values(_plain_leaves)
#: with floats: orjson writes them as the same number, but not always as short
_with_floats = _values(_plain_leaves | st.floats(allow_nan=False, allow_infinity=False))


@settings(max_examples=500, deadline=None)
@given(_plain)
def test_a_plain_frame_is_the_value_json_dumps_writes_and_no_longer(value: Any) -> None:
    message = {"type": "finish_many", "items": [{"outcome": outcome(result=value)}]}
    fast = frame_text(message, plain=True)
    assert fast.isascii()
    assert len(fast) <= len(_json(message))
    _same_value(fast, message)


@settings(max_examples=500, deadline=None)
@given(_with_floats)
def test_a_frame_with_floats_written_by_orjson_is_the_same_value(value: Any) -> None:
    """Floats are not plain (the size ``outcomes.wire_size`` counts may be passed:
    6.103515625e-05 took 0.00006103515625), but orjson would still write their value."""
    message = {"type": "finish_many", "items": [{"outcome": outcome(result=value)}]}
    _same_value(frame_text(message, plain=True), message)


def _plain(result: Any) -> bool:
    """Whether the runner calls a handler's ``result`` plain (``_sendable``, once the
    result is taken; one it refuses is sent as its failure instead)."""
    report, _, plain = _sendable({"result": result})
    assert "result" in report, report
    return plain


def test_the_float_that_orjson_writes_longer_is_not_plain() -> None:
    report = outcome(result=6.103515625e-05)
    message = {"type": "finish_many", "items": [{"outcome": report}]}
    assert not _plain(6.103515625e-05)
    assert frame_text(message, plain=_plain(6.103515625e-05)) == _json(message)
    assert len(frame_text(message, plain=True)) > len(_json(message))


def _same_value(fast: str, message: dict[str, Any]) -> None:
    """``fast`` reads as the value ``json.dumps`` writes of ``message``, or is refused by
    the server's reader as that is."""
    slow = _json(message)
    try:
        expected = decode_json(slow)
    except Exception as exc:  # a lone surrogate: the server refuses it either way
        with pytest.raises(type(exc)):
            decode_json(fast)
        return
    assert decode_json(fast) == expected


class _Coded(str, enum.Enum):  # noqa: UP042 - the mixin as older code writes it
    """A str Enum whose value is not its text: orjson writes 200, json.dumps "ok"."""

    def __new__(cls, text: str, code: int) -> _Coded:
        member = str.__new__(cls, text)
        member._value_ = code
        return member

    OK = ("ok", 200)


class _Text(str):
    pass


NOT_PLAIN = [
    float("nan"),  # json.dumps: NaN (refused by the server); orjson: null
    [float("inf")],
    _Coded.OK,
    {"k": _Coded.OK},
    _Text("x"),
    {1: "a"},  # a key that is no text: refused (RESULT_NOT_JSON), the failure sent
    {"é": "日本語"},  # non-ASCII: escaped, as json.dumps writes it
    2**64,
    {"a": 1.5},
]


@pytest.mark.parametrize("value", NOT_PLAIN)
def test_a_finish_the_runner_does_not_call_plain_is_written_by_json_dumps(value: Any) -> None:
    """What the runner takes of these it writes as json.dumps does, byte for byte: by
    json.dumps (not plain), or by orjson's fallback to it (non-ASCII); what it refuses
    (NaN, an int beyond 64 bits) it sends as its failure, plain, and that too."""
    report, _, plain = _sendable({"result": value})
    message = {"type": "finish_many", "items": [{"outcome": outcome_wire(report)}]}
    assert frame_text(message, plain=plain) == _json(message)


@pytest.mark.parametrize(
    "value", [_Text("x"), {1: "a"}, {"é": "日本語"}, 2**64, {"k": [_Text("y")]}]
)
def test_what_orjson_refuses_or_writes_past_ascii_takes_json_dumps_even_called_plain(
    value: Any,
) -> None:
    message = {"type": "finish_many", "items": [{"outcome": outcome(result=value)}]}
    assert frame_text(message, plain=True) == _json(message)


def test_the_runner_calls_plain_only_what_is() -> None:
    assert _plain(None)
    assert _plain(True)
    failed = outcomes.error(_Text("CODE\x00"), _Text("message \udcff"), retryable=False)
    assert _sendable(failed) == (failed, outcomes.wire_size(failed["error"]), True)
    assert all(type(v) in (str, bool) for v in failed["error"].values())
    # a handler's usual answers: a scalar, or a flat dict or list of them
    for result in (1, -(2**63), "text", "", {"a": 1, "b": "x", "c": None, "d": False}, [1, "a"]):
        assert _plain(result), result
    assert _plain({}) and _plain([])
    # anything else takes json.dumps: floats, subclasses, Enums, other keys, nesting
    for result in (
        _Coded.OK,
        1.5,
        _Text("x"),
        (1, 2),
        {"a": 1.5},
        [1.0],
        {"a": _Text("x")},
        [_Coded.OK],
        {"a": {"b": 1}},
        [[1]],
        {"a": [1]},
    ):
        assert not _plain(result), result
    # a key that is no text is not sent at all (json.dumps wrote it as text: changed)
    refused, _, _ = _sendable({"result": {1: "a"}})
    assert refused["error"]["code"] == "RESULT_NOT_JSON"


_flat_leaves = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.text(_chars, max_size=6)
    | st.floats()
    | st.builds(_Text, st.text(max_size=3))
    | st.just(_Coded.OK)
)
_flat = (
    _flat_leaves
    | st.lists(_flat_leaves, max_size=4)
    | st.dictionaries(st.text(_chars, max_size=4) | st.integers(0, 3), _flat_leaves, max_size=4)
)


@settings(max_examples=500, deadline=None)
@given(_flat)
def test_a_finish_the_runner_calls_plain_is_the_value_json_dumps_writes_and_no_longer(
    value: Any,
) -> None:
    """Whatever the runner calls plain (after ``outcomes.check_result`` took it, as
    ``_sendable`` does) is written as the value ``json.dumps`` writes, never longer (the
    size the batch counted); the rest is ``json.dumps``'s byte for byte."""
    report, _, plain = _sendable({"result": value})
    if "error" in report:
        return  # the runner sends its failure instead
    message = {"type": "finish_many", "items": [{"outcome": outcome_wire(report)}]}
    written = frame_text(message, plain=plain)
    if not plain:
        assert written == _json(message)
        return
    assert len(written) <= len(_json(message))
    _same_value(written, message)


def test_the_wait_ends_with_the_task() -> None:
    async def main() -> None:
        task = asyncio.create_task(asyncio.sleep(0.01, "done"))
        await _ended_or_timed_out(task, None)
        assert task.done() and task.result() == "done"
        task = asyncio.create_task(asyncio.sleep(0.01))
        await _ended_or_timed_out(task, 10.0)
        assert task.done()
        # its timer went with it: nothing is left scheduled 10 s from now
        assert not [h for h in asyncio.get_running_loop()._scheduled if not h.cancelled()]  # type: ignore[attr-defined]

    asyncio.run(main())


@pytest.mark.parametrize("timeout", [None, 0.0, 0.02, 10.0])
@pytest.mark.parametrize("handler", ["returns", "sleeps", "raises", "yields once"])
def test_the_wait_ends_when_asyncio_wait_would(timeout: float | None, handler: str) -> None:
    """Whether the handler is done once the wait ends, beside ``asyncio.wait`` on the
    same handler: a limit of 0 included, which ends after the handler's first step."""

    async def run() -> None:
        if handler == "sleeps":
            await asyncio.sleep(0.1)
        elif handler == "raises":
            raise TimeoutError("the handler's own")
        elif handler == "yields once":
            await asyncio.sleep(0)

    async def main() -> tuple[bool, bool]:
        task = asyncio.create_task(run())
        done, _ = await asyncio.wait((task,), timeout=timeout)
        theirs = task in done
        task.cancel()
        task = asyncio.create_task(run())
        await _ended_or_timed_out(task, timeout)
        ours = task.done()
        task.cancel()
        return theirs, ours

    for loop_factory in (None, "uvloop"):
        factory = None
        if loop_factory is not None:
            import uvloop

            factory = uvloop.new_event_loop
        with asyncio.Runner(loop_factory=factory) as runner:
            theirs, ours = runner.run(main())
        assert ours == theirs
        if handler == "sleeps":
            assert ours == (timeout is None or timeout == 10.0)


def test_a_cancelled_wait_leaves_the_task_running_and_raises_its_cancel() -> None:
    async def main() -> None:
        task = asyncio.create_task(asyncio.sleep(0.05, "done"))
        waiting = asyncio.create_task(_wait(task))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert not task.done()
        assert await task == "done"

    async def _wait(task: asyncio.Task[Any]) -> None:
        await _ended_or_timed_out(task, None)

    asyncio.run(main())


def test_a_handler_that_raises_ends_the_wait_without_raising() -> None:
    async def main() -> None:
        async def fails() -> None:
            raise TimeoutError("the handler's own")

        task = asyncio.create_task(fails())
        await _ended_or_timed_out(task, 10.0)
        assert isinstance(task.exception(), TimeoutError)

    asyncio.run(main())


#: frames as text, odd ones among them: what orjson refuses (a lone surrogate's escape,
#: an integer beyond 64 bits, NaN), what neither reads, and what no one should send
ODD_FRAMES = [
    '{"type":"tasks","req_id":null,"tasks":[]}',
    '{"type":"cancel","attempt_ids":["a\\ud800"]}',
    '{"type":"ack","req_id":"r1","n":18446744073709551616}',
    '{"type":"ack","req_id":"r1","x":NaN}',
    '{"type":"ack","req_id":"r1","s":"é日本語\\u0000"}',
    '{"a":1,"a":2}',
    "[1, 2, 3]",
    '  {"type" : "ack" }  ',
    "not JSON",
    "{",
    "",
    '"\udcff"',  # a lone surrogate in the text itself: no UTF-8 can carry it
]


@pytest.mark.parametrize("text", ODD_FRAMES)
def test_a_frame_read_from_its_bytes_is_what_its_text_read(text: str) -> None:
    """``read_frame`` (the frame's bytes) against ``parse_json`` of the text websockets
    decoded before: the same value, or the same kind of error."""
    try:
        data = text.encode()
    except UnicodeEncodeError:  # never on the wire as text: websockets sends it refused
        data = text.encode("utf-8", "surrogatepass")
    try:
        expected = parse_json(data.decode())
    except Exception as exc:
        with pytest.raises(type(exc)):
            read_frame(data)
        return
    got = read_frame(data)
    assert got == expected or (got != got and expected != expected)  # NaN
    assert json.dumps(got) == json.dumps(expected)


@settings(max_examples=300, deadline=None)
@given(_with_floats)
def test_any_json_frame_reads_the_same_from_its_bytes(value: Any) -> None:
    text = json.dumps({"type": "x", "value": value}, ensure_ascii=False)
    try:
        data = text.encode()
    except UnicodeEncodeError:  # a lone surrogate: not UTF-8, so not a text frame
        return
    assert json.dumps(read_frame(data)) == json.dumps(parse_json(text))


def test_a_frame_that_is_not_utf8_raises_as_websockets_did() -> None:
    with pytest.raises(UnicodeDecodeError):
        read_frame(b'{"type":"ack","s":"\xff"}')
    with pytest.raises(UnicodeDecodeError):
        read_frame('{"s":"\ud800"}'.encode("utf-8", "surrogatepass"))


def test_an_unreadable_frame_closes_the_connection_and_a_readable_one_arrives() -> None:
    """End to end over a socket: a text frame of invalid UTF-8 (websockets' decode raised
    for it; now the reader's) closes the connection, as one that is not JSON does; a
    lone surrogate's escape, which orjson refuses, is still read."""

    async def main() -> None:
        async with FakeGateway() as gw:
            for bad in (b'{"type":"cancel","attempt_ids":["\xff"]}', b"not JSON"):
                conn = await WorkerConnection.connect(gw.ws_url, "token")
                try:
                    await gw.connections[-1].send('{"type":"cancel","attempt_ids":["a\\ud800"]}')
                    pushed = await conn.next_push(10)
                    assert pushed == {"type": "cancel", "attempt_ids": ["a\ud800"]}
                    await gw.connections[-1].send(bad, text=True)
                    assert (await conn.next_push(10))["type"] == "closed"
                finally:
                    await conn.close()

    asyncio.run(main())


def test_a_batch_reply_is_answered_item_by_item_as_item_answers_each() -> None:
    """``_items`` takes the usual item (no error, a dict) in one expression and hands
    every other to ``_item``: the same answers, the same objects, the same errors."""
    lease = {"attempt_id": "a", "status": "ok", "lease_left": 1.0}
    pairs = [["status", "ok"]]
    results: list[dict[str, Any]] = [
        {"attempt_id": "a", "lease": lease, "error": None},
        {"attempt_id": "b", "lease": lease},  # no error field: as FakeGateway answers
        {"attempt_id": "c", "lease": None, "error": {"code": "STALE_FENCE", "message": "m"}},
        {"attempt_id": "d", "lease": pairs, "error": None},  # not a dict: copied as one
    ]
    fast, slow = _items(results, "lease"), [_item(r, "lease") for r in results]
    assert fast[0] is lease and fast[1] is lease
    assert fast[3] == slow[3] == {"status": "ok"}
    assert isinstance(fast[2], ServerError) and isinstance(slow[2], ServerError)
    assert (fast[2].code, fast[2].message) == (slow[2].code, slow[2].message)
    with pytest.raises(KeyError):
        _items([{"attempt_id": "e", "error": None}], "lease")  # as _item raises


def test_finish_many_keeps_its_signature_and_sends_what_finish_flagged_sends() -> None:
    """``WorkerConnection.finish_many`` is public (``orbit.worker``): items of id, fence
    and outcome, ``plain`` a keyword defaulting to the standard library's writing. The
    runner's ``finish_flagged`` takes each item's plainness instead; both put the same
    items on the wire and get the same answers."""

    async def main() -> None:
        async with FakeGateway() as gw:
            conn = await WorkerConnection.connect(gw.ws_url, "token")
            try:
                items = [("a1", "1", outcome(result={"n": 1})), ("a2", "2", outcome(result=2.5))]
                by_default = await conn.finish_many(items)
                said_plain = await conn.finish_many(items[:1], plain=True)
                flagged = await conn.finish_flagged(
                    [(a, f, o, p) for (a, f, o), p in zip(items, [True, False], strict=True)]
                )
            finally:
                await conn.close()
            sent = [m["items"] for m in gw.received if m["type"] == "finish_many"]
            assert sent[0] == sent[2] and sent[1] == sent[0][:1]
            assert [r["attempt_id"] for r in by_default] == ["a1", "a2"]
            assert [r["attempt_id"] for r in flagged] == ["a1", "a2"]
            assert [r["attempt_id"] for r in said_plain] == ["a1"]

    asyncio.run(main())
