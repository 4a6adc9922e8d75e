"""Running one stage as N processes: the DeepSpeed launcher's command, each process's environment, and
joining the process group from inside one. Training (train/launch.py) and the cache pass (data/cache.py)
start their processes through here, so both pick the same accelerator, backend and threads.

The recipe's `device` decides, never the Makefile: on CUDA every process sees the GPUs, takes the one of
its LOCAL_RANK and talks NCCL; on the CPU DeepSpeed is told `DS_ACCELERATOR=cpu`, the processes talk gloo
and share the cores (one thread each per core / N, or N processes oversubscribe every core).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from specdistill import device as devices
from specdistill.errors import SpecdistillError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend(device: torch.device) -> str:
    """The collective backend for a device: NCCL refuses CPU tensors, gloo has no GPU kernels worth using."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def process_env(device: torch.device, processes: int, env: dict | None = None, cores: int | None = None) -> dict:
    """The environment each of `processes` processes on one node starts with, for the resolved `device`.

    CUDA: DS_ACCELERATOR=cuda (an inherited `cpu` is dropped: it would silently train on the CPU), and no
    thread limit; the launcher gives each process its LOCAL_RANK, `device.resolve` maps it to one GPU.
    CPU: DS_ACCELERATOR=cpu and OMP_NUM_THREADS = cores / processes (a user's own setting is kept)."""
    env = dict(os.environ if env is None else env)
    device = torch.device(device)
    env["DS_ACCELERATOR"] = devices.deepspeed_accelerator(device)
    if device.type == "cpu":
        cores = cores or os.cpu_count() or 1
        env.setdefault("OMP_NUM_THREADS", str(max(1, cores // max(1, processes))))
    return env


def launcher_command(module: str, args: list[str], num_gpus: int, num_nodes: int = 1,
                     hostfile: str | None = None) -> list[str]:
    """`deepspeed --num_gpus N [--num_nodes M --hostfile H] --module MODULE ARGS...` (the venv's launcher)."""
    exe = Path(sys.executable).with_name("deepspeed")
    cmd = [str(exe) if exe.exists() else "deepspeed", "--num_gpus", str(num_gpus)]
    if num_nodes > 1:
        cmd += ["--num_nodes", str(num_nodes)]
    if hostfile:
        if not Path(hostfile).is_file():
            raise SpecdistillError(f"train.hostfile {hostfile}: no such file")
        cmd += ["--hostfile", hostfile]
    return cmd + ["--master_port", str(free_port()), "--module", module, *args]


def launcher_port(cmd: list[str]) -> str:
    """The master port a `launcher_command` gave its ranks."""
    return cmd[cmd.index("--master_port") + 1]


def run_ranks(cmd: list[str], env: dict, **kwargs) -> subprocess.CompletedProcess:
    """Run a `launcher_command` to its end, then remove what its ranks left in /dev/shm."""
    try:
        return subprocess.run(cmd, env=env, **kwargs)
    finally:
        remove_shm_buffers(launcher_port(cmd))


def remove_shm_buffers(port: str) -> list[Path]:
    """DeepSpeed's CPU all-reduce maps one /dev/shm segment per rank, named by uid, address and master port
    (its shm.cpp), and never unlinks it: 66 MB of RAM per rank per multi-process CPU run, held until reboot
    (a machine here lost 12 GB to them, and the next run was killed for memory). Whoever launched the ranks
    removes them once the ranks are gone (a killed rank could not); on this node only."""
    found = sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"))
    for path in found:
        path.unlink(missing_ok=True)
    return found


def use_accelerator(device: torch.device) -> None:
    """Point DeepSpeed at the device's accelerator before anything asks it, and refuse a mismatch (DeepSpeed
    caches its first answer: a process that already chose another one would train on it silently)."""
    wanted = devices.deepspeed_accelerator(device)
    os.environ["DS_ACCELERATOR"] = wanted
    from deepspeed.accelerator import get_accelerator

    got = get_accelerator().device_name()
    if got != wanted:
        raise SpecdistillError(f"device: {device} needs DeepSpeed's {wanted!r} accelerator, but this process "
                               f"already uses {got!r}; run it in a fresh process")


def in_process_local_rank(device) -> str:
    """LOCAL_RANK of a process the launcher did not start: DeepSpeed puts its engine on that GPU, so it is the
    index `device: cuda:N` names (else `cuda:N` would train on cuda:0 with its batches on cuda:N); 0 on the CPU."""
    device = torch.device(device)
    return str(device.index or 0) if device.type == "cuda" else "0"


def join(device: torch.device) -> tuple[int, int]:
    """Join the launcher's process group (or a 1-process group when run in-process); (rank, world)."""
    if not dist.is_initialized():
        import deepspeed

        launched = "MASTER_PORT" in os.environ
        if not launched:
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK=in_process_local_rank(device),
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        deepspeed.init_distributed(dist_backend=backend(device))
        if not launched:
            # This process listens on that port for as long as it lives: a child that inherited MASTER_PORT
            # would try to listen on it too and fail (EADDRINUSE). RANK and LOCAL_RANK stay: DeepSpeed reads them.
            del os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size()


def last_error(log: Path) -> str:
    """The line of a process's log that says what went wrong: its last line naming an error, else its last line."""
    lines = [l for l in log.read_text(errors="replace").splitlines() if l.strip()]
    errors = [l for l in lines if "Error" in l or "error:" in l]
    return (errors or lines or ["no output"])[-1].strip()[:300]
