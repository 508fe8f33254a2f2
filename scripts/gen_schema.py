"""Generate schema/: the JSON Schema of every message and the OpenAPI document.

    python scripts/gen_schema.py           # (re)write schema/
    python scripts/gen_schema.py --check   # exit 1 listing every drifted, missing or stale file

Every file comes from the code: ``orbit.protocol.schema.schemas()`` gives one JSON Schema
per HTTP body and worker message, and the server's ``app.openapi()`` gives
``openapi.json``. Output is deterministic (sorted keys, two-space indent, one trailing
newline). Files in schema/ that the code no longer generates are removed (or, with
``--check``, reported as stale). ``tests/unit/test_schema_current.py`` fails when the
committed directory differs from what this script produces.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a plain script from any directory
    sys.path.insert(0, str(ROOT))

from orbit.protocol.schema import render, schemas  # noqa: E402
from orbit.server.app import ServerSettings, create_app  # noqa: E402

SCHEMA_DIR = ROOT / "schema"
OPENAPI_NAME = "openapi.json"
#: Building the app opens nothing: the store is opened by the lifespan, which never runs.
UNUSED_DB_URL = "sqlite:///unused.db"


def openapi() -> dict[str, Any]:
    """The server's OpenAPI document, exactly as FastAPI serves it at /openapi.json."""
    app = create_app(ServerSettings(db_url=UNUSED_DB_URL))
    return app.openapi()


def generate() -> dict[str, str]:
    """``{file name: file text}`` for everything that belongs in schema/."""
    docs: dict[str, Any] = dict(schemas())
    if OPENAPI_NAME in docs:
        raise RuntimeError(f"a message schema may not be named {OPENAPI_NAME}")
    docs[OPENAPI_NAME] = openapi()
    return {name: render(doc) for name, doc in sorted(docs.items())}


def _existing(directory: Path) -> dict[str, Path]:
    """The files currently in ``directory`` (not recursive; dotfiles ignored)."""
    if not directory.is_dir():
        return {}
    return {
        p.name: p for p in sorted(directory.iterdir()) if p.is_file() and not p.name.startswith(".")
    }


def problems(directory: Path = SCHEMA_DIR) -> list[str]:
    """One line per file that differs from the code: drifted, missing or stale."""
    expected = generate()
    present = _existing(directory)
    out: list[str] = []
    for name, text in expected.items():
        path = present.get(name)
        if path is None:
            out.append(f"missing: {directory / name}")
        elif path.read_bytes() != text.encode("utf-8"):
            out.append(f"drifted: {directory / name}")
    for name in sorted(set(present) - set(expected)):
        out.append(f"stale:   {directory / name}")
    return out


def write(directory: Path = SCHEMA_DIR) -> list[str]:
    """Bring ``directory`` up to date; return one line per file written or removed."""
    expected = generate()
    directory.mkdir(parents=True, exist_ok=True)
    present = _existing(directory)
    changes: list[str] = []
    for name, text in expected.items():
        data = text.encode("utf-8")
        path = directory / name
        if name in present and path.read_bytes() == data:
            continue
        path.write_bytes(data)
        changes.append(f"{'updated' if name in present else 'created'}: {path}")
    for name in sorted(set(present) - set(expected)):
        present[name].unlink()
        changes.append(f"removed: {present[name]}")
    return changes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--check",
        action="store_true",
        help="do not write; exit 1 listing every file that differs from the code",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=SCHEMA_DIR,
        help=f"directory to write (default {SCHEMA_DIR})",
    )
    args = parser.parse_args(argv)
    directory: Path = args.output
    if args.check:
        found = problems(directory)
        if found:
            for line in found:
                print(line, file=sys.stderr)
            print("Run `python scripts/gen_schema.py` and commit the result.", file=sys.stderr)
            return 1
        print(f"{directory} is up to date ({len(generate())} files)")
        return 0
    changes = write(directory)
    for line in changes:
        print(line)
    if not changes:
        print(f"unchanged: {directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
