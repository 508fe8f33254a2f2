"""Listing and revoking API tokens, on every backend: a revoked token grants nothing, a
second revoke keeps the first instant, and a revoke that is refused changes nothing."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import fields

import pytest

from orbit.core.errors import Code, OrbitError
from orbit.core.model import SECOND
from orbit.store import InjectedFault, Store
from tests.conftest import T0, ManualClock


def _id_of(token: str) -> str:
    return token.split("_")[1]


def test_a_revoked_token_grants_nothing_and_is_listed_as_revoked(
    store: Store, clock: ManualClock
) -> None:
    ops_id, ops = store.token_create("ops", ["admin"])
    clock.advance(1)
    ci_id, ci = store.token_create("ci", ["worker", "submit"])
    clock.advance(1)
    revoked = store.token_revoke(ops_id)
    assert revoked.id == ops_id and revoked.revoked_at == T0 + 2 * SECOND
    assert store.token_scopes(ops) is None
    assert store.token_scopes(ci) == frozenset({"submit", "worker"})
    listed = store.token_list()
    assert [(t.id, t.name, t.scopes, t.created_at, t.revoked_at) for t in listed] == [
        (ops_id, "ops", ("admin",), T0, T0 + 2 * SECOND),
        (ci_id, "ci", ("submit", "worker"), T0 + SECOND, None),
    ]
    assert listed[0] == revoked


def test_a_listing_holds_no_secret_nor_its_hash(store: Store) -> None:
    token_id, token = store.token_create("ops", ["admin"])
    [listed] = store.token_list()
    assert {f.name for f in fields(listed)} == {"id", "name", "scopes", "created_at", "revoked_at"}
    secret = token.split("_", 2)[2]
    assert secret not in repr(listed) and token_id in repr(listed)


def test_revoking_twice_keeps_the_first_revoked_at(store: Store, clock: ManualClock) -> None:
    token_id, token = store.token_create("ops", ["admin"])
    first = store.token_revoke(token_id)
    clock.advance(60)
    again = store.token_revoke(token_id)
    assert again == first and again.revoked_at == T0
    assert store.token_list() == [first]
    assert store.token_scopes(token) is None


def _refused(store: Store, code: Code, call: Callable[[], object]) -> OrbitError:
    """``call`` raises ``code``, and every token reads as it did before."""
    before = store.token_list()
    with pytest.raises(OrbitError) as err:
        call()
    assert err.value.code == code, err.value
    assert store.token_list() == before, "a refused revoke changed a token"
    return err.value


def test_revoking_an_unknown_id_is_refused_and_changes_nothing(store: Store) -> None:
    _, kept = store.token_create("ops", ["admin"])
    unknown = "0" * 32
    err = _refused(store, Code.TOKEN_NOT_FOUND, lambda: store.token_revoke(unknown))
    assert err.status == 404 and unknown in err.message
    assert store.token_scopes(kept) == frozenset({"admin"})


@pytest.mark.parametrize("given", ["", "x" * 65, "ab-cd", "ab cd", "é" * 8, "whole-token"])
def test_revoking_what_is_no_token_id_is_refused_without_echoing_it(
    store: Store, given: str
) -> None:
    """A whole token given for its id is refused without being repeated: the message
    would otherwise carry its secret into a terminal or a log."""
    token_id, kept = store.token_create("ops", ["admin"])
    if given == "whole-token":
        given = kept
    err = _refused(store, Code.INVALID_ARGUMENT, lambda: store.token_revoke(given))
    assert err.status == 400
    if given:
        assert given not in str(err) and kept.split("_", 2)[2] not in str(err)
    assert store.token_scopes(kept) == frozenset({"admin"})
    assert store.token_list()[0].id == token_id


def test_a_revoke_that_fails_midway_leaves_the_token_working(store: Store) -> None:
    token_id, token = store.token_create("ops", ["admin"])
    with store.inject_fault("token_revoke"), pytest.raises(InjectedFault):
        store.token_revoke(token_id)
    assert store.token_scopes(token) == frozenset({"admin"})
    assert store.token_list()[0].revoked_at is None


def test_revoked_at_is_read_from_the_database_clock(make_store: Callable[..., Store]) -> None:
    """Without a test clock the instant is the database's (PostgreSQL's clock_timestamp(),
    SQLite's process clock): here, the same machine's, so within the call's span."""
    store = make_store()
    token_id, _ = store.token_create("ops", ["admin"])
    before = time.time_ns() // 1000
    revoked = store.token_revoke(token_id)
    after = time.time_ns() // 1000
    assert revoked.revoked_at is not None
    assert before - SECOND <= revoked.revoked_at <= after + SECOND
    assert store.token_list()[0].revoked_at == revoked.revoked_at
