"""Where a run's outputs live: checkpoints/<run_name>/... One place, so every stage agrees."""
from __future__ import annotations

import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
STEP_DIR = re.compile(r"^step-(\d{7})$")


def corpus_dir(run_dir: Path) -> Path:
    """Prepared corpus: a datasets.DatasetDict (splits train, heldout) saved with save_to_disk."""
    return run_dir / "corpus"


def cache_dir(run_dir: Path) -> Path:
    """Target outputs: <split>/shard-NNNNN.safetensors plus manifest.json. A link into the shared cache
    directory (`shared_cache_root`), or a real directory for runs cached before caches were shared."""
    return run_dir / "cache"


def shared_cache_root(recipe) -> Path:
    """Caches shared by runs, one folder per fingerprint key: cache.dir, else <output_dir>/shared-cache."""
    return Path(recipe.cache.dir).expanduser() if recipe.cache.dir else recipe.output_root / "shared-cache"


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / f"step-{step:07d}"


def step_of(step_dir: Path) -> int:
    """The step a checkpoint directory `step-XXXXXXX` holds."""
    return int(STEP_DIR.match(Path(step_dir).name).group(1))


def parse_step(name: str) -> int | None:
    """A checkpoint named by the user: `step-N`, `step-000000N` or `N` -> N; None if it is none of those."""
    digits = name.removeprefix("step-")
    return int(digits) if digits.isdigit() else None


def checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints (those with a COMPLETE marker), oldest first."""
    found = [p for p in run_dir.glob("step-*") if STEP_DIR.match(p.name) and (p / "COMPLETE").exists()]
    return sorted(found, key=step_of)


def best_link(run_dir: Path) -> Path:
    """A link to the checkpoint with the best held-out train.best_metric (train/checkpoint.py)."""
    return run_dir / "best"


def eval_dir(run_dir: Path) -> Path:
    return run_dir / "eval"


def tb_dir(run_dir: Path) -> Path:
    return run_dir / "tb"


def export_dir(run_dir: Path, fmt: str) -> Path:
    return run_dir / "export" / fmt
