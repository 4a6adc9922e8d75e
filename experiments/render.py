"""README tables rendered from experiment records: `python -m experiments.render` rewrites every block

    <!-- experiment: NAME -->
    | ... the table of experiments/records/NAME.json ... |
    <!-- /experiment: NAME -->

in README.md; `problems(text)` lists every block that differs from its record (tests/test_experiments.py).
"""
from __future__ import annotations

import json
import re
import sys

from experiments.schema import EXPERIMENTS, RECORDS
from specdistill.errors import SpecdistillError

README = EXPERIMENTS.parent / "README.md"
BLOCK = re.compile(r"<!-- experiment: (?P<name>[\w.-]+) -->\n(?P<body>.*?)<!-- /experiment: (?P=name) -->\n", re.S)


def read_record(name: str) -> dict:
    path = RECORDS / f"{name}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SpecdistillError(f"{path}: {e}") from None


def table_markdown(record: dict) -> str:
    """The record's table as markdown, with the provenance line under it."""
    table = record["table"]
    lines = ["| " + " | ".join(table["columns"]) + " |", "|" + "---|" * len(table["columns"])]
    for row in table["rows"]:
        if len(row) != len(table["columns"]):
            raise SpecdistillError(f"record {record['experiment']}: a row has {len(row)} cells for "
                                   f"{len(table['columns'])} columns: {row}")
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    source = f"experiments/{record['experiment']}.yaml"
    lines.append("")
    lines.append(f"<sub>Rendered from `experiments/records/{record['experiment']}.json` ({record['provenance']}); "
                 f"settings pinned in `{source}`; rerun: `{record['command']}`.</sub>")
    return "\n".join(lines) + "\n"


def render(text: str) -> str:
    return BLOCK.sub(lambda m: f"<!-- experiment: {m['name']} -->\n{table_markdown(read_record(m['name']))}"
                               f"<!-- /experiment: {m['name']} -->\n", text)


def problems(text: str) -> list[str]:
    """Blocks whose table differs from their record, records with no block."""
    found, seen = [], set()
    for m in BLOCK.finditer(text):
        seen.add(m["name"])
        want = table_markdown(read_record(m["name"]))
        if m["body"] != want:
            got_lines, want_lines = m["body"].splitlines(), want.splitlines()
            diff = next((f"README: {g!r}\nrecord: {w!r}" for g, w in zip(got_lines, want_lines) if g != w),
                        f"{len(got_lines)} lines in README, {len(want_lines)} in the record")
            found.append(f"README table {m['name']} differs from experiments/records/{m['name']}.json:\n{diff}")
    for path in sorted(RECORDS.glob("*.json")):
        if path.stem not in seen:
            found.append(f"experiments/records/{path.name} has no table in README (<!-- experiment: {path.stem} -->)")
    return found


def main() -> int:
    README.write_text(render(README.read_text()))
    left = problems(README.read_text())
    print("\n".join(left) or f"{README}: every experiment table rendered from its record")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
