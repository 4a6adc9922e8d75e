"""Checkpoints: checkpoints/<run>/step-XXXXXXX/ written as a temp dir, renamed once COMPLETE is in.

Layout (docs/DESIGN.md): draft.safetensors (the draft's own weights), draft_config.json,
metrics.json, ds/ (DeepSpeed state for resume), COMPLETE (last).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch.distributed as dist

from specdistill import layout

DS_TAG = "state"


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = layout.checkpoints(run_dir)
    return found[-1] if found else None


def checkpoint_step(step_dir: Path) -> int:
    return int(layout.STEP_DIR.match(step_dir.name).group(1))


def save_checkpoint(run_dir: Path, step: int, engine, own_state: dict, draft_config: dict, metrics: dict,
                    rank: int) -> Path:
    """Collective: every rank calls it (DeepSpeed saves its shard of the state); rank 0 writes the rest."""
    from safetensors.torch import save_file

    final = layout.step_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    engine.save_checkpoint(str(tmp / "ds"), tag=DS_TAG)
    _barrier()
    if rank == 0:
        save_file({k: v.cpu() for k, v in own_state.items()}, str(tmp / "draft.safetensors"))
        _write_json(tmp / "draft_config.json", draft_config)
        _write_json(tmp / "metrics.json", metrics)
        (tmp / "COMPLETE").write_text(f"{step}\n")
        if final.exists():  # an incomplete leftover of a crashed run
            shutil.rmtree(final)
        os.replace(tmp, final)
    _barrier()
    return final


def load_ds_state(engine, step_dir: Path) -> None:
    engine.load_checkpoint(str(step_dir / "ds"), tag=DS_TAG)
