"""Every ``orbit`` command's ``--help`` at 80 and 120 columns, as a terminal shows it:
prose reflowed, examples in their columns. Typer's rich help (0.16 on) keeps a
docstring's hard line breaks and then wraps each line again, so ``orbit worker --help``
at 80 columns was ragged ("... drains on" / "SIGTERM ..."), and its examples ran past
the width, their ends wrapped to the left margin."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import pairwise
from typing import Any

import pytest
import typer.main
from typer.testing import CliRunner

from orbit.cli.main import app

#: the columns rich leaves a help's text (a space each side)
MARGIN = 1


def _paths(command: Any, path: list[str]) -> Iterator[list[str]]:
    """Every command and group under ``command``, as the words that name it."""
    yield path
    for name, sub in getattr(command, "commands", {}).items():
        yield from _paths(sub, [*path, name])


COMMANDS = list(_paths(typer.main.get_command(app), []))


def _description(path: list[str], width: int) -> list[str]:
    """The help's text between its usage line and its first box, right-stripped."""
    ran = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": str(width)})
    assert ran.exit_code == 0, ran.output
    lines = ran.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("Usage:"))
    end = next((i for i, line in enumerate(lines) if line.lstrip().startswith("╭")), len(lines))
    return [line.rstrip() for line in lines[start + 1 : end]]


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def layout_faults(lines: list[str], width: int) -> list[str]:
    """The lines of a help's text that a re-wrap broke: a prose line (at the margin)
    followed by another whose first word would have fitted on it, which a terminal's
    wrap never leaves, only a hard line break kept; and a line at the margin right under
    an indented one (an example), which is that example's end, wrapped."""
    faults = []
    for above, below in pairwise(lines):
        if not above.strip() or not below.strip():
            continue
        if _indent(above) == _indent(below) == MARGIN:
            if len(above) + 1 + len(below.split()[0]) <= width - MARGIN:
                faults.append(f"ragged: {above.strip()!r} then {below.strip()!r}")
        elif _indent(above) > MARGIN and _indent(below) == MARGIN:
            faults.append(f"wrapped example: {above.strip()!r} then {below.strip()!r}")
    return faults


@pytest.mark.parametrize("width", [80, 120])
def test_no_help_is_ragged_or_wraps_an_example(width: int) -> None:
    faults = {
        " ".join(["orbit", *path]): found
        for path in COMMANDS
        if (found := layout_faults(_description(path, width), width))
    }
    assert faults == {}


def test_the_walk_reaches_every_command() -> None:
    """The test above cannot pass by checking nothing: the groups' commands are there."""
    assert ["worker"] in COMMANDS and ["db", "migrate"] in COMMANDS
    assert ["schedule", "create"] in COMMANDS and len(COMMANDS) > 30


def test_the_check_finds_a_ragged_paragraph_and_a_wrapped_example() -> None:
    ragged = [" A running worker drains on", " SIGTERM or SIGINT: no new claims"]
    wrapped = ["   orbit worker ls     list every worker session (expired ones", " stay)"]
    assert layout_faults(ragged, 80) and layout_faults(wrapped, 80)
    full = [" " + "word " * 15 + "wordy", " words that would not fit above"]
    assert layout_faults(full, 80) == []


def test_worker_examples_keep_their_columns_at_80() -> None:
    lines = _description(["worker"], 80)
    examples = [line for line in lines if line.lstrip().startswith("orbit worker ")]
    assert len(examples) == 3
    # each example's words start in the same column: "run", "list", "stop"
    columns = {line.rindex("  ") + 2 for line in examples}
    assert len(columns) == 1, examples
