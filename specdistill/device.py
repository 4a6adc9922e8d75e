"""Everything about where tensors live and how time is read on it, in one place.

One recipe key, `device` (auto | cpu | cuda | cuda:N), resolved once per process by `resolve`. The other
stages ask this module for: the DeepSpeed accelerator name (`deepspeed_accelerator`, set by our launcher,
never forced by the Makefile), a clock that waits for the device before it reads the time (`clock`),
random generators on the device (`generator`), and a description of the hardware that every eval,
bench and report records (`hardware`).

`strict_device()` is the test mode that proves the code is device-agnostic without a GPU: inside it,
a tensor factory (torch.zeros, torch.arange, torch.tensor, ...) called from project code without
`device=` raises, naming the file and line. The strict-device tests and `make gpu-check` run under it.
"""
from __future__ import annotations

import ctypes
import functools
import os
import platform
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from specdistill.errors import SpecdistillError

SETTINGS = ("auto", "cpu", "cuda", "cuda:N")


def resolve(setting: str = "auto", key: str = "device") -> torch.device:
    """The device a process runs on. `auto` is CUDA when present (this process's LOCAL_RANK under a launcher),
    else the CPU. Asking for CUDA where there is none is a one-line error naming the recipe key."""
    setting = str(setting or "auto").strip().lower()
    cuda = torch.cuda.is_available()
    count = torch.cuda.device_count() if cuda else 0
    if setting == "auto":
        setting = "cuda" if cuda else "cpu"
    if setting == "cpu":
        return torch.device("cpu")
    if setting == "cuda" or setting.startswith("cuda:"):
        if not cuda:
            raise SpecdistillError(f"{key}: {setting!r} asked for, but this machine has no CUDA device "
                                   f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); "
                                   f"use {key}=cpu or {key}=auto")
        if setting == "cuda":
            index = int(os.environ.get("LOCAL_RANK", 0)) % count
        else:
            try:
                index = int(setting.split(":", 1)[1])
            except ValueError:
                raise SpecdistillError(f"{key}: {setting!r} is not one of {', '.join(SETTINGS)}") from None
            if not 0 <= index < count:
                raise SpecdistillError(f"{key}: {setting!r}, but this machine has {count} CUDA device(s)")
        return torch.device("cuda", index)
    raise SpecdistillError(f"{key}: {setting!r} is not one of {', '.join(SETTINGS)}")


def names_one_gpu(setting) -> bool:
    """Whether a `device` setting is `cuda:N`, one GPU by its index."""
    return str(setting or "").strip().lower().startswith("cuda:")


def refuse_one_gpu_for_ranks(setting, ranks: str, key: str = "device") -> None:
    """`cuda:N` cannot be honoured by processes the DeepSpeed launcher starts: each rank's engine takes its
    LOCAL_RANK's GPU (deepspeed/runtime/engine.py _set_distributed_vars), while its batches would go to cuda:N."""
    if names_one_gpu(setting):
        raise SpecdistillError(f"{key}: {setting!r} names one GPU, but {ranks} run one process per GPU under the "
                               f"DeepSpeed launcher, each on its LOCAL_RANK's GPU; use {key}: cuda "
                               f"(CUDA_VISIBLE_DEVICES chooses the GPUs)")


def deepspeed_accelerator(device: torch.device) -> str:
    """The value of DS_ACCELERATOR for a device: DeepSpeed reads it before any autodetection."""
    return "cuda" if torch.device(device).type == "cuda" else "cpu"


def synchronize(device) -> None:
    """Wait until the device has finished the work queued so far (a no-op on the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock(device):
    """A timer for `device`: each call waits for the device's queued work, then reads perf_counter.
    Without the wait, a GPU timing measures kernel launches, not the work."""
    device = torch.device(device)
    if device.type == "cpu":
        return time.perf_counter

    def now() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return now


def generator(device, seed: int) -> torch.Generator:
    """A seeded random generator on `device` (sampling on a GPU with a CPU generator fails)."""
    return torch.Generator(device=torch.device(device)).manual_seed(int(seed))


@functools.cache
def _cpuinfo(field: str) -> str | None:
    """The value of the first `field` line of /proc/cpuinfo (None where there is none)."""
    try:
        return next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith(field)), None)
    except OSError:
        return None


def cpu_name() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def cpu_vendor() -> str:
    """GenuineIntel, AuthenticAMD, ...: with the same instruction set, oneDNN picks other kernels per vendor."""
    return _cpuinfo("vendor_id") or platform.machine()


def cpu_isa() -> str:
    """The vector instruction set torch's CPU kernels use here ("AVX512", "AVX2", ...), plus the native bf16
    instructions the CPU has: results and speed depend on it (on AVX2, bf16 matmuls are emulated, ~8x slower
    than fp32; the kernels round differently, so fp32 results differ in the last bits too)."""
    flags = (_cpuinfo("flags") or "").split()
    return "+".join([torch.backends.cpu.get_cpu_capability(), *(f for f in ("avx512_bf16", "amx_bf16") if f in flags)])


def native_bf16(device) -> bool:
    """Whether the device computes bf16 natively: a GPU that supports it, or an x86 CPU with AVX-512 BF16 or AMX
    (other CPUs: assumed, not known)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return True
    return "bf16" in cpu_isa()


_WARNED_BF16: set[str] = set()


def warn_if_bf16_emulated(dtype: torch.dtype, device, what: str, fp32_setting: str) -> None:
    """One line, once per process and setting, where bf16 would run emulated: on an AVX2-only EPYC (2026-12-02) a
    bf16 matmul took 8x an fp32 one and the bf16 cache pass ran 81 tokens/s (about 1,000 on the AVX-512 BF16
    machines this project measures on)."""
    if dtype != torch.bfloat16 or native_bf16(device) or fp32_setting in _WARNED_BF16:
        return
    _WARNED_BF16.add(fp32_setting)
    print(f"warning: {what} in bf16, but this CPU ({cpu_isa()}) has no native bf16 instructions: torch emulates "
          f"them, many times slower than fp32 here; `{fp32_setting}` runs it in fp32", flush=True)


def _driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def hardware(device=None) -> dict:
    """What ran: CPU model, instruction set and threads always; on CUDA also the GPU's name, count, memory, CUDA and driver
    versions. Written into every eval JSON, bench output and report."""
    device = torch.device(device or "cpu")
    out = {"device": str(device), "cpu": cpu_name(), "cpu_isa": cpu_isa(), "threads": torch.get_num_threads(),
           "torch": torch.__version__}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out.update(gpu=props.name, gpu_count=torch.cuda.device_count(),
                   gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   cuda=torch.version.cuda, driver=_driver_version())
    return out


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def peak_memory(device) -> dict:
    """Peak memory since the start or the last `reset_peak_memory`: the process's resident set (host; its
    child processes not included) and, on CUDA, the allocator's peak."""
    import resource

    rss_kib = _status_kib("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    out = {"host_peak_rss_gib": round(rss_kib / 2**20, 3)}
    if torch.device(device).type == "cuda":
        out["device_peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
    return out


def _return_freed_heap() -> None:
    """glibc's malloc_trim(0): release the free pages inside the heap, not only its top (no-op elsewhere)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc (musl, macOS): nothing to trim this way


def reset_peak_memory(device) -> None:
    """Start a new peak: the host's (Linux: writing 5 to /proc/self/clear_refs resets VmHWM) and the device's.
    glibc first hands its freed heap pages back: they stay resident otherwise, so the next stage's allocations
    would reuse them without raising the resident set, and its peak would read low (seen: a 512 MiB tensor not
    shown)."""
    _return_freed_heap()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # not Linux, or not allowed: the host peak stays the process's
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


# ---- strict-device test mode -------------------------------------------------------------------

# Factories that make a tensor from nothing: without `device=` they land on the default device (the CPU).
FACTORIES = frozenset({
    torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.range, torch.linspace,
    torch.logspace, torch.eye, torch.tensor, torch.as_tensor, torch.rand, torch.randn, torch.randint,
    torch.randperm, torch.tril_indices, torch.triu_indices, torch.empty_strided, torch.scalar_tensor,
})
# Not here: torch.from_numpy and torch.frombuffer never reach a TorchFunctionMode (no mode can stop them), and
# torch.asarray is what safetensors' Rust reader calls, with no Python frame of its own: the project line that
# slices a host-side shard (data/cache_reader.py) would be blamed for it.
PROJECT_ROOT = Path(__file__).resolve().parent.parent
# The package's folders: specdistill/ and the user's data/, train/, eval/ mapped into it (pyproject.toml).
PROJECT_DIRS = tuple(str(PROJECT_ROOT / d) + os.sep for d in ("specdistill", "data", "train", "eval"))


# torch's own folder, as imported and with links resolved. Not "/torch/" in a path: the lent GPU machine's
# Python lives in /opt/torch/.venv/, where that would take every library (transformers, accelerate) for torch.
_TORCH_DIR = os.path.dirname(torch.__file__)
TORCH_DIRS = tuple({_TORCH_DIR + os.sep, os.path.realpath(_TORCH_DIR) + os.sep})


def _project_caller() -> str | None:
    """file:line of the nearest project frame calling into torch, or None if the call came from elsewhere
    (transformers, DeepSpeed, any other library, the tests). Frames inside torch are walked through: a project
    `nn.Linear(4, 4)` reaches torch.empty from torch/nn/modules/linear.py and is the project's."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(PROJECT_DIRS) and not name.endswith(os.sep + "device.py"):
            return f"{os.path.relpath(name, PROJECT_ROOT)}:{frame.f_lineno}"
        if not name.startswith(TORCH_DIRS):  # first frame outside torch decides: library code is not ours to police
            return None
        frame = frame.f_back
    return None


class StrictDeviceError(AssertionError):
    pass


class _StrictDevice(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            where = _project_caller()
            if where is not None:
                raise StrictDeviceError(f"{where}: torch.{func.__name__}(...) without device= "
                                        f"(strict-device mode: every tensor the project makes names its device)")
        return func(*args, **kwargs)


@contextmanager
def strict_device():
    """Inside: a project tensor factory without `device=` raises StrictDeviceError naming file and line."""
    with _StrictDevice():
        yield
