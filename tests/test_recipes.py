"""Every recipe parses; a dry run builds its DeepSpeed config and its draft from the target's config
alone (no weights, meta device). Hub targets use the real Llama-3.1-8B / Llama-3.2-1B config values."""
import json
from pathlib import Path

import pytest
import torch

from specdistill.recipe import load_recipe
from specdistill import kinds
from specdistill.train.ds_config import build_ds_config

RECIPES = sorted((Path(__file__).resolve().parent.parent / "recipes").glob("*.yaml"))
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


def llama31_8b_config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
                       rope_parameters={**LLAMA3_ROPE, "factor": 8.0}, tie_word_embeddings=False,
                       bos_token_id=128000, eos_token_id=[128001, 128008, 128009])


def llama32_1b_config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
                       rms_norm_eps=1e-5, rope_parameters={**LLAMA3_ROPE, "factor": 32.0}, tie_word_embeddings=True,
                       bos_token_id=128000, eos_token_id=[128001, 128008, 128009])


def qwen3_8b_config():
    from transformers import Qwen3Config

    return Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                       rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                       tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645)


HUB_CONFIGS = {"meta-llama/Llama-3.1-8B-Instruct": llama31_8b_config, "meta-llama/Llama-3.2-1B-Instruct": llama32_1b_config,
               "Qwen/Qwen3-8B": qwen3_8b_config}


def dry_run(recipe, tmp_path):
    """(ds_config, draft on meta) from configs only."""
    if recipe.target.path in HUB_CONFIGS:
        target_config = HUB_CONFIGS[recipe.target.path]()
    else:
        from specdistill.target import load_target_config

        target_config = load_target_config(recipe.target)
    if getattr(recipe.draft, "init_from", None) in HUB_CONFIGS:  # no hub here: a local dir holding the real config
        local = tmp_path / recipe.draft.init_from.replace("/", "--")
        HUB_CONFIGS[recipe.draft.init_from]().save_pretrained(local)
        recipe.draft.init_from = str(local)
    world = recipe.train.num_gpus * recipe.train.num_nodes
    ds = build_ds_config(recipe.train, world)
    draft = kinds.kind(recipe.draft.kind).shapes(recipe, target_config)
    return ds, draft, target_config


def n_params(model, trainable=False):
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable)


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_parses_and_dry_runs(path, tmp_path):
    recipe = load_recipe(path)
    ds, draft, target_config = dry_run(recipe, tmp_path)
    json.dumps(ds)  # serialisable as DeepSpeed's JSON config
    tc = recipe.train
    assert ds["train_batch_size"] == tc.micro_batch_size * tc.gradient_accumulation_steps * tc.num_gpus * tc.num_nodes
    assert ds["zero_optimization"]["stage"] == tc.zero_stage
    assert ds["optimizer"]["params"]["lr"] == tc.lr
    assert ("bf16" in ds) == (tc.precision == "bf16")
    assert all(p.device.type == "meta" for p in draft.parameters())
    assert n_params(draft) > 0


def test_llama8b_recipes_have_the_intended_shapes(tmp_path):
    eagle = load_recipe(RECIPES[0].parent / "llama3.1-8b-eagle.yaml")
    ds, head, _ = dry_run(eagle, tmp_path)
    assert eagle.train.num_gpus == 8 and ds["zero_optimization"]["stage"] == 2 and ds["bf16"]["enabled"]
    assert head.fc.weight.shape == (4096, 8192)
    assert 200e6 < n_params(head) < 300e6  # fc 33.6M + one 8B decoder layer 218M
    lm = load_recipe(RECIPES[0].parent / "llama3.1-8b-draft-lm.yaml")
    _, draft, _ = dry_run(lm, tmp_path)
    assert draft.config.hidden_size == 2048 and draft.config.num_hidden_layers == 16
    assert 1.1e9 < n_params(draft) < 1.4e9  # Llama-3.2-1B, tied embeddings


def test_init_from_with_other_vocabulary_is_refused(tmp_path):
    from specdistill.errors import SpecdistillError

    recipe = load_recipe(RECIPES[0].parent / "llama3.1-8b-draft-lm.yaml")
    local = tmp_path / "other-vocab"
    cfg = llama32_1b_config()
    cfg.vocab_size = 32000
    cfg.save_pretrained(local)
    recipe.draft.init_from = str(local)
    with pytest.raises(SpecdistillError, match="vocabulary 32000"):
        kinds.kind(recipe.draft.kind).shapes(recipe, llama31_8b_config())


def test_lr_schedule_warms_up_then_decays_to_min_ratio():
    from specdistill.train.ds_config import lr_factor

    f = [lr_factor(s, warmup=4, total=20, min_ratio=0.1) for s in range(20)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]  # no step at lr 0
    assert f[4] == pytest.approx(1.0) and f[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(f[4:], f[5:]))
    assert lr_factor(0, warmup=0, total=10, min_ratio=0.0) == pytest.approx(1.0)
