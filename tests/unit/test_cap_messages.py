"""Strict decoding of the cap-changing bodies: ``PATCH /v1/queues/{name}`` (QueueUpdate)
and ``PUT /v1/limits/...`` (LimitSet). Every rejection, with its code and field."""

from __future__ import annotations

import pytest

from orbit.protocol.decode import DecodeError, decode_model
from orbit.protocol.messages import LimitSet, QueueCreate, QueueUpdate


@pytest.mark.parametrize(
    ("body", "code", "field"),
    [
        ("{}", "MISSING_FIELD", None),  # nothing to change
        ('{"max_concurrency":null}', "NULL_NOT_ALLOWED", "max_concurrency"),
        ('{"rate":null}', "NULL_NOT_ALLOWED", "rate"),
        ('{"burst":null,"rate":1}', "NULL_NOT_ALLOWED", "burst"),
        ('{"max_concurrency":0}', "NUMBER_OUT_OF_RANGE", "max_concurrency"),
        ('{"max_concurrency":1000001}', "NUMBER_OUT_OF_RANGE", "max_concurrency"),
        ('{"rate":-1}', "NUMBER_OUT_OF_RANGE", "rate"),
        ('{"rate":1000001}', "NUMBER_OUT_OF_RANGE", "rate"),
        ('{"rate":5e-324}', "NUMBER_OUT_OF_RANGE", "rate"),  # a subnormal: no refill interval
        ('{"rate":9.99e-7}', "NUMBER_OUT_OF_RANGE", "rate"),  # just below MIN_RATE
        ('{"rate":1e400}', "NUMBER_OUT_OF_RANGE", None),
        ('{"rate":NaN}', "NON_FINITE_NUMBER", None),
        ('{"burst":0}', "NUMBER_OUT_OF_RANGE", "burst"),
        ('{"max_concurrency":"5"}', "INVALID_TYPE", "max_concurrency"),
        ('{"max_concurrency":2.0}', "INVALID_TYPE", "max_concurrency"),
        ('{"max_concurrency":true}', "INVALID_TYPE", "max_concurrency"),
        ('{"rate":"1"}', "INVALID_TYPE", "rate"),
        ('{"rate":1,"capacity":2}', "UNKNOWN_FIELD", "capacity"),
        ('{"Rate":1}', "FIELD_CASE_MISMATCH", "Rate"),
        ('{"rate":1,"paused":true}', "RESPONSE_ONLY_FIELD", "paused"),
        ('{"name":"q","rate":1}', "RESPONSE_ONLY_FIELD", "name"),
        ('{"rate":1,"rate":2}', "DUPLICATE_KEY", "rate"),
        ("[]", "INVALID_TYPE", None),
        ("", "INVALID_JSON", None),
    ],
)
def test_queue_update_rejections(body: str, code: str, field: str | None) -> None:
    with pytest.raises(DecodeError) as err:
        decode_model(QueueUpdate, body)
    assert err.value.code == code, err.value
    if field is not None:
        assert err.value.field == field, err.value


def test_queue_update_keeps_what_is_left_out() -> None:
    msg = decode_model(QueueUpdate, '{"rate":0}')
    assert (msg.max_concurrency, msg.rate, msg.burst) == (None, 0.0, None)
    assert msg.model_fields_set == {"rate"}


@pytest.mark.parametrize(
    ("body", "code", "field"),
    [
        ("{}", "MISSING_FIELD", "max_concurrency"),  # null removes a cap; it must be said
        ('{"max_concurrency":0}', "NUMBER_OUT_OF_RANGE", "max_concurrency"),
        ('{"max_concurrency":-1}', "NUMBER_OUT_OF_RANGE", "max_concurrency"),  # not "no cap"
        ('{"max_concurrency":100000001}', "NUMBER_OUT_OF_RANGE", "max_concurrency"),
        ('{"max_concurrency":"5"}', "INVALID_TYPE", "max_concurrency"),
        ('{"max_concurrency":1.5}', "INVALID_TYPE", "max_concurrency"),
        ('{"max_concurrency":5,"tenant":"t"}', "UNKNOWN_FIELD", "tenant"),
        ('{"Max_Concurrency":5}', "FIELD_CASE_MISMATCH", "Max_Concurrency"),
    ],
)
def test_limit_set_rejections(body: str, code: str, field: str | None) -> None:
    with pytest.raises(DecodeError) as err:
        decode_model(LimitSet, body)
    assert err.value.code == code, err.value
    if field is not None:
        assert err.value.field == field, err.value


def test_limit_set_null_removes_the_cap() -> None:
    assert decode_model(LimitSet, '{"max_concurrency":null}').max_concurrency is None
    assert decode_model(LimitSet, '{"max_concurrency":7}').max_concurrency == 7


@pytest.mark.parametrize("model", [QueueCreate, QueueUpdate])
def test_a_rate_below_the_bound_is_refused_alike_at_create_and_update(model: type) -> None:
    """Create and update name the field and the one bound (MIN_RATE): a positive rate
    below it was taken, down to 5e-324, whose refill interval overflows."""
    body = '{"name":"q","max_concurrency":1,"rate":5e-324}'
    if model is QueueUpdate:
        body = '{"rate":5e-324}'
    with pytest.raises(DecodeError) as err:
        decode_model(model, body)
    assert (err.value.code, err.value.field) == ("NUMBER_OUT_OF_RANGE", "rate"), err.value
    assert "0 (unlimited) or from 0.000001 to 1000000" in err.value.message, err.value
    slowest = '{"name":"q","max_concurrency":1,"rate":0.000001}'
    assert decode_model(model, slowest if model is QueueCreate else '{"rate":1e-6}').rate == 1e-6
