"""`specdistill eval` over several GPUs of a node: the selected checkpoints split between processes, one per GPU.

With `device` CUDA without an index and more than one GPU visible (or `eval.processes: N`), `evaluate.run` hands
the checkpoints here: they are dealt round robin in step order (`assign`), and each share is evaluated by its own
process (`python -m specdistill.eval.spread_worker`, the serial eval over `--checkpoint <its steps, comma-joined>`
with eval.processes=1), which sees one GPU (CUDA_VISIBLE_DEVICES=<that GPU>) and writes the same per-checkpoint
eval JSON as a serial eval. The processes get the environment of specdistill/processes.py (the CPU's cores
shared between them), honour SPECDISTILL_STRICT_DEVICE and refuse a target larger than one GPU as the serial
eval does. Each process loads its own target and computes its own float32 reference at T=0 (the lossless check),
so every GPU holds a copy of both (docs/GPU.md). The comparators run with the run's last checkpoint only, in
whichever process has it (`--comparators-with`), as the serial eval runs them.
The parent waits, stops the others when one fails (one line naming it, its GPU and its log), then prints every
checkpoint's summary lines in step order.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from specdistill import device as devices
from specdistill import layout
from specdistill.errors import SpecdistillError
from specdistill.eval.tables import summary_lines
from specdistill.formats import read_eval, write_yaml
from specdistill.processes import last_error, process_env
from specdistill.recipe import recipe_dump

WORKER = "specdistill.eval.spread_worker"


def visible_gpus() -> list[str]:
    """The GPUs this process sees, as a child's CUDA_VISIBLE_DEVICES must name them (this process's own list,
    else 0..count-1)."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    listed = [g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    return listed[:count] if listed else [str(i) for i in range(count)]


def process_count(recipe, device: torch.device, checkpoints: int) -> int:
    """How many eval processes: eval.processes (auto: one per visible GPU when `device` is CUDA without an index,
    else 1), never more than there are checkpoints."""
    wanted, on_cuda = recipe.eval.processes, torch.device(device).type == "cuda"
    if wanted == "auto":
        wanted = len(visible_gpus()) if on_cuda and not devices.names_one_gpu(recipe.device) else 1
    elif wanted > 1 and on_cuda:
        if devices.names_one_gpu(recipe.device):
            raise SpecdistillError(f"eval.processes={wanted} with device: {recipe.device}, which names one GPU; use "
                                   "device: cuda (CUDA_VISIBLE_DEVICES chooses the GPUs) or eval.processes=1")
        if wanted > len(visible_gpus()):
            raise SpecdistillError(f"eval.processes={wanted}, but this process sees {len(visible_gpus())} GPU(s): "
                                   "one eval process per GPU")
    return max(1, min(wanted, checkpoints))


def assign(steps: list[Path], processes: int) -> list[list[Path]]:
    """Process i's checkpoints: every processes-th one from the i-th, in step order (each once; shares differ by
    at most one checkpoint)."""
    return [steps[i::processes] for i in range(processes)]


def worker_command(resolved: Path, share: list[Path], last: Path) -> list[str]:
    return [sys.executable, "-m", WORKER, "--recipe", str(resolved), "--checkpoint", ",".join(p.name for p in share),
            "--comparators-with", last.name, "eval.processes=1"]


def spread(recipe, steps: list[Path], processes: int, device: torch.device, runtime: str) -> list[Path]:
    """Evaluate `steps` in `processes` processes (one per GPU on CUDA); the eval JSONs written, in step order."""
    shares = assign(steps, processes)
    on_cuda = torch.device(device).type == "cuda"
    gpus = visible_gpus() if on_cuda else [None] * processes
    logs = recipe.run_dir / "eval-processes"
    logs.mkdir(parents=True, exist_ok=True)
    resolved = logs / "eval_recipe.yaml"  # what every process loads: this recipe, its run folder pinned
    write_yaml(resolved, {**recipe_dump(recipe), "output_dir": str(recipe.output_root)})
    procs = []
    try:
        for i, share in enumerate(shares):
            env = process_env(device, processes)
            if on_cuda:
                env["CUDA_VISIBLE_DEVICES"] = gpus[i]
            where = f"GPU {gpus[i]}" if on_cuda else "cpu"
            log = logs / f"process-{i}.log"
            print(f"eval process {i} ({where}): {', '.join(p.name for p in share)}; log {log}", flush=True)
            with open(log, "w") as fh:
                procs.append((i, where, log, subprocess.Popen(worker_command(resolved, share, steps[-1]), env=env,
                                                              stdout=fh, stderr=subprocess.STDOUT)))
        wait(procs)
    finally:
        for _, _, _, p in procs:  # stopped early (a failed process, an interrupt): the others go too
            if p.poll() is None:
                p.terminate()
                p.wait()
    written = [layout.eval_result(recipe.run_dir, step.name, recipe.eval, runtime) for step in steps]
    for out in written:
        for line in summary_lines(read_eval(out)):
            print(line, flush=True)
    return written


def wait(procs: list[tuple]) -> None:
    """Until every process has exited; the first to fail stops the wait with one line naming it."""
    running = list(procs)
    while running:
        for entry in list(running):
            i, where, log, p = entry
            if p.poll() is None:
                continue
            running.remove(entry)
            if p.returncode != 0:
                raise SpecdistillError(f"eval process {i} ({where}) exited with status {p.returncode}: "
                                       f"{last_error(log)} (log {log})")
        if running:
            time.sleep(0.5)
