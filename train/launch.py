"""`specdistill train --recipe R`: write the DeepSpeed config, then train.

One process (num_gpus 1, one node, no hostfile) runs in-process, saving the launcher's start-up;
otherwise the DeepSpeed launcher starts `specdistill.train.loop` once per process. Both run the
same `loop.train`. The resolved recipe and the DeepSpeed config are written beside the checkpoints.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from specdistill import layout
from specdistill.errors import SpecdistillError
from specdistill.recipe import recipe_dump
from specdistill.train.ds_config import build_ds_config


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_run_files(recipe) -> Path:
    """train_recipe.yaml (what every process loads) and ds_config.json (for reading); returns the recipe."""
    run_dir = recipe.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    world = recipe.train.num_gpus * recipe.train.num_nodes
    _write_atomic(run_dir / "ds_config.json", json.dumps(build_ds_config(recipe.train, world), indent=1))
    resolved = run_dir / "train_recipe.yaml"
    _write_atomic(resolved, yaml.safe_dump(recipe_dump(recipe), sort_keys=False))
    return resolved


def launcher_command(recipe, resolved: Path, stop_after: int | None = None) -> list[str]:
    tc = recipe.train
    exe = Path(sys.executable).with_name("deepspeed")
    cmd = [str(exe) if exe.exists() else "deepspeed", "--num_gpus", str(tc.num_gpus)]
    if tc.num_nodes > 1:
        cmd += ["--num_nodes", str(tc.num_nodes)]
    if tc.hostfile:
        if not Path(tc.hostfile).is_file():
            raise SpecdistillError(f"train.hostfile {tc.hostfile}: no such file")
        cmd += ["--hostfile", tc.hostfile]
    from specdistill.train.loop import _free_port

    cmd += ["--master_port", str(_free_port()), "--module", "specdistill.train.loop", "--recipe", str(resolved)]
    if stop_after is not None:
        cmd += ["--stop_after", str(stop_after)]
    return cmd


def in_process(recipe) -> bool:
    tc = recipe.train
    return tc.num_gpus == 1 and tc.num_nodes == 1 and not tc.hostfile


def run(recipe, args=None, stop_after: int | None = None):
    cache = layout.cache_dir(recipe.run_dir)
    if not (cache / "manifest.json").exists():
        raise SpecdistillError(f"{cache}: no cache; run `specdistill cache --recipe {recipe.source}` first")
    resolved = write_run_files(recipe)
    if in_process(recipe):
        from specdistill.train.loop import train

        history = train(recipe, stop_after=stop_after)
    else:
        env = dict(os.environ)
        if not _has_gpu():
            env.setdefault("DS_ACCELERATOR", "cpu")
        done = subprocess.run(launcher_command(recipe, resolved, stop_after), env=env)
        if done.returncode != 0:
            raise SpecdistillError(f"train: the DeepSpeed launcher exited with status {done.returncode} "
                                   f"(see the messages above); checkpoints so far are in {recipe.run_dir}")
        history = None
    last = layout.checkpoints(recipe.run_dir)
    if last:
        held = json.loads((last[-1] / "metrics.json").read_text()).get("heldout", {})
        alpha = held.get("predicted_alpha")
        print(f"train: last checkpoint {last[-1]}"
              + (f"; held-out predicted_alpha {alpha:.4f}, top1 {held['top1']:.4f}, fkl {held['fkl']:.4f}"
                 if alpha is not None else ""), flush=True)
    return history


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()
