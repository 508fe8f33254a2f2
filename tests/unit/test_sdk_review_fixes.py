"""The SDK review's fixes that need no server: the ``py.typed`` marker, the token's
ValueError, ``request_json``'s path for a value JSON cannot hold, and ``submit_many``'s
typing by ``reply``."""

from __future__ import annotations

import tomllib
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest

import orbit
from orbit import AsyncClient, Client
from orbit.client import TokenError
from orbit.client import _client as client_module
from orbit.client._client import SubmittedTask, request_json
from orbit.tokens import load_token

ROOT = Path(__file__).resolve().parents[2]


def test_the_package_carries_the_py_typed_marker_and_ships_it() -> None:
    """Without ``orbit/py.typed`` (PEP 561) users' type checkers ignored Orbit's
    annotations; package-data ships it in the wheel."""
    assert (Path(orbit.__file__).parent / "py.typed").is_file()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in pyproject["tool"]["setuptools"]["package-data"]["orbit"]


@pytest.mark.parametrize("make", [Client, AsyncClient])
def test_no_token_is_a_value_error_as_every_setup_mistake_is(
    make: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/quickstart.md: each mistake a client is made with is a ValueError, the token
    included; a missing token was a plain Exception, which ``except ValueError`` missed."""
    monkeypatch.delenv("ORBIT_TOKEN", raising=False)
    monkeypatch.delenv("ORBIT_TOKEN_FILE", raising=False)
    with pytest.raises(ValueError, match="no token: set ORBIT_TOKEN or ORBIT_TOKEN_FILE"):
        make("http://127.0.0.1:8000")
    with pytest.raises(TokenError):  # the type the SDK exports, still raised as it was
        load_token({})


@dataclass
class Holder:
    items: set[int]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"payload": {"tags": {"a"}}}, "the set at payload.tags (send a list)"),
        ({"payload": frozenset()}, "the frozenset at payload (send a list)"),
        ({"tasks": [{}, {"payload": [1, b"x"]}]}, "the bytes at tasks[1].payload[1] (send text"),
        ({"payload": {"big": 2**70, "o": object()}}, "the object at payload.o"),
        ({"payload": Holder({1})}, "the Holder at payload"),
        ([bytearray(b"x")], "the bytearray at [0]"),
    ],
)
def test_a_value_json_cannot_hold_is_named_by_its_path(body: object, says: str) -> None:
    """The encoder said only "Object of type set is not JSON serializable"."""
    with pytest.raises(TypeError) as refused:
        request_json(body)  # type: ignore[arg-type]
    assert says in str(refused.value)
    assert str(refused.value).endswith("(nothing was sent)")


def test_values_json_holds_are_still_written() -> None:
    """The walk refuses only what cannot be written: an integer past 64 bits (orjson's
    refusal, the standard library's to write), a tuple; a dataclass orjson writes is not
    what is named beside a set."""

    @dataclass
    class Point:
        x: int

    body = {"payload": {"big": 2**70, "t": (1, "a")}}
    assert request_json(body) == b'{"payload":{"big":1180591620717411303424,"t":[1,"a"]}}'
    with pytest.raises(TypeError, match=r"the set at payload\.s "):  # not the Point
        request_json({"payload": {"p": Point(1), "s": {1}}})
    with pytest.raises(TypeError, match="JSON object keys must be strings"):
        request_json({"payload": {1: {"s": {1}}}})  # a key's refusal is as it was


@pytest.mark.parametrize("cls", [Client, AsyncClient])
def test_submit_many_is_typed_by_its_reply(cls: type[Client] | type[AsyncClient]) -> None:
    """With ``reply="full"`` (the default) the items are ``SubmittedTask``, which mypy
    did not know: ``.created`` was "dict[str, Any] has no attribute created"."""
    hints = [
        typing.get_type_hints(f, globalns=vars(client_module))
        for f in typing.get_overloads(cls.submit_many)
    ]
    assert [h["reply"] for h in hints] == [
        typing.Literal["full"],
        typing.Literal["ids"],
    ]
    assert hints[0]["return"] == list[SubmittedTask]
    assert hints[1]["return"] == list[dict[str, typing.Any]]
