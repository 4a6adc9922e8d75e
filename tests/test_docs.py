"""The user's documents: README.md stays within 300 lines and its first screen names every draft kind of the
registry; every relative link in README.md, docs/ and experiments/README.md reaches a file of the repository."""
from __future__ import annotations

import re
from pathlib import Path

from specdistill.kinds import KIND_NAMES, kind

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FIRST_SCREEN = 40  # lines
LINK = re.compile(r"\]\((?P<target>[^)\s#]+)(?:#[^)]*)?\)")


def kinds_missing(text: str) -> list[str]:
    """The kinds of the registry whose `draft.kind` name (in backticks) or label the text does not name."""
    missing = []
    for name in KIND_NAMES:
        k = kind(name)
        missing += [f"{name}: {word}" for word in (f"`{k.NAME}`", k.LABEL) if word not in text]
    return missing


def broken_links(text: str, base: Path) -> list[str]:
    """Relative links of a markdown text (read from `base`) that reach no file or folder."""
    return [m["target"] for m in LINK.finditer(text)
            if "://" not in m["target"] and not (base / m["target"]).exists()]


def test_readme_first_screen_names_every_kind():
    assert len(README.read_text().splitlines()) <= 300
    first_screen = "\n".join(README.read_text().splitlines()[:FIRST_SCREEN])
    assert kinds_missing(first_screen) == []
    assert kinds_missing(first_screen.replace("Medusa", "the fourth kind")) == ["medusa: Medusa"]
    assert kinds_missing(first_screen.replace("`draft_lm`", "draft_lm")) == ["draft_lm: `draft_lm`"]


def test_every_relative_link_reaches_a_file():
    documents = [README, ROOT / "experiments" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for path in documents:
        assert broken_links(path.read_text(), path.parent) == [], path
    assert broken_links("see [the metrics](docs/METRICS.md) and [gone](docs/GONE.md#top)", ROOT) == ["docs/GONE.md"]
