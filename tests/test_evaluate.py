"""The eval stage end to end: a tiny target, tiny checkpoints in the DESIGN.md format, real decoding."""
from __future__ import annotations

import argparse
import json
import re

import pytest
import torch

from specdistill import kinds, layout, metrics
from specdistill.errors import SpecdistillError
from specdistill.eval import evaluate, offline, reference, summary
from specdistill.eval.engine import eos_token_ids
from specdistill.formats import checkpoint_fingerprint
from specdistill.eval.prompts import load_prompts
from specdistill.formats import write_checkpoint
from tests.helpers import tiny_recipe
from specdistill.target import load_target, load_tokenizer
from specdistill.kinds.eagle.model import EagleHead

QUESTIONS = [("writing", "Write a short poem about the sea."),
             ("math", "What is 12 times 7?"),
             ("writing", "Describe a sunrise in two sentences.")]
RESULT_KEYS = {"temperature", "tau", "alpha", "alpha_at", "speedup", "tokens_per_s", "baseline_tokens_per_s",
               "lossless", "ms_per_draft_step", "ms_per_verify", "ms_per_token", "baseline_ms_per_token",
               "tau_by_k", "best_k", "predicted_tau_leviathan", "per_category", "tau_ci95", "alpha_ci95",
               "speedup_ci95"}
TOP_KEYS = {"checkpoint", "step", "draft_kind", "target", "prompts", "num_prompts", "max_new_tokens", "k",
            "hardware", "offline", "results", "comparators", "checkpoint_fingerprint", "eval_settings",
            "evaluated_at"}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture()
def setup(tmp_path, tiny_target_dir, monkeypatch):
    monkeypatch.setattr("specdistill.recipe.CHECKPOINTS", tmp_path / "checkpoints")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"category": c, "turns": [q, "second turn"]}) + "\n" for c, q in QUESTIONS))
    recipe = tiny_recipe(tmp_path, tiny_target_dir, f"{{prompts: {prompts}, num_prompts: 3, max_new_tokens: 12, k: 3, "
                                                     "k_sweep: [1, 2], temperature: [0, 1]}")
    return recipe, load_target(recipe.target)


def write_eagle_checkpoint(recipe, target, step: int, tokens_seen: int | None = None):
    torch.manual_seed(step)
    head = EagleHead(target.config)
    d = layout.step_dir(recipe.run_dir, step)
    write_checkpoint(d, head.own_state_dict(), {
        "kind": "eagle", "config": json.loads(head.config.to_json_string()),
        "target": recipe.target.model_dump(mode="json"), "step": step}, {"step": step, "heldout": {
            "fkl": 3.0, "tvd": 0.8, "predicted_alpha": 0.2, "top1": 0.1, "positions": 100, "top1_at": [0.1, 0.05, 0.02],
            "alpha_at": [0.2, 0.1, 0.05], "simulated_tau": {"0": 1.1051, "1": 1.221}, "labels": {"fkl": "full vocabulary"}},
            **({"tokens_seen": tokens_seen} if tokens_seen is not None else {})})
    return d


def evaluated(recipe, target, tokenizer, prompts, draft, kind: str, checkpoint: str) -> dict:
    """evaluate_checkpoint of a draft module of `kind`, the run's shared part made of the rest (the reference and
    the runtime made there, as for a run's first checkpoint)."""
    return evaluate.evaluate_checkpoint(evaluate.EvalRun(recipe, target, tokenizer, prompts),
                                        kinds.LoadedDraft(draft, kinds.kind(kind)), checkpoint, None, None)


def check_consistent(r: dict, k: int) -> None:
    """What a result's numbers must satisfy whatever was decoded: tau is tokens over steps and at most K+1, the
    main K's entry of every per-K table is the headline number, speedup is the ratio of the two throughputs,
    alpha lies in [0, 1] and is the pooled alpha_at."""
    assert r["tau"] == pytest.approx(r["tokens"] / r["steps"]) and 1.0 <= r["tau"] <= k + 1, r["tau"]
    assert r["tau_by_k"][str(k)] == r["tau"] and r["speedup_by_k"][str(k)] == r["speedup"]
    assert r["speedup"] == pytest.approx(r["tokens_per_s"] / r["baseline_tokens_per_s"])
    assert 0.0 <= r["alpha"] <= 1.0 and len(r["alpha_at"]) == k
    assert r["alpha"] == pytest.approx(sum(a * t for a, t in zip(r["alpha_at"], r["tested_at"])) / sum(r["tested_at"]))


def test_eval_stage_end_to_end(setup, capsys):
    recipe, target = setup
    write_eagle_checkpoint(recipe, target, 1)
    write_eagle_checkpoint(recipe, target, 2, tokens_seen=4096)
    (layout.step_dir(recipe.run_dir, 3)).mkdir()  # incomplete: ignored

    written = evaluate.run(recipe, argparse.Namespace(checkpoint="last"))
    assert written == [layout.eval_result(recipe.run_dir, "step-0000002", recipe.eval, "static-bf16")]
    assert re.fullmatch(r"step-0000002\.prompts-[0-9a-f]{6}-n3-t12\.static-bf16\.json", written[0].name), written[0].name
    report = json.loads(written[0].read_text())
    assert TOP_KEYS <= set(report)
    assert report["checkpoint"] == "step-0000002" and report["step"] == 2 and report["draft_kind"] == "eagle"
    assert report["num_prompts"] == 3 and report["k"] == 3 and report["max_new_tokens"] == 12
    assert {"cpu", "threads", "device"} <= set(report["hardware"]) and report["hardware"]["device"] == "cpu"
    assert report["offline"]["heldout"]["fkl"] == 3.0
    assert report["offline"]["heldout"]["top1_at"] == [0.1, 0.05, 0.02]  # what the report's simulated tau reads
    assert report["offline"]["heldout"]["simulated_tau"] == {"0": 1.1051, "1": 1.221}
    assert set(report["offline"]["prompts"]) >= {"fkl", "tvd", "predicted_alpha", "top1"}
    assert report["offline"]["prompts"]["positions"] > 0
    assert report["tokens_seen"] == 4096  # copied from metrics.json: the report's x axis survives keep_last pruning
    # EAGLE-1 drafts over the whole vocabulary: no coverage to measure
    assert report["vocab_coverage_eval"] is None and report["draft_vocab_size"] is None
    assert "vocab_coverage" not in report["offline"]["prompts"]

    exact = report["exactness_check"]  # observed before measuring, for every K decoded with
    assert exact["exact"] is True and [c["k"] for c in exact["checks"]] == [1, 2, 3]
    assert report["run_key"] == evaluate.run_key(recipe, report["runtime"])
    greedy, sampled = report["results"]
    for r in (greedy, sampled):
        assert RESULT_KEYS <= set(r)
        assert set(r["ci95_by_k"]) == {"1", "2", "3"} and r["ci95_by_k"]["3"]["tau_ci95"] == r["tau_ci95"]
        low, high = r["alpha_first_ci95"]
        assert low <= r["alpha_at"][0] <= high
        assert "reported prompts themselves" in r["best_k_from"]  # no tuning prompts: said so
        assert set(r["tau_by_k"]) == {"1", "2", "3"}
        assert len(r["alpha_at"]) == 3 and 1 <= r["best_k"] <= 3
        check_consistent(r, report["k"])
        assert set(r["per_category"]) == {"writing", "math"}
        assert r["per_category"]["writing"]["num_prompts"] == 2
        for key in ("tau", "alpha", "speedup"):
            low, high = r[f"{key}_ci95"]
            assert low <= r[key] <= high, (key, r[key], low, high)
    assert greedy["temperature"] == 0.0 and greedy["lossless"] is True
    assert greedy["lossless_vs_transformers"] is True and "lossless_vs_transformers" not in sampled
    assert report["checkpoint_fingerprint"] == checkpoint_fingerprint(layout.step_dir(recipe.run_dir, 2))
    assert report["eval_settings"] == recipe.eval.model_dump(mode="json", exclude={"processes", "workload_prompts"})
    assert report["evaluated_at"].endswith("Z")
    assert report["offline"]["prompts_sampled"]["temperature"] == 1.0
    assert "sampled" in report["offline"]["prompts_sampled"]["continuations"]
    assert sampled["temperature"] == 1.0 and sampled["lossless"] is None
    assert report["runtime"] == "static-bf16"  # so our plain decoding in static-fp32 is timed beside it
    assert set(report["comparators"]) == {"hf_generate", "hf_prompt_lookup", "plain_static-fp32"}  # no assisted: eagle
    plain = {"ours": greedy["baseline_tokens_per_s"], **{name: report["comparators"][name]["tokens_per_s"]
                                                        for name in ("hf_generate", "plain_static-fp32")}}
    assert greedy["fastest_plain"] == max(plain, key=plain.get)
    assert greedy["speedup_vs_fastest_plain"] == pytest.approx(greedy["tokens_per_s"] / max(plain.values()))
    assert sampled["fastest_plain"] == "ours"  # generate() is timed at T=0 only
    for c in report["comparators"].values():  # each comparator's speedup is its throughput over our baseline's
        assert c["tokens_per_s"] > 0 and c["speedup"] == pytest.approx(c["tokens_per_s"] / greedy["baseline_tokens_per_s"])

    out = capsys.readouterr().out
    assert "step-0000002 T=0 K=3: tau" in out and "lossless yes" in out and "step-0000002 T=1" in out
    assert not list(written[0].parent.glob("*.tmp"))


def test_an_fp32_eval_times_plain_bf16_beside_it_where_bf16_is_native(setup):
    """The plan may move the eval to static-fp32 where it verifies faster; plain bf16 is then timed beside it, so
    the speedup over the fastest plain decoding still compares both dtypes (and the fp32 target is its own
    reference: no plain_static-fp32 comparator)."""
    from specdistill import device as devices

    if not devices.native_bf16("cpu"):
        pytest.skip("bf16 is emulated on this CPU: an fp32 eval times no bf16 plain decoding")
    recipe, target = setup
    recipe.eval.temperature, recipe.eval.k_sweep, recipe.eval.runtime = [0], [], "static-fp32"
    write_eagle_checkpoint(recipe, target, 1)
    report = json.loads(evaluate.run(recipe, argparse.Namespace(checkpoint="last"))[0].read_text())
    assert report["runtime"] == "static-fp32"
    assert set(report["comparators"]) == {"hf_generate", "hf_prompt_lookup", "plain_static-bf16"}
    greedy = report["results"][0]
    assert greedy["plain_timed"] == ["ours", "hf_generate", "plain_static-bf16"]
    assert "plain_static-bf16: our own plain decoding in bfloat16" in report["comparators_note"]


def test_a_second_eval_on_other_prompts_or_runtime_never_overwrites_the_first(setup):
    """Each eval result is named by checkpoint, prompt set and runtime: an eval on fewer prompts, or in another
    runtime, writes its own file, and the readers (report, export, served) read the one their recipe names."""
    from specdistill.eval import results
    from specdistill.train.export import measured

    recipe, target = setup
    recipe.eval.temperature, recipe.eval.k_sweep, recipe.eval.comparators = [0], [], False
    write_eagle_checkpoint(recipe, target, 1)
    first = evaluate.run(recipe, argparse.Namespace(checkpoint="last"))[0]
    kept = first.read_bytes()
    fewer = recipe.model_copy(deep=True)
    fewer.eval.num_prompts = 2
    fp32 = recipe.model_copy(deep=True)
    fp32.eval.runtime = "static-fp32"
    others = [evaluate.run(r, argparse.Namespace(checkpoint="last"))[0] for r in (fewer, fp32)]
    assert len({first, *others}) == 3 and first.read_bytes() == kept  # three files, the first untouched
    assert ".n2-" not in first.name and "-n2-t12.static-bf16.json" in others[0].name
    assert others[1].name.endswith("-n3-t12.static-fp32.json")
    for r, want in ((recipe, (3, "static-bf16")), (fewer, (2, "static-bf16")), (fp32, (3, "static-fp32"))):
        got = results.read_result(r, "step-0000001")
        assert (got["num_prompts"], got["runtime"]) == want and not got["_stale"]
        assert [(e["num_prompts"], e["runtime"]) for e in results.load_evals(r.run_dir, r.eval, want[1])] == [want]
        assert measured(r, "step-0000001")[0]["_file"] == got["_file"]  # the export README quotes that one
    never = recipe.model_copy(deep=True)
    never.eval.max_new_tokens = 5
    assert results.read_result(never, "step-0000001") is None
    assert "not evaluated on these prompts in this runtime" in measured(never, "step-0000001")[1]


def test_best_k_is_chosen_on_tuning_prompts_disjoint_from_the_reported_ones(setup, monkeypatch):
    from specdistill.eval import engine as engine_mod

    recipe, target, tokenizer, _ = greedy_chain_only(setup)
    recipe.eval.num_prompts, recipe.eval.tuning_prompts, recipe.eval.k_sweep = 2, 1, [1]
    prompts, tuning = load_prompts(recipe.eval, tokenizer), evaluate.load_tuning_prompts(recipe.eval, tokenizer)
    assert len(tuning) == 1 and tuning[0].text not in {p.text for p in prompts}
    seen = []
    real_decode = engine_mod.SpeculativeDecoder.decode

    def recording(self, prompt_ids, max_new_tokens, *args, **kwargs):
        seen.append(list(prompt_ids))
        return real_decode(self, prompt_ids, max_new_tokens, *args, **kwargs)

    monkeypatch.setattr(engine_mod.SpeculativeDecoder, "decode", recording)
    draft = EagleHead(target.config).bind_target(target.get_input_embeddings(), target.get_output_embeddings())
    (r,) = evaluated(recipe, target, tokenizer, prompts, draft, "eagle", "a")["results"]
    assert tuning[0].ids in seen  # the tuning prompt was decoded ...
    assert set(r["tuning_speedup_by_k"]) == {"1", "3"} and r["best_k"] == summary.best_k(r["tuning_speedup_by_k"])
    assert "on 1 tuning prompts disjoint from the 2 reported ones" in r["best_k_from"]
    assert sum(c["num_prompts"] for c in r["per_category"].values()) == 2  # ... and not reported


def test_draft_lm_with_assisted_comparator(setup):
    from tests.test_engine import llama

    recipe, target = setup
    recipe.eval.temperature = 0.0
    recipe.eval.k_sweep = []
    tokenizer = load_tokenizer(recipe.target)
    prompts = load_prompts(recipe.eval, tokenizer)
    draft = llama(target.config.vocab_size, seed=9, layers=1)
    report = evaluated(recipe, target, tokenizer, prompts, draft, "draft_lm", "manual")
    (r,) = report["results"]
    assert r["lossless"] is True
    assert set(report["comparators"]) == {"hf_generate", "hf_prompt_lookup", "hf_assisted", "plain_static-fp32"}
    assert report["offline"]["heldout"] is None and report["offline"]["prompts"]["positions"] > 0


def test_offline_on_prompts_self_draft_is_perfect(setup):
    recipe, target = setup
    tok = load_tokenizer(recipe.target)
    prompts = load_prompts(recipe.eval, tok)
    cont = [[5, 6, 7, 8], [9, 10, 11]]
    m = offline.offline_on_prompts(target, target, [p.ids for p in prompts[:2]], cont)
    assert m["positions"] == 7 and m["top1"] == 1.0 and abs(m["fkl"]) < 1e-5 and m["predicted_alpha"] > 0.9999


def test_missing_or_unknown_checkpoint_stops(setup):
    recipe, target = setup
    with pytest.raises(SpecdistillError, match="no complete checkpoint"):
        evaluate.run(recipe, argparse.Namespace(checkpoint=None))
    write_eagle_checkpoint(recipe, target, 1)
    with pytest.raises(SpecdistillError, match="no complete checkpoint .*step-0000005.*have: step-0000001"):
        layout.select_checkpoints(recipe.run_dir, "step-5")
    assert layout.select_checkpoints(recipe.run_dir, "step-1")[0].name == "step-0000001"


def test_checkpoint_selection_spread_and_best(setup):
    recipe, target = setup
    for step in (1, 2, 3, 4, 5):
        write_eagle_checkpoint(recipe, target, step)
    names = lambda which: [p.name[-1] for p in layout.select_checkpoints(recipe.run_dir, which)]
    assert names(3) == ["1", "3", "5"] and names(2) == ["1", "5"] and names(1) == ["5"] and names(9) == list("12345")
    with pytest.raises(SpecdistillError, match="best"):
        layout.select_checkpoints(recipe.run_dir, "best")
    (recipe.run_dir / "best").symlink_to("step-0000002")
    assert names("best") == ["2"]


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
    assert metrics.leviathan_tau(0.5, 3) == pytest.approx(1.875)
    assert metrics.leviathan_tau(1.0, 3) == 4.0
    # best K = the highest measured speedup; a tie goes to the shorter chain
    assert summary.best_k({"2": 1.10, "3": 1.21, "4": 1.05}) == 3
    assert summary.best_k({"4": 0.9, "2": 0.9}) == 2
    # tau / (K d + v(K+1)): tau 2 with K=3, d 0.05, v(4) 1.1 -> 2 / 1.25
    assert summary.predicted_speedup(2.0, 3, 0.05, {"4": 1.1}) == pytest.approx(1.6)


def greedy_chain_only(setup):
    """The setup recipe at T=0 with one K and no comparators, its tokenizer and prompts."""
    recipe, target = setup
    recipe.eval.temperature = 0.0
    recipe.eval.k_sweep = []
    recipe.eval.comparators = False
    tokenizer = load_tokenizer(recipe.target)
    return recipe, target, tokenizer, load_prompts(recipe.eval, tokenizer)


def test_eagle3_draft_is_lossless_and_offline_has_no_fkl(setup):
    from tests.test_engine import eagle3_for

    recipe, target, tokenizer, prompts = greedy_chain_only(setup)
    prompts = prompts[:2]
    draft = eagle3_for(target, list(range(0, target.config.vocab_size, 7)))
    report = evaluated(recipe, target, tokenizer, prompts, draft, "eagle3", "manual")
    assert report["results"][0]["lossless"] is True and report["comparators"] == {}
    assert report["results"][0]["divergences"] == []
    offline = report["offline"]["prompts"]
    assert offline["fkl"] is None and 0.0 <= offline["tvd"] <= 1.0 and offline["positions"] > 0


def test_mtbench_prompts_are_spread_over_categories(smollm_tokenizer):
    from specdistill.recipe import EvalConfig

    prompts = load_prompts(EvalConfig(num_prompts=16), smollm_tokenizer)
    cats = [p.category for p in prompts]
    assert len(set(cats)) == 8 and all(cats.count(c) == 2 for c in set(cats))


def test_tree_drafting_is_measured_beside_the_chain(setup, tmp_path):
    from specdistill.eval import report as report_mod
    from specdistill.eval import results

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
    evals = results.load_evals(recipe.run_dir, recipe.eval, report["runtime"])
    path, _ = report_mod.write_report({"tiny": evals}, tmp_path / "rep", "specdistill report")
    text = path.read_text()
    assert "## Chain vs tree drafting (T=0)" in text and "tree (kind=dynamic" in text and "chain K=3" in text


def test_tau_alpha_speedup_are_exactly_what_was_decoded(setup, monkeypatch):
    """The target drafting for itself accepts everything: alpha is exactly 1, each prompt of N tokens takes
    ceil(N / (K+1)) steps, and speedup is exactly the ratio of the two measured throughputs."""
    import math

    from specdistill.eval import engine as engine_mod

    recipe, target, tokenizer, prompts = greedy_chain_only(setup)
    decoded = []
    real_decode = engine_mod.SpeculativeDecoder.decode

    def recording(self, prompt_ids, max_new_tokens, *args, **kwargs):
        res = real_decode(self, prompt_ids, max_new_tokens, *args, **kwargs)
        decoded.append((self.k, max_new_tokens, res))
        return res

    monkeypatch.setattr(engine_mod.SpeculativeDecoder, "decode", recording)
    report = evaluated(recipe, target, tokenizer, prompts, target, "draft_lm", "self")
    (r,) = report["results"]
    k = recipe.eval.k
    timed = [(kk, res) for kk, n, res in decoded if n == recipe.eval.max_new_tokens]
    spec = [res for kk, res in timed if kk == k]
    base = [res for kk, res in timed if kk == 0]
    assert len(spec) == len(base) == len(prompts)
    lengths = [len(b.tokens) for b in base]
    assert r["alpha"] == 1.0 and r["alpha_at"] == [1.0] * k and r["lossless"] is True
    assert r["tau"] == pytest.approx(sum(lengths) / sum(math.ceil(n / (k + 1)) for n in lengths))
    spec_tps = sum(len(x.tokens) for x in spec) / sum(x.total_s for x in spec)
    base_tps = sum(len(x.tokens) for x in base) / sum(x.total_s for x in base)
    assert r["speedup"] == pytest.approx(spec_tps / base_tps) and r["tokens_per_s"] == pytest.approx(spec_tps)
    assert r["alpha_ci95"] == [1.0, 1.0]


def test_warm_up_first_then_order_alternates_per_prompt(setup, monkeypatch):
    from specdistill.eval import engine as engine_mod

    recipe, target, tokenizer, prompts = greedy_chain_only(setup)
    calls = []
    real_decode = engine_mod.SpeculativeDecoder.decode

    def recording(self, prompt_ids, max_new_tokens, *args, **kwargs):
        calls.append(("base" if self.k == 0 else "spec", max_new_tokens))
        return real_decode(self, prompt_ids, max_new_tokens, *args, **kwargs)

    monkeypatch.setattr(engine_mod.SpeculativeDecoder, "decode", recording)
    evaluated(recipe, target, tokenizer, prompts, target, "draft_lm", "self")
    n = recipe.eval.max_new_tokens
    assert calls[:2] == [("base", evaluate.WARMUP_TOKENS), ("spec", evaluate.WARMUP_TOKENS)]  # untimed warm-up
    timed = [c[0] for c in calls[2:2 + 2 * len(prompts)]]
    assert all(c[1] == n for c in calls[2:2 + 2 * len(prompts)])
    assert timed == ["base", "spec", "spec", "base", "base", "spec"]  # who goes first alternates per prompt


def test_lossless_vs_transformers_catches_a_shared_bug(setup, monkeypatch):
    """If our greedy output (baseline and speculative alike) differed from transformers' generate(), the
    baseline comparison would still say lossless; the comparison with generate() does not."""
    from specdistill.eval import comparators

    recipe, target = setup
    recipe.eval.temperature = 0.0
    recipe.eval.k_sweep = []
    tokenizer = load_tokenizer(recipe.target)
    prompts = load_prompts(recipe.eval, tokenizer)
    draft = EagleHead(target.config).bind_target(target.get_input_embeddings(), target.get_output_embeddings())
    report = evaluated(recipe, target, tokenizer, prompts, draft, "eagle", "a")
    assert report["results"][0]["lossless_vs_transformers"] is True
    real = comparators.run_comparator

    def off_by_one(name, *args, **kwargs):  # generate() emitting something else on the second prompt
        tokens, seconds = real(name, *args, **kwargs)
        if args[1] == prompts[1].ids:
            tokens = tokens[:-1] + [(tokens[-1] + 1) % target.config.vocab_size]
        return tokens, seconds

    monkeypatch.setattr(comparators, "run_comparator", off_by_one)
    report = evaluated(recipe, target, tokenizer, prompts, draft, "eagle", "a")
    r = report["results"][0]
    assert r["lossless"] is True and r["lossless_vs_transformers"] is False
    assert r["transformers_mismatched_prompts"] == [1]


def test_bootstrap_resamples_prompts_in_pairs():
    """Prompt i's speculative run is paired with prompt i's baseline run: with baseline times that vary 10x
    between prompts and every prompt exactly 2x faster speculatively, every resample's speedup is exactly 2
    (resampling the two sides independently would spread it over roughly [1, 4])."""
    from specdistill.eval.engine import DecodeResult

    def run(secs, steps):
        return DecodeResult(tokens=[0] * 10, steps=steps, accepted=[0], tested=[0], total_s=secs)

    secs = [1.0, 10.0, 2.0, 8.0, 0.5, 5.0, 3.0, 9.0]
    ci = summary.bootstrap_ci95([run(s, 10) for s in secs], [run(s / 2, 5) for s in secs])
    assert ci["speedup_ci95"] == [pytest.approx(2.0), pytest.approx(2.0)], ci


def test_bootstrap_interval_covers_the_spread_of_prompts():
    from specdistill.eval.engine import DecodeResult

    def run(tokens, steps, acc, tested, secs):
        return DecodeResult(tokens=[0] * tokens, steps=steps, accepted=[acc], tested=[tested], total_s=secs)

    spec = [run(10, 2, 8, 8, 1.0), run(10, 10, 0, 9, 2.0)] * 5
    base = [run(10, 10, 0, 0, 1.0)] * 10
    ci = summary.bootstrap_ci95(base, spec)
    assert 1.0 < ci["tau_ci95"][0] < 100 / 60 < ci["tau_ci95"][1] < 5.0
    assert ci["alpha_ci95"][0] < 40 / 85 < ci["alpha_ci95"][1]
    assert ci["speedup_ci95"][0] < (100 / 15) / (100 / 10) < ci["speedup_ci95"][1]
    same = summary.bootstrap_ci95(base, [run(10, 2, 8, 8, 1.0)] * 10)
    assert same["tau_ci95"] == [5.0, 5.0] and same["speedup_ci95"] == [1.0, 1.0]


def test_divergences_name_the_first_differing_position_and_its_top2_gap():
    """A decode that left plain greedy decoding at position 2: reported with plain decoding's own top-2 gap."""
    from specdistill.eval.engine import DecodeResult
    from specdistill.eval.prompts import Prompt
    from specdistill.eval.runtime import make_runtime
    from tests.conftest import tiny_model

    model = tiny_model("llama", vocab_size=64)
    runtime = make_runtime(model, "static-fp32")
    prompts = [Prompt("a", "x", [5, 9, 11]), Prompt("b", "x", [7, 3])]
    base = [DecodeResult(tokens=[1, 2, 3, 4]), DecodeResult(tokens=[8, 8])]
    spec = [DecodeResult(tokens=[1, 2, 30, 4]), DecodeResult(tokens=[8, 8])]
    found = reference.divergences(runtime, prompts, base, {"chain K=2": spec})
    assert [(d["decoder"], d["prompt"], d["position"]) for d in found] == [("chain K=2", 0, 2)]
    with torch.no_grad():
        top = model(torch.tensor([[5, 9, 11, 1, 2]])).logits[0, -1].topk(2).values
    assert found[0]["top2_logit_gap"] == pytest.approx(float(top[0] - top[1]), abs=1e-4)


def test_vocab_coverage_on_eval_prompts_is_the_share_of_greedy_tokens_in_the_draft_vocab(setup):
    """vocab_coverage_eval against a direct count over transformers' own greedy tokens; the offline mass coverage
    on the prompts against a direct softmax sum; None for a head whose 'reduced' vocabulary is the whole one."""
    from tests.test_engine import eagle3_for

    recipe, target, tokenizer, prompts = greedy_chain_only(setup)
    with torch.no_grad():  # a louder MLP: the random target's greedy outputs then differ between prompts (not all newlines)
        for layer in target.model.layers:
            layer.mlp.down_proj.weight.mul_(10.0)
    eos = eos_token_ids(target, tokenizer)
    greedy = reference.transformers_greedy(target, prompts, recipe.eval.max_new_tokens, eos, tokenizer.pad_token_id)
    tokens = [t for out in greedy for t in out]
    distinct = sorted(set(tokens))
    assert len(distinct) >= 2, "the tiny target's greedy outputs need two distinct tokens for this test"
    vocab = target.config.vocab_size
    inside = set(distinct[: len(distinct) // 2]) | set(range(0, vocab, 5))  # some output tokens in, some out
    want = sum(t in inside for t in tokens) / len(tokens)
    assert 0.0 < want < 1.0
    draft = eagle3_for(target, sorted(inside))
    report = evaluated(recipe, target, tokenizer, prompts, draft, "eagle3", "manual")
    assert report["results"][0]["lossless_vs_transformers"] is True  # so our greedy tokens are `greedy`
    assert report["vocab_coverage_eval"] == pytest.approx(want, abs=1e-12)
    assert report["vocab_coverage_eval_tokens"] == len(tokens) and report["draft_vocab_size"] == len(inside)
    assert "greedy" in report["vocab_coverage_eval_note"]

    ids = torch.tensor(sorted(inside))
    mass, n = 0.0, 0
    with torch.no_grad():
        for prompt, cont in zip(prompts, greedy):
            logits = target(torch.tensor([prompt.ids + cont])).logits[0, len(prompt.ids) - 1:-1].float()
            mass += torch.softmax(logits, -1)[:, ids].sum().item()
            n += logits.shape[0]
    assert report["offline"]["prompts"]["vocab_coverage"] == pytest.approx(mass / n, rel=1e-4)

    # direct helper: every id but one is still a reduced vocabulary; the whole vocabulary is not
    everything = eagle3_for(target, list(range(vocab)))
    assert offline.vocab_coverage_eval(everything, greedy, vocab)["vocab_coverage_eval"] is None
    missing = tokens[0]
    almost = eagle3_for(target, [t for t in range(vocab) if t != missing])
    got = offline.vocab_coverage_eval(almost, greedy, vocab)
    assert got["vocab_coverage_eval"] == pytest.approx(1 - tokens.count(missing) / len(tokens))
    assert got["draft_vocab_size"] == vocab - 1


class _Sized:
    def __init__(self, n: int):
        self.n = n

    def numel(self) -> int:
        return self.n


class _OnCuda:
    """What fp32_reference_skipped reads of a target: its dtype, its device and its parameters' sizes."""

    def __init__(self, params: int, dtype=torch.bfloat16):
        self.dtype, self.device, self._params = dtype, torch.device("cuda", 0), params

    def parameters(self):
        return [_Sized(self._params)]


def test_the_fp32_reference_is_skipped_on_cuda_when_the_device_cannot_hold_it(monkeypatch):
    """4 bytes per parameter: Llama-3.1-8B's 8.03B need 32.1 GB (36.4 with the margin); on an 80 GB card with
    the bf16 target loaded it is kept, on a 48 GB one it is skipped, said in one line."""
    free = {}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free["bytes"], 80e9))
    target = _OnCuda(8_030_261_248)
    free["bytes"] = 80e9 - 16.1e9 - 1e9
    assert reference.fp32_reference_skipped(target) is None
    free["bytes"] = 48e9 - 16.1e9 - 1e9
    why = reference.fp32_reference_skipped(target)
    assert why.startswith("the float32 reference (4 bytes x 8.03B parameters = 32.1 GB) needs 36.4 GB")
    assert "30.9 GB are free on cuda:0" in why and "lossless_vs_transformers" in why
    assert reference.fp32_reference_skipped(_OnCuda(10, dtype=torch.float32)) is None  # its own reference


def test_eval_fp32_reference_key_forces_or_turns_off_the_copy(monkeypatch, tmp_path, tiny_target_dir):
    """eval.fp32_reference: true loads the copy even where auto finds the memory short, false never loads it
    (said in one line naming the key), also where it would fit or on the CPU; a float32 target needs no copy."""
    free = {"bytes": 48e9 - 16.1e9 - 1e9}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free["bytes"], 80e9))
    target = _OnCuda(8_030_261_248)
    assert reference.fp32_reference_skipped(target, "auto") is not None
    assert reference.fp32_reference_skipped(target, True) is None
    free["bytes"] = 80e9 - 16.1e9 - 1e9
    why = reference.fp32_reference_skipped(target, False)
    assert why.startswith("eval.fp32_reference is false") and "\n" not in why
    on_cpu = _OnCuda(10)
    on_cpu.device = torch.device("cpu")
    assert reference.fp32_reference_skipped(on_cpu, False) == why
    assert reference.fp32_reference_skipped(on_cpu, "auto") is None
    assert reference.fp32_reference_skipped(_OnCuda(10, dtype=torch.float32), False) is None

    from specdistill.recipe import load_recipe

    tiny_recipe(tmp_path, tiny_target_dir)
    path = tmp_path / "tiny.yaml"
    assert load_recipe(path).eval.fp32_reference == "auto"
    assert load_recipe(path, ["eval.fp32_reference=false"]).eval.fp32_reference is False
    with pytest.raises(SpecdistillError, match="fp32_reference"):
        load_recipe(path, ["eval.fp32_reference=sometimes"])


def test_a_target_larger_than_one_gpu_is_refused_by_eval_and_online_mode(setup, monkeypatch, tmp_path):
    """Eval and cache.mode online hold the whole target on one GPU: a target whose weights do not fit its free
    memory (with room for activations) is refused in one line naming the target and the sizes, before loading."""
    from specdistill.data import cache_reader
    from specdistill.target import one_device_shortfall

    recipe, target = setup
    gpu = torch.device("cuda", 0)
    free = {"bytes": 80e9}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free["bytes"], 80e9))
    assert one_device_shortfall(recipe.target, gpu) is None
    free["bytes"] = 1e6  # the tiny target's files take more
    why = one_device_shortfall(recipe.target, gpu)
    assert why.startswith(f"target.path {recipe.target.path}: its weights take ") and "0.0 GB are free on cuda:0" in why
    assert one_device_shortfall(recipe.target, torch.device("cpu")) is None  # the host's memory is not measured

    write_eagle_checkpoint(recipe, target, 1)
    monkeypatch.setattr(evaluate.devices, "resolve", lambda device: gpu)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(evaluate, "load_target", lambda *a, **k: pytest.fail("eval loaded the target"))
    with pytest.raises(SpecdistillError, match=r"^eval: target\.path .* free on cuda:0: the eval holds the target on one GPU") as e:
        evaluate.run(recipe, argparse.Namespace(checkpoint="last"))
    assert "\n" not in str(e.value)

    cache = tmp_path / "online-cache"
    cache.mkdir()
    (cache / "manifest.json").write_text(json.dumps({"mode": "online"}))
    monkeypatch.setattr(cache_reader, "load_target", lambda *a, **k: pytest.fail("online mode loaded the target"))
    with pytest.raises(SpecdistillError, match=r"^cache\.mode online: target\.path .* free on cuda:0") as e:
        cache_reader.open_cache(cache, "train", recipe.target, gpu)
    assert "\n" not in str(e.value)


def test_a_skipped_fp32_reference_is_recorded_not_guessed(setup, monkeypatch):
    """Without the float32 copy, lossless against our own plain decoding is still checked; lossless against
    transformers' generate() is None with the reason, and plain_static-fp32 is not timed."""
    recipe, target = setup
    recipe.eval.temperature = 0.0
    recipe.eval.k_sweep = []
    recipe.eval.fp32_reference = False
    asked = []
    monkeypatch.setattr(evaluate, "fp32_reference_skipped",
                        lambda target, setting: asked.append(setting) or "too little memory (test)")
    monkeypatch.setattr(evaluate, "fp32_reference_model", lambda target: pytest.fail("the fp32 copy was made"))
    tokenizer = load_tokenizer(recipe.target)
    prompts = load_prompts(recipe.eval, tokenizer)
    draft = EagleHead(target.config).bind_target(target.get_input_embeddings(), target.get_output_embeddings())
    r = evaluated(recipe, target, tokenizer, prompts, draft, "eagle", "a")["results"][0]
    assert r["lossless"] is True and r["lossless_vs_transformers"] is None
    assert r["lossless_vs_transformers_skipped"] == "too little memory (test)" and "transformers_divergences" not in r
    assert asked == [False]  # eval.fp32_reference reaches the decision
