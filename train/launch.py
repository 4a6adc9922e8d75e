"""`specdistill train --recipe R`: write the DeepSpeed config, then train.

One process (num_gpus 1, one node, no hostfile) runs in-process, saving the launcher's start-up;
otherwise the DeepSpeed launcher starts `specdistill.train.loop` once per process. Both run the
same `loop.train`. The resolved recipe and the DeepSpeed config are written beside the checkpoints.
The recipe's `device` sets DeepSpeed's accelerator and the processes' environment (specdistill/processes.py).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from specdistill import device as devices
from specdistill import integrity, layout
from specdistill.errors import SpecdistillError
from specdistill.formats import read_manifest, read_metrics, read_yaml, write_json_atomic, write_yaml
from specdistill.processes import launcher_command, launcher_port, process_env, remove_shm_buffers, use_accelerator
from specdistill.recipe import recipe_dump
from specdistill.train import preemption
from specdistill.train.ds_config import build_ds_config
from specdistill.train.loop import train


def write_run_files(recipe) -> Path:
    """train_recipe.yaml (what every process loads) and ds_config.json (for reading); returns the recipe."""
    run_dir = recipe.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    world = recipe.train.num_gpus * recipe.train.num_nodes
    write_json_atomic(run_dir / "ds_config.json", build_ds_config(recipe.train, world))
    resolved = run_dir / "train_recipe.yaml"
    write_yaml(resolved, recipe_dump(recipe))
    return resolved


def train_command(recipe, resolved: Path, stop_after: int | None = None) -> list[str]:
    tc = recipe.train
    args = ["--recipe", str(resolved)] + (["--stop_after", str(stop_after)] if stop_after is not None else [])
    return launcher_command("specdistill.train.loop", args, tc.num_gpus, tc.num_nodes, tc.hostfile)


def in_process(recipe) -> bool:
    tc = recipe.train
    return tc.num_gpus == 1 and tc.num_nodes == 1 and not tc.hostfile


# Keys that may change between a run and its resumption: they do not change what the checkpoints so far
# were trained on (how long to go on, how often to save/log, where outputs go, how runs are compared).
RESUMABLE_CHANGES = ("run_name", "output_dir", "device", "cache.dir", "cache.mode", "cache.verify", "eval", "export", "train.max_steps",
                     "train.save_every", "train.log_every", "train.heldout_batches", "train.keep_last",
                     "train.best_metric", "train.report_to", "train.num_gpus", "train.num_nodes", "train.hostfile")


def _flat(tree, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and not key.startswith(("loss.terms", "corpus.columns", "corpus.chat_template_kwargs")):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def changed_settings(recipe, saved: dict) -> list[str]:
    """Keys whose value differs from the run's train_recipe.yaml (keys that file lacks, added since, are not compared)."""
    now, before = _flat(recipe_dump(recipe)), _flat(saved)
    allowed = lambda k: any(k == a or k.startswith(a + ".") for a in RESUMABLE_CHANGES)
    return [f"{k}: {before[k]!r} -> {now.get(k)!r}" for k in sorted(before)
            if not allowed(k) and k in now and json.dumps(now[k], sort_keys=True) != json.dumps(before[k], sort_keys=True)]


def check_rerun(recipe) -> None:
    """A run with checkpoints resumes only under the settings it was trained with."""
    resolved = recipe.run_dir / "train_recipe.yaml"
    if not layout.checkpoints(recipe.run_dir) or not resolved.exists():
        return
    diff = changed_settings(recipe, read_yaml(resolved) or {})
    if diff:
        raise SpecdistillError(f"{recipe.run_dir} holds checkpoints trained with other settings ({'; '.join(diff)}); "
                               f"resuming would mix them: use another run_name, or pass --restart to start this run over")


def restart(run_dir: Path) -> None:
    """--restart: remove what training and the stages after it wrote (checkpoints, logs, best, eval, report, export);
    the prepared corpus and the cache stay."""
    for p in list(run_dir.glob("step-*")) + [layout.tb_dir(run_dir), layout.eval_dir(run_dir), run_dir / "export"]:
        shutil.rmtree(p, ignore_errors=True)
    for name in ("train_log.jsonl", "best.json", "report.md", "train_recipe.yaml"):
        (run_dir / name).unlink(missing_ok=True)
    layout.replay_path(run_dir).unlink(missing_ok=True)  # drafted by the head training started from
    if layout.best_link(run_dir).is_symlink():
        layout.best_link(run_dir).unlink()
    print(f"--restart: removed the checkpoints, logs and results of {run_dir}; training from step 0", flush=True)


def run(recipe, args=None, stop_after: int | None = None):
    tc = recipe.train
    if not in_process(recipe):  # before anything runs: a recipe that cannot be honoured stops with one line
        devices.refuse_one_gpu_for_ranks(recipe.device, f"train.num_gpus {tc.num_gpus} x train.num_nodes {tc.num_nodes}"
                                         + (f" (train.hostfile {tc.hostfile})" if tc.hostfile else ""))
    cache = layout.cache_dir(recipe.run_dir)
    if not (cache / "manifest.json").exists():
        raise SpecdistillError(f"{cache}: no cache; run `specdistill cache --recipe {recipe.source}` first")
    integrity.check_cache(cache, read_manifest(cache), recipe.cache.verify, recipe.source)  # a corrupt shard stops here
    if getattr(args, "restart", False):
        restart(recipe.run_dir)
    check_rerun(recipe)
    device = devices.resolve(recipe.device)  # `device: cuda` without CUDA stops here, naming the key
    resolved = write_run_files(recipe)
    if in_process(recipe):
        use_accelerator(device)
        history = train(recipe, stop_after=stop_after, device=device)
    else:
        env = process_env(device, recipe.train.num_gpus)
        run_launcher(recipe, train_command(recipe, resolved, stop_after), env)
        history = None
    last = layout.checkpoints(recipe.run_dir)
    if last:
        held = (read_metrics(last[-1]) or {}).get("heldout", {})
        alpha = held.get("predicted_alpha")
        print(f"train: last checkpoint {last[-1]}"
              + (f"; held-out predicted_alpha {alpha:.4f}, top1 {held['top1']:.4f}, fkl {held['fkl']:.4f}"
                 if alpha is not None else ""), flush=True)
    return history


def run_launcher(recipe, cmd: list[str], env: dict) -> int:
    """Run the DeepSpeed launcher in a process group of its own, passing SIGTERM / SIGINT on to all of it, and
    wait for every process of the group; then say how it ended: preempted, a dead rank named, or a failure."""
    run_dir = recipe.run_dir
    preemption.clear_records(run_dir)
    since = time.time()
    child = subprocess.Popen(cmd, env=env, start_new_session=True)

    def forward(signum, frame):
        try:
            os.killpg(child.pid, signum)
        except ProcessLookupError:
            pass

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        returncode = child.wait()
        deadline = time.time() + 60  # the launcher may exit before its ranks have finished saving
        while time.time() < deadline:
            try:
                os.killpg(child.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        remove_shm_buffers(launcher_port(cmd))
    preempted = preemption.was_preempted(run_dir, since)
    if preempted is not None:
        raise preempted
    if returncode == 0:
        return 0
    last = layout.checkpoints(run_dir)
    resume = f"rerun to resume from {last[-1].name}" if last else "no checkpoint was written; rerun to start over"
    dead = preemption.dead_ranks(run_dir, since)
    if dead:
        who = ", ".join(f"rank {d['rank']} (pid {d['pid']} on {d['host']})" for d in dead)
        raise SpecdistillError(f"train: {who} died without a word (killed by a signal or out of memory); "
                               f"the other ranks were stopped; {resume}")
    raise SpecdistillError(f"train: the DeepSpeed launcher exited with status {returncode} "
                           f"(see the messages above); {resume}")
