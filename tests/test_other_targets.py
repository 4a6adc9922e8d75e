"""Tiny Llama, Qwen3 and Gemma-3 targets (built from their configs, real SmolLM2 tokenizer) through every
stage, export included, for every draft kind (EAGLE-1, EAGLE-3, a draft LM, Medusa); the EAGLE heads export with the same name/shape check as
Llama's, and a second run warm-starts from the export over the shared cache."""
from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from specdistill import kinds, layout
from specdistill.cli import main
from specdistill.eval.results import recipe_runtime
from specdistill.recipe import load_recipe
from tests.conftest import tiny_model
from tests.helpers import draft_section

FAMILIES = ["llama", "qwen3", "gemma3_text"]
CHAT = [{"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                      {"role": "assistant", "content": f"{a} plus {b} is {a + b}. Happy to help with more sums."}]}
        for a in range(12) for b in range(2)]
STAGES = ["prepare", "cache", "train", "eval", "report", "export"]
TOY = ["train.max_steps=2", "train.save_every=2", "train.micro_batch_size=4", "train.warmup_steps=1",
       "eval.num_prompts=2", "eval.max_new_tokens=8", "eval.temperature=0", "eval.comparators=false",
       "eval.checkpoints=last", "eval.k=2", "corpus.heldout_fraction=0.2"]
DRAFT = {name: draft_section(name) for name in kinds.KIND_NAMES}  # every kind of the registry, tiny
FORMAT = {name: kinds.kind(name).EXPORT_FORMATS[0] for name in kinds.KIND_NAMES}  # each kind's default export


@pytest.fixture(scope="module", params=FAMILIES)
def family_target(request, tmp_path_factory, smollm_tokenizer):
    d = tmp_path_factory.mktemp(request.param)
    model = tiny_model(request.param, vocab_size=len(smollm_tokenizer))
    model.save_pretrained(d)
    smollm_tokenizer.save_pretrained(d)
    return request.param, d, model.config


def write_recipe(tmp_path, target_dir, kind):
    corpus = tmp_path / "chat.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in CHAT))
    p = tmp_path / f"{kind}.yaml"
    p.write_text(f"run_name: {kind}\noutput_dir: {tmp_path / 'runs'}\ntarget: {{path: {target_dir}}}\n"
                 f"corpus: {{path: {corpus}, format: messages, max_length: 64}}\ndraft: {DRAFT[kind]}\n"
                 f"train: {{max_steps: 2, save_every: 2}}\n")
    return p


def expected_llama_head(kind: str, cfg) -> dict[str, tuple]:
    """vLLM's Eagle(3)LlamaForCausalLM tensors for a head over this target (same table as tests/test_export.py)."""
    h, i, nh, nkv = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or h // nh
    w = 2 * h if kind == "eagle3" else h
    t = {"layers.0.self_attn.q_proj.weight": (nh * d, w), "layers.0.self_attn.k_proj.weight": (nkv * d, w),
         "layers.0.self_attn.v_proj.weight": (nkv * d, w), "layers.0.self_attn.o_proj.weight": (h, nh * d),
         "layers.0.mlp.gate_proj.weight": (i, h), "layers.0.mlp.up_proj.weight": (i, h),
         "layers.0.mlp.down_proj.weight": (h, i), "layers.0.post_attention_layernorm.weight": (h,)}
    if kind == "eagle":
        t["fc.weight"] = (h, 2 * h)
    else:
        t.update({"fc.weight": (h, 3 * h), "norm.weight": (h,), "lm_head.weight": (256, h), "d2t": (256,),
                  "t2d": (cfg.vocab_size,), "layers.0.input_layernorm.weight": (h,), "layers.0.hidden_norm.weight": (h,)})
    return t


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(DRAFT))
def test_every_stage_runs_for_the_target(family_target, kind, tmp_path, monkeypatch, capsys):
    from tests.test_export import VLLM_EAGLE3_PARAMS, VLLM_EAGLE_PARAMS, vllm_eagle3_param_name, vllm_param_name

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    family, target_dir, cfg = family_target
    recipe = write_recipe(tmp_path, target_dir, kind)
    for stage in STAGES:
        assert main([stage, "--recipe", str(recipe), *TOY]) == 0, f"{family} {kind}: {stage} failed: " \
                                                                   f"{capsys.readouterr().err[-2000:]}"
    run = tmp_path / "runs" / kind
    loaded = load_recipe(recipe, TOY)  # the result its eval settings and runtime name (layout.eval_result)
    result = json.loads(layout.eval_result(run, "step-0000002", loaded.eval, recipe_runtime(loaded)).read_text())
    assert result["results"][0]["lossless"] is True
    out = run / "export" / FORMAT[kind]
    config = json.loads((out / "config.json").read_text())
    if kind == "draft_lm":
        from transformers import AutoModelForCausalLM

        assert AutoModelForCausalLM.from_pretrained(out).config.model_type == family
        return
    if kind == "medusa":  # vLLM's Medusa tensor table: tests/test_medusa.py
        assert config["num_heads"] == 2 and (out / "model.safetensors").exists()
        return
    with safe_open(out / "model.safetensors", "pt") as f:
        shapes = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
    assert shapes == expected_llama_head(kind, cfg)
    if kind == "eagle":
        assert {vllm_param_name(n) for n in shapes} == VLLM_EAGLE_PARAMS - {"model.embed_tokens.weight"}
    else:
        assert {vllm_eagle3_param_name(n) for n in shapes} - {None} == VLLM_EAGLE3_PARAMS - {"model.embed_tokens.weight"}
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["hidden_act"] == "silu" and config["num_hidden_layers"] == 1
    assert config["head_dim"] == cfg.head_dim and config["rms_norm_eps"] == cfg.rms_norm_eps
    from transformers import AutoConfig, LlamaConfig

    assert isinstance(AutoConfig.from_pretrained(out), LlamaConfig)
    # a second run name continues training the exported head, over the same (shared) cache
    warm = ["run_name=warm", f"draft.init_from={out}"]
    for stage in ("prepare", "cache", "train"):
        assert main([stage, "--recipe", str(recipe), *TOY, *warm]) == 0, f"warm {stage}"
    assert "reused the shared cache" in capsys.readouterr().out
    assert (tmp_path / "runs" / "warm" / "step-0000002" / "COMPLETE").exists()
