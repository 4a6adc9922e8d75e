"""One run, one writer: `train` and `eval` hold <run>/<stage>.lock while they work on a run.

The lock is an flock on the file (the kernel drops it when its holder dies, however it dies); the file
also says who holds it (pid, host, start), so a second command on the same run stops with one line
naming the holder instead of interleaving writes. A lock file left by a process that is gone is taken
over with a note. On filesystems where flock is not shared between hosts (some NFS set-ups), two hosts
are not kept apart.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path

from specdistill.errors import SpecdistillError


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _describe(holder: dict) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(holder.get("started", 0)))
    return f"pid {holder.get('pid')} on host {holder.get('host')}, started {when}"


@contextmanager
def hold(run_dir: Path, stage: str):
    """Hold <run_dir>/<stage>.lock for the duration, or stop with the holder named."""
    path = Path(run_dir) / f"{stage}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    fh = open(path, "a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        try:
            holder = json.loads(fh.read() or "{}")
        except ValueError:
            holder = {}
        fh.close()
        raise SpecdistillError(f"{Path(run_dir).name}: another `specdistill {stage}` is working on this run "
                               f"({_describe(holder)}; lock {path}); wait for it to finish or use another run_name") from None
    fh.seek(0)
    try:
        previous = json.loads(fh.read() or "{}")
    except ValueError:
        previous = {}
    if previous.get("pid") and previous.get("host") == socket.gethostname() and not _alive(previous["pid"]):
        print(f"note: took over {path} from a process that is gone ({_describe(previous)})", flush=True)
    fh.seek(0)
    fh.truncate()
    fh.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "stage": stage}))
    fh.flush()
    try:
        yield
    finally:
        fh.seek(0)
        fh.truncate()  # released cleanly: no holder to report
        fh.close()
