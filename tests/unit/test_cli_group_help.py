"""``orbit --help``'s line for each command group that lists what the group does names
the group's real subcommands: ``limit``'s said "list, show, set, remove", which are no
commands of it (they are ``ls``, ``tenant`` and ``global``)."""

from __future__ import annotations

import re

import pytest
import typer.main

from orbit.cli.main import app

#: how a group's help may name a subcommand (``queue``'s "list" for ``ls``)
SAID = {"ls": ("ls", "list")}


def _groups() -> dict[str, typer.core.TyperGroup]:
    root = typer.main.get_group(app)
    return {
        name: command
        for name, command in root.commands.items()
        if isinstance(command, typer.core.TyperGroup)
    }


@pytest.mark.parametrize("group", ["limit", "queue", "task", "schedule", "token"])
def test_a_groups_help_names_its_subcommands(group: str) -> None:
    command = _groups()[group]
    said = re.findall(r"[a-z]+", (command.help or "").lower())
    missing = [
        name
        for name in command.commands
        if not any(spelling in said for spelling in SAID.get(name, (name,)))
    ]
    assert missing == [], (group, command.help)


def test_limit_help_names_no_command_it_lacks() -> None:
    help_text = _groups()["limit"].help or ""
    assert "list, show, set, remove" not in help_text
    assert set(_groups()["limit"].commands) == {"ls", "tenant", "global"}
