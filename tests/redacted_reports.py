"""A pytest plugin: no secret in a test's report. A failing test's long traceback shows
the arguments of every frame in it, and its captured output is printed with it: a CI
run printed a worker token that way, as websockets' ``handshake(additional_headers=
{'Authorization': 'Bearer orbit_…'})`` in the traceback of a timed-out upgrade. Each
failed report's traceback and captured sections, and every warning's message (an
exception a thread raised is one, with its traceback), pass through ``orbit.logs.redact``,
the redaction Orbit's own logs use, and through ``CUT``.

Loaded whole by ``tests/conftest.py`` (``pytest_plugins``);
``tests/unit/test_redacted_reports.py`` runs failing tests with and without it."""

from __future__ import annotations

import re
import warnings
from collections.abc import Generator
from typing import Any

import pytest

from orbit.logs import redact

#: what pytest's ``saferepr`` leaves of a token when it cuts an argument longer than 240
#: characters in the middle: after its "...", the token's tail, which may have lost the
#: ``orbit_<id>_`` that ``redact`` knows it by
CUT = re.compile(r"\.\.\.[A-Za-z0-9_\-]{8,}")


def redacted(text: str) -> str:
    return CUT.sub("...[redacted]", redact(text))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if not report.failed:
        return
    if report.longrepr is not None:
        text = str(report.longrepr)
        cleaned = redacted(text)
        if cleaned != text:  # as text: the summary line then goes without its message
            report.longrepr = cleaned
    report.sections = [(title, redacted(content)) for title, content in report.sections]


@pytest.hookimpl(tryfirst=True)  # before the terminal's summary and xdist's sending read it
def pytest_warning_recorded(warning_message: warnings.WarningMessage) -> None:
    text = str(warning_message.message)
    cleaned = redacted(text)
    if cleaned != text:
        try:
            warning_message.message = warning_message.category(cleaned)
        except Exception:  # a category built otherwise: the text alone
            warning_message.message = cleaned  # type: ignore[assignment]
