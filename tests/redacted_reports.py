"""A pytest plugin: no secret in a test's report. A failing test's long traceback shows
the arguments of every frame in it, and its captured output is printed with it: a CI
run printed a worker token that way, as websockets' ``handshake(additional_headers=
{'Authorization': 'Bearer orbit_…'})`` in the traceback of a timed-out upgrade. Each
failed report's traceback and captured sections pass through ``orbit.logs.redact``, the
redaction Orbit's own logs use.

Loaded by ``tests/conftest.py``; ``tests/unit/test_redacted_reports.py`` runs a failing
test with and without it."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest

from orbit.logs import redact


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if not report.failed:
        return
    if report.longrepr is not None:
        text = str(report.longrepr)
        cleaned = redact(text)
        if cleaned != text:  # as text: the summary line then goes without its message
            report.longrepr = cleaned
    report.sections = [(title, redact(content)) for title, content in report.sections]
