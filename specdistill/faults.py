"""Fault injection for the fault suite (tests/test_faults.py), and how a failed write is reported.

SPECDISTILL_FAULT=ACTION:POINT:N[:RANK][,...] makes the process act when it reaches POINT for the N-th
time it is named (a training step, a checkpoint's step, a shard's index), in every rank or in RANK only:
  kill    SIGKILL itself (a crash, an OOM kill, a node lost)
  term    SIGTERM itself (a scheduler's preemption notice)
  enospc  raise OSError(ENOSPC) (a disk that fills up)
Points: `step` (training, after the first backward of step N, before its optimizer step),
`checkpoint-write` (DeepSpeed state written, draft files not yet), `checkpoint-rename` (everything
written, COMPLETE included, before the temp directory is renamed), `shard` (before cache shard N is
written) and `checkpoint` (before checkpoint N's files are written). Unset, `point` costs one lookup.
"""
from __future__ import annotations

import errno
import os
import shutil
import signal
import sys
import time
from pathlib import Path

ENV = "SPECDISTILL_FAULT"
ACTIONS = ("kill", "term", "enospc")


def point(name: str, n: int, rank: int | None = None) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    for item in spec.split(","):
        parts = item.strip().split(":")
        if len(parts) not in (3, 4) or parts[0] not in ACTIONS:
            raise ValueError(f"{ENV}={spec!r}: expected ACTION:POINT:N[:RANK] with ACTION one of {ACTIONS}")
        action, where, at = parts[0], parts[1], int(parts[2])
        if where != name or at != n or (len(parts) == 4 and rank is not None and int(parts[3]) != rank):
            continue
        print(f"{ENV}: {action} at {name}:{n}" + (f" in rank {rank}" if rank is not None else "")
              + f" at t={time.time():.3f}", file=sys.stderr, flush=True)
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "term":
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            raise OSError(errno.ENOSPC, f"No space left on device (injected by {ENV})")


def disk_full(error: BaseException, where: Path) -> bool:
    """Whether a failed write ran out of space. Writers wrap errno in their own exceptions (safetensors: "No space
    left on device (os error 28)"; torch.save: "unexpected pos"), so the free space is asked as well."""
    if getattr(error, "errno", None) == errno.ENOSPC or "No space left" in str(error):
        return True
    try:
        return shutil.disk_usage(Path(where)).free < (1 << 20)
    except OSError:
        return False


def write_failed(what: Path, error: BaseException, rerun: str) -> str:
    """The one line for a write that failed: disk full or not, what was removed, how to go on."""
    if disk_full(error, Path(what).parent):
        free = shutil.disk_usage(Path(what).parent).free if Path(what).parent.exists() else 0
        cause = f"disk full ({free / 2**20:.1f} MiB free)"
    else:
        cause = f"write failed ({str(error).splitlines()[0][:200] if str(error) else type(error).__name__})"
    return f"{what}: {cause}; the partial write was removed; {rerun}"
