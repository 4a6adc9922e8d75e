"""report.md leads with the honest answer: its first five lines give the speedup over the FASTEST plain decoding
timed in the same run (named, with its interval), prompt lookup beside it, lossless per method and the held-out
simulated τ against the measured one; "not timed" where no plain decoder but ours was timed."""
from __future__ import annotations

import argparse
import json

import pytest

from specdistill.eval import evaluate, report
from specdistill.eval.results import load_evals, read_result
from specdistill.eval.summary import baseline_timed, bootstrap_per_prompt, ratio_ci95, spec_timed
from tests.test_evaluate import setup, write_eagle_checkpoint  # noqa: F401 (setup: the eval tests' tiny target)
from tests.test_report import eval_json, recipe, write_run  # noqa: F401 (recipe: the report tests' fixture)

PLAIN = ("hf_generate", "plain_static-fp32")


def fastest_from_numbers(e: dict) -> tuple[str, float]:
    """The fastest plain decoder at T=0 and its tokens/s, from the measured throughputs themselves (not from what
    the result says is the fastest): our baseline and every plain comparator."""
    r0 = next(r for r in e["results"] if float(r["temperature"]) == 0)
    plain = {"ours": r0["baseline_tokens_per_s"],
             **{n: c["tokens_per_s"] for n, c in (e.get("comparators") or {}).items() if n in PLAIN}}
    name = max(plain, key=plain.get)
    return name, plain[name]


def check_head(md: str, e: dict) -> None:
    """Fails unless report.md's first five lines name the fastest plain decoder of eval result `e` and give the
    chain's and prompt lookup's speedups over it, lossless per method and the simulated-vs-measured τ."""
    head = "\n".join(md.splitlines()[:5])
    r0 = next(r for r in e["results"] if float(r["temperature"]) == 0)
    name, tps = fastest_from_numbers(e)
    lead = head.splitlines()[1]
    assert "fastest plain decoding" in lead, lead
    assert f"**{name}**" in lead, f"line 2 does not name the fastest plain decoder {name}: {lead}"
    assert f"{r0['tokens_per_s'] / tps:.2f}x" in lead, f"line 2 lacks the speedup over {name}: {lead}"
    slower = r0["tokens_per_s"] / r0["baseline_tokens_per_s"]
    if name != "ours" and f"{slower:.2f}" != f"{r0['tokens_per_s'] / tps:.2f}":
        assert f"{slower:.2f}x" not in lead, f"line 2 leads with the speedup over a slower baseline: {lead}"
    lookup = (e.get("comparators") or {}).get("hf_prompt_lookup")
    if lookup:
        assert f"prompt lookup** (transformers, n-gram drafts from the prompt) beside it: {lookup['tokens_per_s'] / tps:.2f}x" in lead
    assert "**Lossless**" in head and "chain K=" in head and "prompt lookup" in head.splitlines()[2]
    assert "tree" in head.splitlines()[2]
    assert "Held-out simulated τ vs measured τ" in head.splitlines()[3]
    assert head.splitlines()[4].startswith("- headline checkpoint:")


def slower_baseline_eval() -> dict:
    """Our plain static-bf16 decoding the slowest plain decoder: static-fp32 36 tok/s, generate() 31, ours 30; the
    chain 42 tok/s is 1.40x over ours but 1.17x over the fastest."""
    e = eval_json(400, 0.62, 1.40)
    e["runtime"] = "static-bf16"
    r0 = e["results"][0]
    e["comparators"] = {"hf_generate": {"tokens_per_s": 31.0, "speedup": 31 / 30},
                        "hf_prompt_lookup": {"tokens_per_s": 37.8, "speedup": 1.26, "lossless": True,
                                             "speedup_vs_fastest_plain": 37.8 / 36, "speedup_vs_fastest_plain_ci95": [0.98, 1.12]},
                        "plain_static-fp32": {"tokens_per_s": 36.0, "speedup": 1.2}}
    r0.update(plain_timed=["ours", "hf_generate", "plain_static-fp32"], fastest_plain="plain_static-fp32",
              fastest_plain_tokens_per_s=36.0, speedup_vs_fastest_plain=42 / 36, speedup_vs_fastest_plain_ci95=[1.08, 1.25])
    r0["tree"] = {"shape": {"kind": "dynamic", "depth": 4}, "tau": 2.5, "alpha": 0.71, "alpha_at": [0.8, 0.6],
                  "speedup": 1.5, "tokens_per_s": 45.0, "ms_per_verify": 30.0, "nodes_per_step": 9.5, "lossless": False,
                  "speedup_vs_fastest_plain": 1.25, "speedup_vs_fastest_plain_ci95": [1.1, 1.4]}
    e["results"][1].update(plain_timed=["ours"], fastest_plain="ours", speedup_vs_fastest_plain=1.2)  # T=1: ours only
    e["offline"]["heldout"].update(top1_at=[0.7, 0.6, 0.5])
    return e


def test_the_report_leads_with_the_fastest_plain_decoder_not_the_slower_baseline(recipe):
    e = slower_baseline_eval()
    run_dir = write_run(recipe.run_dir.parent, "runA", [e])
    report.run(recipe, argparse.Namespace(runs=None))
    md = (run_dir / "report.md").read_text()
    check_head(md, e)
    lines = md.splitlines()[:5]
    assert lines[1].startswith("- **Speedup over the fastest plain decoding measured in the same run: 1.17x [1.08, 1.25]** "
                               "(runA/step-0000400, chain K=4, T=0.0; 95% bootstrap over prompts) over "
                               "**plain_static-fp32** = our own plain decoding in our static runtime in fp32 "
                               "(plain tok/s: ours 30.0, hf_generate 31.0, plain_static-fp32 36.0)")
    assert "**prompt lookup** (transformers, n-gram drafts from the prompt) beside it: 1.05x [0.98, 1.12]" in lines[1]
    assert lines[2] == ("- **Lossless** at T=0 (token-identical to plain greedy decoding), runA/step-0000400: chain K=4 yes; "
                        "tree (kind=dynamic, depth=4) NOT lossless; prompt lookup yes (vs generate() on the same weights)")
    sim = 1 + 0.7 + 0.7 * 0.6 + 0.7 * 0.6 * 0.5 + 0.7 * 0.6 * 0.5 * 0.5
    assert lines[3] == (f"- **Held-out simulated τ vs measured τ** (runA/step-0000400, T=0.0, K=4): simulated {sim:.3f}, "
                        f"measured 2.240 [2.040, 2.440]: gap {sim - 2.24:+.3f} (simulated − measured)")
    # the checkpoint table: over the fastest where it was timed, "not timed" at T=1 (ours alone), never "(ours)"
    assert "| 1.40 [1.30, 1.50] | 1.17 [1.08, 1.25] (vs plain_static-fp32) | yes |" in md
    assert "| 1.20 [1.10, 1.30] | not timed | n/a (T>0) |" in md and "(ours)" not in md and "vs ours" not in md
    # the tree's figures carry "not lossless" wherever they appear
    tree_row = next(line for line in md.splitlines() if line.startswith("| step-0000400 | tree ("))
    assert "tree (kind=dynamic, depth=4, not lossless)" in tree_row and tree_row.endswith("| not lossless |")
    assert "1.25 [1.10, 1.40] (vs plain_static-fp32)" in tree_row


def test_the_check_fails_on_a_report_that_leads_with_a_slower_baseline(recipe):
    """The negative case: a result that calls our (slower) plain decoding the fastest, as one that forgot the
    static-fp32 decoder would; its report leads with 1.40x and the check must say so."""
    e = slower_baseline_eval()
    r0 = e["results"][0]
    r0.update(fastest_plain="ours", fastest_plain_tokens_per_s=30.0, speedup_vs_fastest_plain=1.40,
              speedup_vs_fastest_plain_ci95=[1.30, 1.50])
    run_dir = write_run(recipe.run_dir.parent, "runA", [e])
    report.run(recipe, argparse.Namespace(runs=None))
    md = (run_dir / "report.md").read_text()
    assert "1.40x [1.30, 1.50]" in md.splitlines()[1]
    with pytest.raises(AssertionError, match="does not name the fastest plain decoder plain_static-fp32"):
        check_head(md, e)
    with pytest.raises(AssertionError, match="lacks the speedup over plain_static-fp32"):
        check_head(md.replace("**ours**", "**plain_static-fp32**"), e)


def test_not_timed_where_no_other_plain_decoder_was(recipe):
    """An earlier checkpoint (comparators ran with the last one only) and T=1: no plain decoder but ours was timed,
    so no speedup "over the fastest" is printed as if a comparison had been made."""
    early = eval_json(200, 0.55, 1.31, comparators=False)
    for r in early["results"]:
        r.update(plain_timed=["ours"], fastest_plain="ours", speedup_vs_fastest_plain=r["speedup"])
    early["offline"]["heldout"].update(top1_at=[0.9, 0.9, 0.9])  # the headline by simulated τ
    last = slower_baseline_eval()
    last["offline"]["heldout"].update(top1_at=[0.1, 0.1, 0.1])
    run_dir = write_run(recipe.run_dir.parent, "runA", [early, last])
    report.run(recipe, argparse.Namespace(runs=None))
    md = (run_dir / "report.md").read_text()
    lead = md.splitlines()[1]
    assert lead.startswith("- **Speedup over the fastest plain decoding measured in the same run: 1.17x [1.08, 1.25]** "
                           "(runA/step-0000400, chain K=4, T=0.0: the plain decoders were timed with it, not with the "
                           "headline runA/step-0000200, for which they are not timed) over **plain_static-fp32**"), lead
    row = next(line for line in md.splitlines() if line.startswith("| step-0000200 | 200 |"))
    assert row.count("| not timed |") == 2 and "(ours)" not in md
    assert md.splitlines()[4].startswith("- headline checkpoint: runA/step-0000200")
    # with no plain comparator anywhere in the run: said, with the speedup over our own plain decoding only
    alone = recipe.run_dir.parent / "alone"
    write_run(recipe.run_dir.parent, "alone", [eval_json(200, 0.55, 1.31, comparators=False)])
    solo = json.loads(next((alone / "eval").glob("*.json")).read_text())
    for r in solo["results"]:
        r.update(plain_timed=["ours"], fastest_plain="ours", speedup_vs_fastest_plain=r["speedup"])
    next((alone / "eval").glob("*.json")).write_text(json.dumps(solo))
    report.write_report({"alone": report.load_evals(alone, recipe.eval, "static-bf16")}, alone, "specdistill report")
    lead = (alone / "report.md").read_text().splitlines()[1]
    assert lead.startswith("- **Speedup over the fastest plain decoding: not timed** (alone/step-0000200, chain K=4, "
                           "T=0.0: no plain decoder besides our own")
    assert lead.endswith("over our own plain decoding 1.31x [1.21, 1.41]); prompt lookup: not timed")


def test_a_real_eval_leads_with_its_fastest_plain_decoder_and_keeps_per_prompt_results(setup):
    """A tiny random target really decoded: chain, tree and every comparator on the same prompts. The report's
    first five lines name the fastest plain decoder the numbers say, and every interval is recomputed from the
    per-prompt results the eval JSON keeps."""
    recipe_, target = setup
    recipe_.eval.temperature, recipe_.eval.k_sweep = [0], []
    recipe_.eval.tree = {"kind": "dynamic", "depth": 3, "top_k": 2, "total_tokens": 6}
    write_eagle_checkpoint(recipe_, target, 1)
    evaluate.run(recipe_, argparse.Namespace(checkpoint="last"))
    e = load_evals(recipe_.run_dir, recipe_.eval, "static-bf16")[0]
    assert read_result(recipe_, "step-0000001")["_file"] == e["_file"]
    r0 = e["results"][0]
    name, tps = fastest_from_numbers(e)
    assert r0["plain_timed"] == ["ours", "hf_generate", "plain_static-fp32"] and r0["fastest_plain"] == name
    records = r0["per_prompt"]
    assert len(records) == e["num_prompts"] == 3
    assert {k: bootstrap_per_prompt(records)[k] for k in ("tau_ci95", "alpha_ci95", "speedup_ci95")} == \
        {k: r0[k] for k in ("tau_ci95", "alpha_ci95", "speedup_ci95")}
    fastest = baseline_timed(records) if name == "ours" else e["comparators"][name]["per_prompt"]
    assert ratio_ci95(spec_timed(records), fastest) == r0["speedup_vs_fastest_plain_ci95"]
    assert ratio_ci95(spec_timed(records), baseline_timed(records)) == r0["speedup_ci95"]  # the same resamples
    lookup = e["comparators"]["hf_prompt_lookup"]
    assert ratio_ci95(lookup["per_prompt"], fastest) == lookup["speedup_vs_fastest_plain_ci95"]
    assert lookup["lossless"] in (True, False) and lookup["lossless_vs_transformers"] in (True, False)
    tree = r0["tree"]
    assert ratio_ci95(spec_timed(tree["per_prompt"]), fastest) == tree["speedup_vs_fastest_plain_ci95"]
    path, printed = report.write_report({"tiny": [e]}, recipe_.run_dir, "specdistill report")
    md = path.read_text()
    check_head(md, e)
    assert printed.splitlines()[0].startswith("Speedup over the fastest plain decoding measured in the same run:")
