"""Decoding is device-clean: under `device.strict_device()` (a tensor factory called from project code without
`device=` raises, naming file and line) every part of the eval runs on the tiny fixtures — chain and tree, T=0
and T>0, every draft kind, static and eager runtimes, the comparators, the cost curve, the offline metrics on
the prompts, and the `specdistill eval` stage itself. What runs clean here on the CPU runs on a GPU without a
tensor left behind on the host. The drafts are built outside the mode: building a module is not decoding.
"""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from specdistill import device, kinds
from specdistill.eval import comparators, evaluate, offline
from specdistill.eval.engine import SpeculativeDecoder
from specdistill.eval.runtime import forward_costs, make_runtime
from specdistill.eval.tree import TreeDecoder
from tests.test_engine import llama

pytestmark = pytest.mark.usefixtures("one_thread")

V = 512
PROMPT = [5, 17, 300, 11, 42, 8, 99]
NEW = 10
RUNTIMES = ["eager-fp32", "static-fp32", "static-bf16"]
TREE = {"kind": "dynamic", "depth": 3, "top_k": 2, "total_tokens": 5}
TREE_KINDS = [name for name in kinds.KIND_NAMES if kinds.kind(name).DRAFTS_TREES]


def drafts_for(target, kind: str):
    """The kind's own tiny draft for `target` (plain: None)."""
    return None if kind == "plain" else kinds.kind(kind).tiny_draft(target)


@pytest.fixture(scope="module")
def runtimes():
    """One tiny 4-layer Llama per runtime (make_runtime casts its model in place); 4 layers: EAGLE-3 aux [0, 2, 4]."""
    return {name: make_runtime(llama(V, seed=0, layers=4), name) for name in RUNTIMES}


def plain(runtime, temperature=0.0, seed=0):
    return SpeculativeDecoder(runtime, None).decode(PROMPT, NEW, temperature, device.generator(runtime.device, seed))


@pytest.mark.parametrize("runtime_name", RUNTIMES)
@pytest.mark.parametrize("kind", ["plain", *kinds.KIND_NAMES])
def test_chain_decoding_is_device_clean(runtimes, runtime_name, kind):
    runtime = runtimes[runtime_name]
    draft = drafts_for(runtime.model, kind)
    with device.strict_device():
        decoder = SpeculativeDecoder(runtime, draft, k=3)
        greedy = decoder.decode(PROMPT, NEW)
        sampled = decoder.decode(PROMPT, NEW, 1.0, device.generator(runtime.device, 0))
        reference = plain(runtime)
    assert greedy.tokens == reference.tokens  # and still lossless
    assert len(sampled.tokens) == NEW and sampled.steps > 0


@pytest.mark.parametrize("runtime_name", RUNTIMES)
@pytest.mark.parametrize("kind", TREE_KINDS)
@pytest.mark.parametrize("tree", [TREE, {"kind": "static", "depth": 2, "top_k": 2}])
def test_tree_decoding_is_device_clean(runtimes, runtime_name, kind, tree):
    runtime = runtimes[runtime_name]
    head = drafts_for(runtime.model, kind)
    with device.strict_device():
        decoder = TreeDecoder(runtime, head, tree)
        greedy = decoder.decode(PROMPT, NEW)
        fallback = decoder.decode(PROMPT, NEW, 1.0, device.generator(runtime.device, 0))  # T>0: the exact chain
        reference = plain(runtime)
    assert greedy.tokens == reference.tokens
    assert fallback.tree_fallback and len(fallback.tokens) == NEW


def test_comparators_are_device_clean():
    target = llama(V, seed=0)
    draft = llama(V, seed=1, layers=1)
    with device.strict_device():
        outputs = {name: comparators.run_comparator(name, target, PROMPT, NEW, set(), 0, draft=draft, k=3)
                   for name in comparators.comparator_names(draft)}
    assert set(outputs) == {"hf_generate", "hf_prompt_lookup", "hf_assisted"}
    assert all(len(tokens) == NEW and seconds > 0 for tokens, seconds in outputs.values())


@pytest.mark.parametrize("runtime_name", ["eager-fp32", "static-bf16"])
def test_cost_curve_is_device_clean(runtimes, runtime_name):
    runtime = runtimes[runtime_name]
    ids = torch.arange(40) % V
    with device.strict_device():
        costs = forward_costs(runtime, ids, [1, 2, 5], repeats=2)
    assert set(costs) == {"1", "2", "5"} and all(ms > 0 for ms in costs.values())


@pytest.mark.parametrize("kind", kinds.KIND_NAMES)
def test_offline_metrics_on_prompts_are_device_clean(kind):
    target = llama(V, seed=0, layers=4)
    draft = drafts_for(target, kind)
    prompts = [PROMPT, [3, 4, 5]]
    with device.strict_device():
        continuations = [SpeculativeDecoder(target, None).decode(p, 6).tokens for p in prompts]
        out = offline.offline_on_prompts(target, draft, prompts, continuations)
        coverage = offline.vocab_coverage_eval(draft, continuations, V)
    assert out["positions"] == 12 and 0.0 <= out["tvd"] <= 1.0
    assert coverage["vocab_coverage_eval_tokens"] == 12


def test_eval_stage_is_device_clean(tmp_path, tiny_target_dir, monkeypatch):
    """`specdistill eval` on a tiny run (an EAGLE-1 checkpoint, the default runtime, a dynamic tree, T=0 and T=1,
    the comparators): from loading the target on the recipe's device to the JSON, nothing lands on the CPU
    implicitly, and the hardware written is the device it ran on."""
    from tests.helpers import tiny_recipe
    from tests.test_evaluate import QUESTIONS, write_eagle_checkpoint

    monkeypatch.setattr("specdistill.recipe.CHECKPOINTS", tmp_path / "checkpoints")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"category": c, "turns": [q]}) + "\n" for c, q in QUESTIONS[:2]))
    recipe = tiny_recipe(tmp_path, tiny_target_dir, f"{{prompts: {prompts}, num_prompts: 2, max_new_tokens: 8, k: 2, "
                                                     f"k_sweep: [], temperature: [0, 1], tree: {json.dumps(TREE)}}}")
    from specdistill.target import load_target

    write_eagle_checkpoint(recipe, load_target(recipe.target), 1)
    with device.strict_device():
        (written,) = evaluate.run(recipe, argparse.Namespace(checkpoint="last"))
    report = json.loads(written.read_text())
    assert report["hardware"]["device"] == str(device.resolve(recipe.device))
    greedy = report["results"][0]
    assert greedy["lossless"] is True and greedy["tree"]["lossless"] is True
    assert set(report["comparators"]) == {"hf_generate", "hf_prompt_lookup", "plain_static-fp32"}
