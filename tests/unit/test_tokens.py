"""ORBIT_TOKEN / ORBIT_TOKEN_FILE: every refusal says which source was wrong, never the token."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from orbit.tokens import TokenError, load_token

SECRET = "orbit_abc_s3cr3t"


def test_token_from_env() -> None:
    assert load_token({"ORBIT_TOKEN": f" {SECRET}\n"}) == SECRET


def test_token_from_private_file(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text(SECRET + "\n")
    f.chmod(0o600)
    assert load_token({"ORBIT_TOKEN_FILE": str(f)}) == SECRET


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({}, "set ORBIT_TOKEN or ORBIT_TOKEN_FILE"),
        ({"ORBIT_TOKEN": "  "}, "ORBIT_TOKEN is set but empty"),
        ({"ORBIT_TOKEN_FILE": ""}, "ORBIT_TOKEN_FILE is set but empty"),
        ({"ORBIT_TOKEN_FILE": "/nonexistent/token"}, "does not exist"),
    ],
)
def test_missing_or_empty_token_is_refused(env: dict[str, str], says: str) -> None:
    with pytest.raises(TokenError, match=says):
        load_token(env)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o644])
def test_token_file_readable_by_others_is_refused(tmp_path: Path, mode: int) -> None:
    f = tmp_path / "token"
    f.write_text(SECRET)
    f.chmod(mode)
    with pytest.raises(TokenError, match="open to group or others") as err:
        load_token({"ORBIT_TOKEN_FILE": str(f)})
    assert SECRET not in str(err.value)


def test_empty_token_file_and_directory_are_refused(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text("\n")
    f.chmod(0o600)
    with pytest.raises(TokenError, match="is empty"):
        load_token({"ORBIT_TOKEN_FILE": str(f)})
    tmp_path.chmod(0o700)
    with pytest.raises(TokenError, match="not a regular file"):
        load_token({"ORBIT_TOKEN_FILE": str(tmp_path)})


@pytest.mark.parametrize("where", ["through a file", "a symlink loop", "a name too long"])
def test_a_token_file_path_the_system_cannot_follow_is_refused_naming_it(
    tmp_path: Path, where: str
) -> None:
    """A path through a regular file (ENOTDIR), a symlink loop (ELOOP) or a name too long
    raised the bare OSError: ``orbit task ls`` printed a traceback, and a worker took it
    for a network failure and retried its first connection for ever. It is a TokenError
    naming the variable and the file, as a missing file is."""
    plain = tmp_path / "plain"
    plain.write_text(SECRET)
    plain.chmod(0o600)
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    path = {
        "through a file": plain / "token",
        "a symlink loop": loop,
        "a name too long": tmp_path / ("x" * 300),
    }[where]
    says = f"^ORBIT_TOKEN_FILE {re.escape(str(path))} cannot be read"
    with pytest.raises(TokenError, match=says) as err:
        load_token({"ORBIT_TOKEN_FILE": str(path)})
    assert "s3cr3t" not in str(err.value)


@pytest.mark.parametrize(
    "token", [f"{SECRET}\nsecond line", f"{SECRET} trailing words", f"{SECRET}é", f"{SECRET}\x00"]
)
def test_a_token_no_header_can_carry_is_refused_without_echoing_it(
    tmp_path: Path, token: str
) -> None:
    """A line break, a space, a control or a non-ASCII character inside a token (a
    token file of two lines, a pasted sentence) is refused where the token is read,
    naming the source and not the token: sent on, http.client raised
    ``ValueError("Invalid header value b'Bearer <the token>'")``, which the CLI printed
    as a traceback."""
    with pytest.raises(TokenError, match="ORBIT_TOKEN holds") as direct:
        load_token({"ORBIT_TOKEN": token})
    f = tmp_path / "token"
    f.write_text(token + "\n")
    f.chmod(0o600)
    with pytest.raises(TokenError, match=f"ORBIT_TOKEN_FILE {f} holds") as from_file:
        load_token({"ORBIT_TOKEN_FILE": str(f)})
    for err in (direct, from_file):
        assert "s3cr3t" not in str(err.value)


@pytest.mark.parametrize("token", [f"{SECRET}\nX-Evil: 1", f"{SECRET} x", "", f"{SECRET}é"])
def test_clients_refuse_a_token_no_header_can_carry_without_echoing_it(token: str) -> None:
    from orbit.client import AsyncClient, Client

    for make in (Client, AsyncClient):
        with pytest.raises(ValueError, match="token") as caught:
            make("http://127.0.0.1:9", token=token)
        assert "s3cr3t" not in str(caught.value)


def test_a_worker_connection_refuses_a_token_no_header_can_carry_without_echoing_it() -> None:
    """websockets refused such a token with ``InvalidHeaderValue("invalid Authorization
    header: Bearer <the token>")``, and the runner, taking that for a network failure,
    retried it for ever. It is a TokenError now, before anything is sent, which ends
    a worker's first connection as a missing token does."""
    import asyncio

    from orbit.worker import WorkerConnection
    from orbit.worker.runner import Worker

    bad = f"{SECRET}\nsecond line"
    with pytest.raises(TokenError, match="the token holds") as caught:
        asyncio.run(WorkerConnection.connect("ws://127.0.0.1:9/v1/worker", bad))
    assert "s3cr3t" not in str(caught.value)

    worker = Worker("http://127.0.0.1:9", bad, reconnect_max=0.1)

    @worker.handler("h")
    async def h(ctx: object, payload: object) -> None:
        return None

    with pytest.raises(TokenError) as ended:
        asyncio.run(asyncio.wait_for(worker.arun(), 10))
    assert "s3cr3t" not in str(ended.value)


@pytest.mark.parametrize(
    ("token", "found"),
    [
        ("orbit_0123456789abcdef0123456789abcdef_s3cr3t", "0123456789abcdef0123456789abcdef"),
        ("orbit_abc_s3cr3t_with_underscores", "abc"),
        ("orbit_" + "a" * 64 + "_s3cr3t", "a" * 64),
        ("orbit_" + "a" * 65 + "_s3cr3t", None),  # longer than any id
        ("orbit_\u00e9t\u00e9_s3cr3t", None),  # letters, not ASCII
        ("orbit__s3cr3t", None),
        ("orbit_ab-c_s3cr3t", None),
        ("ORBIT_abc_s3cr3t", None),
        ("orbit_abc", None),
    ],
)
def test_a_token_id_is_1_to_64_ascii_letters_and_digits(token: str, found: str | None) -> None:
    """What ``token_id`` takes for an id is what ``orbit token revoke`` takes: an id is no
    longer than 64 ASCII letters and digits, so no node keeps a bogus token's megabyte
    "id" (tests/store/test_token_check.py)."""
    from orbit.tokens import token_id

    assert token_id(token) == found
