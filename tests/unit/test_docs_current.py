"""docs/state-machine.md is generated from orbit.core.states and must match the code."""

from __future__ import annotations

from pathlib import Path

from orbit.core.states import TRANSITIONS, TaskState
from scripts.gen_docs import DOC_PATH, check, main, render


def test_state_machine_doc_matches_the_transition_table() -> None:
    problem = check(DOC_PATH)
    assert problem is None, f"{problem}\nRun `python scripts/gen_docs.py` and commit the result."


def test_every_transition_is_drawn() -> None:
    text = render()
    for t in TRANSITIONS:
        for source in [str(s) for s in t.task_from] or ["[*]"]:
            edge = f"    {source} --> {t.task_to} : "
            line = next((ln for ln in text.splitlines() if ln.startswith(edge)), None)
            assert line is not None, f"no edge {source} -> {t.task_to}"
            assert t.operation in line
    for state in TaskState:
        assert f"`{state}`" in text


def test_check_flags_a_stale_file(tmp_path: Path) -> None:
    target = tmp_path / "state-machine.md"
    assert main(["--check", "--output", str(target)]) == 1  # missing
    assert main(["--output", str(target)]) == 0
    assert main(["--check", "--output", str(target)]) == 0
    target.write_text(render().replace("cancelling", "canceling"), encoding="utf-8")
    assert main(["--check", "--output", str(target)]) == 1
