"""Which code produced a result: the git commit of the checkout, and a fingerprint of the decoding code.

The commit says where to look; the fingerprint is what a result is keyed on (the report's stale guard), so a
commit that does not touch decoding leaves earlier evals fresh while one that does marks them stale.
"""
from __future__ import annotations

import hashlib
import subprocess

from specdistill.layout import REPO_ROOT

# Everything a decode's tokens, counts and timings depend on besides the weights and the eval settings.
DECODE_CODE = ("eval/engine.py", "specdistill/decoding", "eval/runtime.py", "eval/tree.py", "eval/evaluate.py",
               "specdistill/kinds", "specdistill/target.py")


def git_commit(root=REPO_ROOT) -> str | None:
    """HEAD of the checkout at `root`, with '-dirty' when tracked files differ from it; None outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if dirty else "")


def code_fingerprint(paths=DECODE_CODE, root=REPO_ROOT) -> str:
    """sha256 (12 hex) over the contents of the .py files under `paths` (relative to the checkout at `root`)."""
    h = hashlib.sha256()
    for rel in paths:
        p = root / rel
        for f in sorted(p.rglob("*.py")) if p.is_dir() else [p]:
            if f.is_file():
                h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:12]
