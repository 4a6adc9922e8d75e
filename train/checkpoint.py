"""Checkpoints: checkpoints/<run>/step-XXXXXXX/ written as a temp dir, renamed once COMPLETE is in.

Layout (docs/DESIGN.md): draft.safetensors (the draft's own weights), draft_config.json,
metrics.json, ds/ (DeepSpeed state for resume), COMPLETE (last).

Housekeeping after each save: with `train.keep_last N` only the N newest checkpoints keep ds/ (older
ones keep weights and metrics); `best` links to the checkpoint with the best held-out
`train.best_metric` (lowest for divergences and losses, highest otherwise).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch.distributed as dist

from specdistill import faults, integrity, layout
from specdistill.errors import SpecdistillError
from specdistill.formats import read_metrics, write_checkpoint, write_json_atomic

DS_TAG = "state"


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = layout.checkpoints(run_dir)
    return found[-1] if found else None


def save_checkpoint(run_dir: Path, step: int, ds_engine, own_state: dict, draft_config: dict, metrics: dict,
                    rank: int) -> Path:
    """Collective: every rank calls it (DeepSpeed saves its shard of the state); rank 0 writes the rest."""
    final = layout.step_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    try:
        faults.point("checkpoint", step, rank)  # fault suite: the disk fills up here
        ds_engine.save_checkpoint(str(tmp / "ds"), tag=DS_TAG)
        _barrier()
        faults.point("checkpoint-write", step, rank)  # fault suite: a kill with half a checkpoint written
        if rank == 0:
            write_checkpoint(tmp, own_state, draft_config, metrics)
            faults.point("checkpoint-rename", step, rank)  # fault suite: a kill between the write and the rename
            if final.exists():  # an incomplete leftover of a crashed run
                shutil.rmtree(final)
            os.replace(tmp, final)
    except Exception as e:  # disk full: OSError, or wrapped by the writer (torch.save: RuntimeError)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        last = latest_checkpoint(run_dir)
        raise SpecdistillError(faults.write_failed(
            final, e, f"the last complete checkpoint is {last.name if last else 'none'}; rerun `specdistill train` "
                      f"once there is room: it resumes from there")) from None
    _barrier()
    return final


def load_ds_state(ds_engine, step_dir: Path) -> None:
    """Resume from a checkpoint whose files (DeepSpeed state included) match their checksums."""
    integrity.check_checkpoint(step_dir)
    ds_engine.load_checkpoint(str(step_dir / "ds"), tag=DS_TAG)


LOWER_IS_BETTER = ("fkl", "rkl", "jsd", "tvd", "loss", "kl", "nll", "ce", "perplexity")


def lower_is_better(metric: str) -> bool:
    name = metric.lower()
    return any(name == k or name.endswith("_" + k) or name.startswith(k + "_") for k in LOWER_IS_BETTER)


def drop_old_optimizer_state(run_dir: Path, keep_last: int | None) -> list[Path]:
    """Remove ds/ from all but the keep_last newest complete checkpoints; returns the checkpoints thinned."""
    if not keep_last:
        return []
    thinned = []
    for step_dir in layout.checkpoints(run_dir)[:-keep_last]:
        if (step_dir / "ds").exists():
            shutil.rmtree(step_dir / "ds")
            thinned.append(step_dir)
    return thinned


def best_checkpoint(run_dir: Path, metric: str) -> tuple[Path, float] | None:
    """(checkpoint, value) with the best held-out `metric`; ties go to the later checkpoint. None without values."""
    best = None
    lower = lower_is_better(metric)
    for step_dir in layout.checkpoints(run_dir):
        try:
            value = (read_metrics(step_dir) or {}).get("heldout", {}).get(metric)
        except SpecdistillError:
            continue
        if not isinstance(value, (int, float)) or value != value:
            continue
        if best is None or (value <= best[1] if lower else value >= best[1]):
            best = (step_dir, float(value))
    return best


def link_best(run_dir: Path, metric: str) -> tuple[Path, float] | None:
    """Point run_dir/best at the best checkpoint (a relative link, replaced atomically)."""
    best = best_checkpoint(run_dir, metric)
    link = layout.best_link(run_dir)
    if best is None:
        return None
    tmp = link.with_name(f".best.tmp-{os.getpid()}")
    if tmp.is_symlink():
        tmp.unlink()
    tmp.symlink_to(best[0].name, target_is_directory=True)
    os.replace(tmp, link)
    write_json_atomic(run_dir / "best.json", {"checkpoint": best[0].name, "metric": f"heldout.{metric}", "value": best[1],
                                        "rule": "lowest" if lower_is_better(metric) else "highest"})
    return best


def housekeeping(run_dir: Path, keep_last: int | None, metric: str) -> str:
    """After a save (rank 0): thin old optimizer state, relink `best`; returns a line saying what it did."""
    thinned = drop_old_optimizer_state(run_dir, keep_last)
    best = link_best(run_dir, metric)
    parts = []
    if best is not None:
        rule = "lowest" if lower_is_better(metric) else "highest"
        parts.append(f"best: {best[0].name} ({rule} held-out {metric} = {best[1]:.4f})")
    else:
        parts.append(f"best: none (no checkpoint has a held-out {metric})")
    if thinned:
        parts.append(f"optimizer state dropped from {', '.join(p.name for p in thinned)} (train.keep_last={keep_last})")
    return "; ".join(parts)
