"""`cache.regenerate_engine: vllm`: the corpus answered by vLLM's batched generation (data/vllm_generate.py in
.venv-vllm) gives, at T=0 in float32, the rows transformers' generate gives, and resumes from its partial replies."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from datasets import load_from_disk

from specdistill.data.prepare import load_prepared
from specdistill.data.regenerate import regenerated_corpus, regenerated_dir, regeneration_inputs
from specdistill.errors import SpecdistillError
from specdistill.recipe import TargetConfig
from specdistill.target import load_target, load_tokenizer
from tests.test_cache import DATA, make_recipe, prepared
from tests.test_served import vllm_python, vllm_target  # noqa: F401 (vllm_target: a fixture, head_dim 64)

MT_BENCH = {"path": str(DATA / "mt_bench.jsonl"), "columns": {"user": "turns.0"}, "max_rows": 6,
            "min_assistant_tokens": 0, "heldout_fraction": 0.4}
REGENERATE = {"regenerate": True, "regenerate_max_new_tokens": 8, "regenerate_batch_size": 4}
VLLM = {**REGENERATE, "regenerate_engine": "vllm", "regenerate_vllm_args": {"enforce_eager": True}}


@pytest.fixture(scope="module")
def varied_target(tmp_path_factory, smollm_tokenizer):
    """vllm_target's shape with weights 10x larger: greedy replies vary from token to token (at the default
    scale they repeat one token, and a reply cut or shifted would still compare equal)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    d = tmp_path_factory.mktemp("varied-target")
    config = AutoConfig.for_model("llama", hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                  num_attention_heads=2, num_key_value_heads=1, vocab_size=len(smollm_tokenizer),
                                  max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1,
                                  eos_token_id=2, pad_token_id=2, initializer_range=0.2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(d)
    smollm_tokenizer.save_pretrained(d)
    return d


def partial_file(recipe, corpus, root):
    out = regenerated_dir(root, regeneration_inputs(recipe, load_prepared(corpus)[1]))
    return out.with_name(out.name + ".partial") / "replies.jsonl"


def test_vllm_regenerates_the_rows_transformers_does_and_resumes(tmp_path, varied_target, monkeypatch):
    monkeypatch.setenv("SPECDISTILL_VLLM_PYTHON", str(vllm_python()))
    tokenizer = load_tokenizer(TargetConfig(path=str(varied_target)))
    ours = make_recipe(varied_target, MT_BENCH, REGENERATE)
    corpus = prepared(tmp_path, ours, tokenizer)
    model = load_target(TargetConfig(path=str(varied_target)))  # float32, as target.dtype's default
    uncut = load_from_disk(str(regenerated_corpus(ours, corpus, tmp_path / "first", model, tokenizer)))["train"]
    # a reply that ends: the 4th token of the last row's reply made an end-of-reply id (the tokenizer's eos)
    reply = uncut[-1]["input_ids"][-REGENERATE["regenerate_max_new_tokens"]:]
    stop = next(t for i, t in enumerate(reply) if i >= 3 and t not in reply[:i])
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(stop)
    both = load_from_disk(str(regenerated_corpus(ours, corpus, tmp_path / "shared", model, tokenizer)))
    expected, expected_heldout = both["train"], both["heldout"]
    assert expected[-1]["input_ids"][-1] == stop and len(expected[-1]["input_ids"]) < len(uncut[-1]["input_ids"])

    recipe = make_recipe(varied_target, MT_BENCH, VLLM)
    partial = partial_file(recipe, corpus, tmp_path / "shared")
    assert partial != partial_file(ours, corpus, tmp_path / "shared")  # the engine is part of the reuse key
    partial.parent.mkdir(parents=True)
    partial.write_text('{"i": 0, "ids": [7, 8]}\n{"i": 1, "ids"')  # a kill cut the last line
    served = load_from_disk(str(regenerated_corpus(recipe, corpus, tmp_path / "shared", None, tokenizer)))
    rows = served["train"]
    job = json.loads(partial.with_suffix(".vllm-job.json").read_text())
    # one vLLM start-up for both splits (prompt 0 was in the file)
    assert len(expected_heldout) > 0 and len(job["prompts"]) == len(expected) + len(expected_heldout) - 1
    assert stop in job["stop_token_ids"]
    assert [r["input_ids"] for r in served["heldout"]] == [r["input_ids"] for r in expected_heldout]
    assert [r["row"] for r in rows] == [r["row"] for r in expected]
    resumed = [r for r in rows if r["input_ids"][-2:] == [7, 8]]
    assert len(resumed) == 1
    for got, want in zip(rows, expected):
        if got["row"] != resumed[0]["row"]:
            assert got["input_ids"] == want["input_ids"] and got["loss_mask"] == want["loss_mask"]


def test_regenerating_with_vllm_missing_is_one_line_naming_the_key(tmp_path, vllm_target, monkeypatch):
    monkeypatch.setenv("SPECDISTILL_VLLM_PYTHON", str(tmp_path / "nowhere" / "python"))
    tokenizer = load_tokenizer(TargetConfig(path=str(vllm_target)))
    recipe = make_recipe(vllm_target, MT_BENCH, VLLM)
    corpus = prepared(tmp_path, recipe, tokenizer)
    with pytest.raises(SpecdistillError, match=r"^cache.regenerate_engine=vllm: no vLLM at .*make setup-vllm"):
        regenerated_corpus(recipe, corpus, tmp_path / "shared", None, tokenizer)
