"""Stopping a training run from outside, and telling afterwards how it stopped.

SIGTERM (a scheduler's preemption notice) sets a flag; at the next step boundary every rank learns it
(one all-reduce of a flag per step), the run saves a checkpoint there, and `specdistill train` exits
with Preempted.EXIT_CODE (75): a preempted job loses at most the step in flight. SIGKILL cannot be
caught; the run resumes from its last complete checkpoint.

Each rank of a multi-process run records itself in <run>/ranks/rank-N.json (pid, host, start) and how
it ended; a rank that ended without a word (killed by a signal, the OOM killer) is the dead one, and
`specdistill train` names it. The DeepSpeed launcher stops the other ranks within about 31 s of a death
(it polls its children every second, then SIGTERM, then SIGKILL after 30 s); with gloo they usually stop
at once, their next collective failing.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from specdistill.errors import Preempted
from specdistill.formats import read_json, write_json_atomic


class StopRequests:
    """While entered, SIGTERM asks the run to stop at the next step boundary instead of killing it."""

    def __init__(self):
        self.signalled = False
        self.previous = None

    def install(self) -> "StopRequests":
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGTERM, self._on_term)
        return self

    def restore(self) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)
            self.previous = None

    def _on_term(self, signum, frame):
        if not self.signalled:
            print("SIGTERM: saving a checkpoint at the end of this step, then stopping", flush=True)
        self.signalled = True

    def requested(self, world: int, device: torch.device) -> bool:
        """Collective: whether any rank was signalled (the flag on the rank's device: NCCL refuses CPU tensors)."""
        flag = torch.tensor([1.0 if self.signalled else 0.0], device=device)
        if world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def stopped(run_dir: Path, checkpoint: Path, rank: int) -> Preempted:
    """The Preempted to raise once `checkpoint` is saved (rank 0 also leaves preempted.json for the launching process)."""
    if rank == 0:
        write_json_atomic(Path(run_dir) / "preempted.json", {"checkpoint": checkpoint.name, "time": time.time()})
    return Preempted(f"preempted (SIGTERM): saved {checkpoint.name}; rerun the same command to resume from it")


def was_preempted(run_dir: Path, since: float) -> Preempted | None:
    path = Path(run_dir) / "preempted.json"
    if not path.is_file():
        return None
    info = read_json(path)
    if info.get("time", 0) < since:
        return None
    return Preempted(f"preempted (SIGTERM): saved {info['checkpoint']}; rerun the same command to resume from it")


# ---- who is running, and how each rank ended ------------------------------------------------------

def ranks_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "ranks"


def record_start(run_dir: Path, rank: int) -> None:
    write_json_atomic(ranks_dir(run_dir) / f"rank-{rank}.json",
                      {"rank": rank, "pid": os.getpid(), "host": socket.gethostname(), "started": time.time()})


def record_end(run_dir: Path, rank: int, how: str) -> None:
    path = ranks_dir(run_dir) / f"rank-{rank}.json"
    try:
        info = read_json(path)
        write_json_atomic(path, {**info, "ended": how})
    except Exception:  # the record is a diagnosis aid: never let it hide the real error
        pass


def clear_records(run_dir: Path) -> None:
    for f in ranks_dir(run_dir).glob("rank-*.json"):
        f.unlink(missing_ok=True)
    (Path(run_dir) / "preempted.json").unlink(missing_ok=True)


def dead_ranks(run_dir: Path, since: float) -> list[dict]:
    """Ranks of the run started after `since` that ended without recording how (killed)."""
    dead = []
    for f in sorted(ranks_dir(run_dir).glob("rank-*.json")):
        try:
            info = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if info.get("started", 0) >= since and "ended" not in info:
            dead.append(info)
    return dead
