"""The eval stage end to end: a tiny target, tiny checkpoints in the DESIGN.md format, real decoding."""
from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors.torch import save_file

from specdistill import layout
from specdistill.errors import SpecdistillError
from specdistill.eval import evaluate
from specdistill.eval.prompts import load_prompts
from specdistill.recipe import load_recipe
from specdistill.target import load_target, load_tokenizer
from specdistill.train.eagle import EagleHead

QUESTIONS = [("writing", "Write a short poem about the sea."),
             ("math", "What is 12 times 7?"),
             ("writing", "Describe a sunrise in two sentences.")]
RESULT_KEYS = {"temperature", "tau", "alpha", "alpha_at", "speedup", "tokens_per_s", "baseline_tokens_per_s",
               "lossless", "ms_per_draft_step", "ms_per_verify", "ms_per_token", "baseline_ms_per_token",
               "tau_by_k", "best_k", "predicted_tau_leviathan", "per_category"}
TOP_KEYS = {"checkpoint", "step", "draft_kind", "target", "prompts", "num_prompts", "max_new_tokens", "k",
            "hardware", "offline", "results", "comparators"}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture()
def setup(tmp_path, tiny_target_dir, monkeypatch):
    monkeypatch.setattr("specdistill.recipe.CHECKPOINTS", tmp_path / "checkpoints")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"category": c, "turns": [q, "second turn"]}) + "\n" for c, q in QUESTIONS))
    recipe_file = tmp_path / "tiny.yaml"
    recipe_file.write_text(f"""run_name: tiny
target: {{path: {tiny_target_dir}}}
corpus: {{path: unused.jsonl}}
draft: {{kind: eagle}}
train: {{max_steps: 2, save_every: 1}}
eval: {{prompts: {prompts}, num_prompts: 3, max_new_tokens: 12, k: 3, k_sweep: [1, 2], temperature: [0, 1]}}
""")
    recipe = load_recipe(recipe_file)
    return recipe, load_target(recipe.target)


def write_eagle_checkpoint(recipe, target, step: int):
    torch.manual_seed(step)
    head = EagleHead(target.config)
    d = layout.step_dir(recipe.run_dir, step)
    d.mkdir(parents=True)
    save_file(head.own_state_dict(), d / "draft.safetensors")
    (d / "draft_config.json").write_text(json.dumps({
        "kind": "eagle", "config": json.loads(head.config.to_json_string()),
        "target": recipe.target.model_dump(mode="json"), "step": step}))
    (d / "metrics.json").write_text(json.dumps({"step": step, "heldout": {
        "fkl": 3.0, "tvd": 0.8, "predicted_alpha": 0.2, "top1": 0.1, "positions": 100}}))
    (d / "COMPLETE").write_text(f"{step}\n")
    return d


def test_eval_stage_end_to_end(setup, capsys):
    recipe, target = setup
    write_eagle_checkpoint(recipe, target, 1)
    write_eagle_checkpoint(recipe, target, 2)
    (layout.step_dir(recipe.run_dir, 3)).mkdir()  # incomplete: ignored

    written = evaluate.run(recipe, argparse.Namespace(checkpoint="last"))
    assert [p.name for p in written] == ["step-0000002.json"]
    report = json.loads(written[0].read_text())
    assert TOP_KEYS <= set(report)
    assert report["checkpoint"] == "step-0000002" and report["step"] == 2 and report["draft_kind"] == "eagle"
    assert report["num_prompts"] == 3 and report["k"] == 3 and report["max_new_tokens"] == 12
    assert set(report["hardware"]) == {"cpu", "threads", "device"}
    assert report["offline"]["heldout"]["fkl"] == 3.0
    assert set(report["offline"]["prompts"]) >= {"fkl", "tvd", "predicted_alpha", "top1"}
    assert report["offline"]["prompts"]["positions"] > 0

    greedy, sampled = report["results"]
    for r in (greedy, sampled):
        assert RESULT_KEYS <= set(r)
        assert set(r["tau_by_k"]) == {"1", "2", "3"}
        assert len(r["alpha_at"]) == 3 and 1 <= r["best_k"] <= 3
        assert 1.0 <= r["tau"] <= 4.0 and r["speedup"] > 0
        assert set(r["per_category"]) == {"writing", "math"}
        assert r["per_category"]["writing"]["num_prompts"] == 2
    assert greedy["temperature"] == 0.0 and greedy["lossless"] is True
    assert sampled["temperature"] == 1.0 and sampled["lossless"] is None
    assert set(report["comparators"]) == {"hf_generate", "hf_prompt_lookup"}  # no assisted for eagle
    assert all(c["speedup"] > 0 for c in report["comparators"].values())

    out = capsys.readouterr().out
    assert "step-0000002 T=0 K=3: tau" in out and "lossless yes" in out and "step-0000002 T=1" in out
    assert not list(written[0].parent.glob("*.tmp"))


def test_draft_lm_with_assisted_comparator(setup):
    from tests.test_engine import llama

    recipe, target = setup
    recipe.eval.temperature = 0.0
    recipe.eval.k_sweep = []
    tokenizer = load_tokenizer(recipe.target)
    prompts = load_prompts(recipe.eval, tokenizer)
    draft = llama(target.config.vocab_size, seed=9, layers=1)
    report = evaluate.evaluate_checkpoint(recipe, target, tokenizer, draft, prompts, "manual", None,
                                          "draft_lm", None)
    (r,) = report["results"]
    assert r["lossless"] is True
    assert set(report["comparators"]) == {"hf_generate", "hf_prompt_lookup", "hf_assisted"}
    assert report["offline"]["heldout"] is None and report["offline"]["prompts"]["positions"] > 0


def test_offline_on_prompts_self_draft_is_perfect(setup):
    recipe, target = setup
    tok = load_tokenizer(recipe.target)
    prompts = load_prompts(recipe.eval, tok)
    cont = [[5, 6, 7, 8], [9, 10, 11]]
    m = evaluate.offline_on_prompts(target, target, [p.ids for p in prompts[:2]], cont)
    assert m["positions"] == 7 and m["top1"] == 1.0 and abs(m["fkl"]) < 1e-5 and m["predicted_alpha"] > 0.9999


def test_missing_or_unknown_checkpoint_stops(setup):
    recipe, target = setup
    with pytest.raises(SpecdistillError, match="no complete checkpoint"):
        evaluate.run(recipe, argparse.Namespace(checkpoint=None))
    write_eagle_checkpoint(recipe, target, 1)
    with pytest.raises(SpecdistillError, match="no complete checkpoint .*step-0000005.*have: step-0000001"):
        evaluate.select_checkpoints(recipe.run_dir, "step-5")
    assert evaluate.select_checkpoints(recipe.run_dir, "step-1")[0].name == "step-0000001"


def test_bad_prompt_file_names_the_line(setup, tmp_path):
    recipe, _ = setup
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"answer": "no prompt here"}) + "\n")
    recipe.eval.prompts = str(bad)
    with pytest.raises(SpecdistillError, match=r"bad.jsonl: line 2: no prompt field"):
        load_prompts(recipe.eval, load_tokenizer(recipe.target))


def test_mtbench_prompts_first_turn_and_category(smollm_tokenizer):
    from specdistill.recipe import EvalConfig

    prompts = load_prompts(EvalConfig(num_prompts=3), smollm_tokenizer)
    assert len(prompts) == 3 and prompts[0].category == "writing"
    assert prompts[0].text.startswith("Compose an engaging travel blog post")
    text = smollm_tokenizer.decode(prompts[0].ids)
    assert "<|im_start|>user\nCompose an engaging" in text and text.endswith("<|im_start|>assistant\n")


def test_leviathan_and_best_k():
    assert evaluate.leviathan_tau(0.5, 3) == pytest.approx(1.875)
    assert evaluate.leviathan_tau(1.0, 3) == 4.0
    # high acceptance and cheap drafts favour long chains; near-zero acceptance favours K=1
    assert evaluate.best_k([0.9, 0.9, 0.9, 0.9], 1.0, 20.0)[0] == 4
    assert evaluate.best_k([0.05, 0.05, 0.05, 0.05], 5.0, 20.0)[0] == 1


def test_eagle3_draft_is_lossless_and_offline_has_no_fkl(setup):
    from tests.test_engine import eagle3_for

    recipe, target = setup
    recipe.eval.temperature = 0.0
    recipe.eval.k_sweep = []
    recipe.eval.comparators = False
    tokenizer = load_tokenizer(recipe.target)
    prompts = load_prompts(recipe.eval, tokenizer)[:2]
    draft = eagle3_for(target, list(range(0, target.config.vocab_size, 7)))
    report = evaluate.evaluate_checkpoint(recipe, target, tokenizer, draft, prompts, "manual", None, "eagle3", None)
    assert report["results"][0]["lossless"] is True and report["comparators"] == {}
    offline = report["offline"]["prompts"]
    assert offline["fkl"] is None and 0.0 <= offline["tvd"] <= 1.0 and offline["positions"] > 0


def test_mtbench_prompts_are_spread_over_categories(smollm_tokenizer):
    from specdistill.recipe import EvalConfig

    prompts = load_prompts(EvalConfig(num_prompts=16), smollm_tokenizer)
    cats = [p.category for p in prompts]
    assert len(set(cats)) == 8 and all(cats.count(c) == 2 for c in set(cats))


def test_tree_drafting_is_measured_beside_the_chain(setup, tmp_path):
    from specdistill.eval import report as report_mod

    recipe, target = setup
    recipe.eval.temperature = [0.0, 1.0]
    recipe.eval.k_sweep = []
    recipe.eval.comparators = False
    recipe.eval.tree = {"kind": "dynamic", "depth": 3, "top_k": 2, "total_tokens": 6}
    step_dir = write_eagle_checkpoint(recipe, target, 1)
    written = evaluate.run(recipe, argparse.Namespace(checkpoint="all"))
    report = json.loads(written[0].read_text())
    greedy, sampled = report["results"]
    tree = greedy["tree"]
    assert tree["lossless"] is True and tree["tau"] >= 1.0 and tree["nodes_per_step"] > 0
    assert len(tree["alpha_at"]) == 3 and "tree" not in sampled  # trees are greedy-only
    path, _ = report_mod.write_report({"tiny": report_mod.load_evals(recipe.run_dir)}, tmp_path / "rep", "specdistill report")
    text = path.read_text()
    assert "## Chain vs tree drafting (T=0)" in text and "tree (kind=dynamic" in text and "chain K=3" in text
