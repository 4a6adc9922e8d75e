"""Tables rendered from experiment records: `python -m experiments.render` rewrites every block

    <!-- experiment: NAME -->
    | ... the table of experiments/records/NAME.json ... |
    <!-- /experiment: NAME -->

in README.md (the headline: one current result) and experiments/README.md (every record's table);
`problems()` lists every block that differs from its record and every record without a block in
experiments/README.md (tests/test_experiments.py).
"""
from __future__ import annotations

import json
import re
import sys

from experiments.schema import EXPERIMENTS, RECORDS
from specdistill.errors import SpecdistillError

README = EXPERIMENTS.parent / "README.md"
EXPERIMENTS_README = EXPERIMENTS / "README.md"  # every record has its block here
DOCUMENTS = (README, EXPERIMENTS_README)
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


def block_problems(text: str, where: str) -> list[str]:
    """The blocks of one document (`where`: its name in messages) whose table differs from their record."""
    found = []
    for m in BLOCK.finditer(text):
        want = table_markdown(read_record(m["name"]))
        if m["body"] != want:
            got_lines, want_lines = m["body"].splitlines(), want.splitlines()
            diff = next((f"{where}: {g!r}\nrecord: {w!r}" for g, w in zip(got_lines, want_lines) if g != w),
                        f"{len(got_lines)} lines in {where}, {len(want_lines)} in the record")
            found.append(f"{where} table {m['name']} differs from experiments/records/{m['name']}.json:\n{diff}")
    return found


def problems(readme: str | None = None, experiments_readme: str | None = None) -> list[str]:
    """Blocks of README.md and experiments/README.md whose table differs from their record, and records with
    no block in experiments/README.md. A text not given is read from its file."""
    readme = README.read_text() if readme is None else readme
    experiments_readme = EXPERIMENTS_README.read_text() if experiments_readme is None else experiments_readme
    found = block_problems(readme, "README.md") + block_problems(experiments_readme, "experiments/README.md")
    seen = {m["name"] for m in BLOCK.finditer(experiments_readme)}
    for path in sorted(RECORDS.glob("*.json")):
        if path.stem not in seen:
            found.append(f"experiments/records/{path.name} has no table in experiments/README.md "
                         f"(<!-- experiment: {path.stem} -->)")
    return found


def main() -> int:
    for path in DOCUMENTS:
        path.write_text(render(path.read_text()))
    left = problems()
    print("\n".join(left) or f"{', '.join(str(p) for p in DOCUMENTS)}: every experiment table rendered from its record")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
