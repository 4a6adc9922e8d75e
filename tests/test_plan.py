"""`specdistill plan` (specdistill/plan_stage.py): the estimate from measured rates, the fit to a budget, the plan
applied by every stage of the run, and the probe itself on a tiny target."""
from __future__ import annotations

import json

import pytest

from specdistill import device as devices
from specdistill import layout
from specdistill.cli import main
from specdistill.errors import SpecdistillError
from specdistill.plan import time_left
from specdistill.eval.runtime import fastest_verify
from specdistill.plan_stage import AIM, estimate, fit, sizes
from specdistill.recipe import load_recipe, plan_key, recipe_dump
from tests.test_other_targets import TOY, write_recipe

DEFAULT = "recipes/smollm2-135m-eagle3.yaml"
# Rates as a probe measures them: 100 tokens a row, 100 tokens/s cached, 2 s a step of 2,000 tokens, 0.5 s a token
# decoded over 3 probe prompts; its one save scored 8 held-out rows in 2 s and drafted the chain at 400 positions in 4 s;
# the workloads stage took 40 s at 1 prompt a workload and 24 new tokens, 16 s of it the timed decodes (the rest: loading, warm-ups).
RATES = {"heldout_rows": 8, "heldout_chain_positions": 400, "heldout_offline_s": 2.0, "heldout_chain_s": 4.0,
         "prepare_s": 10.0, "cache_fixed_s": 20.0, "corpus_rows": None, "cache_tokens": 9600, "cache_rows": 96, "cache_tokens_per_s": 100.0,
         "train_fixed_s": 60.0, "train_step_s": 2.0, "train_tokens_per_step": 2000.0, "eval_fixed_s": 30.0,
         "eval_per_token_s": 0.5, "eval_prompts": 3, "plain_tokens_per_s": 10.0, "export_s": 5.0, "report_s": 5.0,
         "workloads_s": 40.0, "workloads_decode_s": 16.0}


def default_recipe(tmp_path, *overrides):
    return load_recipe(DEFAULT, [f"output_dir={tmp_path}", "served.enabled=false", *overrides])


def test_the_estimate_adds_each_stage_fixed_cost_and_rate(tmp_path):
    est = estimate(default_recipe(tmp_path), RATES, 1.0)  # 8,000 rows, 672 steps, 6 saves, 16 + 8 prompts of 64
    # a save scores 8 batches of 4 of the 400 held-out rows, and the chain at its cap of 1,024 positions (50 a row)
    save = 2.0 / 8 * 32 + 4.0 / 400 * 1024
    assert est == {"prepare": 10.0, "cache": 20.0 + 8000 * 100 / 100,
                   "train": 60.0 + 672 * 2.0 + 6 * save,
                   "eval": 30.0 + 0.5 * 64 * 24 / 3, "export": 5.0, "served": 0.0, "report": 5.0,
                   # the stage's 24 s outside the timed decodes, the decodes' 16 s scaled to 4 prompts of 64 tokens
                   "workloads": pytest.approx(24.0 + 16.0 * 4 * 64 / 24)}
    assert estimate(default_recipe(tmp_path, "eval.workload_prompts=0"), RATES, 1.0)["workloads"] == 0.0
    assert estimate(default_recipe(tmp_path), RATES, 0.0)["train"] == 60.0 + 6 * save  # the saves' cost is fixed
    unscored = {**RATES, "heldout_rows": 0, "heldout_chain_positions": 0}  # a recipe without a held-out split
    assert estimate(default_recipe(tmp_path), unscored, 1.0)["train"] == 60.0 + 672 * 2.0
    served = estimate(default_recipe(tmp_path, "served.enabled=true"), RATES, 1.0)["served"]
    # plain, the export, ngram, suffix: each starts in the time 1,340 plain tokens take here, and decodes at twice that rate
    assert served == pytest.approx(4 * (1340 / 10.0 + 2 * 16 * 64 / 20.0))


def test_the_fit_fills_the_budget_and_never_grows_the_recipe(tmp_path):
    recipe = default_recipe(tmp_path)
    scale = fit(recipe, RATES, 3600.0, spent_s=120.0)
    assert sum(estimate(recipe, RATES, scale).values()) + 120.0 == pytest.approx(3600.0)
    assert sizes(recipe, scale, RATES["corpus_rows"]) == {"corpus.max_rows": 2388, "train.max_steps": 201, "train.save_every": 34,
                                    "train.warmup_steps": 20}
    # fixed: every stage at 0 rows, the eval, the workloads stage and the 6 saves' held-out scoring included
    workloads = 24.0 + 16.0 * 4 * 64 / 24
    assert scale == pytest.approx((3600 - 120 - 386 - workloads - 6 * (2.0 / 8 * 32 + 4.0 / 400 * 1024)) / 9344)
    assert fit(recipe, RATES, 10 ** 6, spent_s=0.0) == 1.0
    with pytest.raises(SpecdistillError, match="budget_minutes=90: the stages' fixed costs alone take 12 min"):
        fit(recipe, RATES, 400.0, spent_s=0.0)


def test_a_budget_the_full_eval_leaves_no_room_in_gets_a_lighter_eval(tmp_path, monkeypatch):
    """A slow machine (RATES in a 10-minute budget): the recipe's 16 + 8 prompts and 4 per workload take 11.5 min
    alone, so the plan falls back to LIGHT_EVAL's counts, which every stage then applies; a budget even that cannot
    fit names each stage's fixed minutes."""
    from argparse import Namespace

    from specdistill import plan_stage

    monkeypatch.setattr(plan_stage, "probe", lambda recipe, overrides: dict(RATES))  # this machine, as measured
    monkeypatch.setattr(plan_stage, "fp32_overrides", lambda recipe, device: [])
    monkeypatch.setattr(plan_stage, "runtime_overrides", lambda recipe, device: ([], None))
    given = [f"output_dir={tmp_path}", "served.enabled=false", "budget_minutes=10"]
    recipe = load_recipe(DEFAULT, given)
    with pytest.raises(SpecdistillError, match="fixed costs alone take 12 min"):
        fit(recipe, RATES, 600 * AIM, spent_s=0.0)
    plan = plan_stage.run(recipe, Namespace(overrides=given))
    assert plan["overrides"][:3] == ["eval.num_prompts=8", "eval.tuning_prompts=0", "eval.workload_prompts=2"]
    planned = default_recipe(tmp_path, "budget_minutes=10")
    assert (planned.eval.num_prompts, planned.eval.tuning_prompts, planned.eval.workload_prompts) == (8, 0, 2)
    assert planned.corpus.max_rows >= 64 and plan["total_s"] <= 600
    given[-1] = "budget_minutes=5"
    layout.plan_path(recipe.run_dir).unlink()
    with pytest.raises(SpecdistillError, match=r"with a lighter eval \(eval.num_prompts=8 .*\) still: budget_minutes=5: "
                                               r"the stages' fixed costs alone take 6 min on this machine "
                                               r"\(train 2, eval 2, workloads 2\)"):
        plan_stage.run(load_recipe(DEFAULT, given), Namespace(overrides=given))


def test_an_eval_that_would_take_longer_than_the_training_is_made_lighter(tmp_path, monkeypatch):
    """RATES in 15 minutes: the recipe's eval fits, but at x0.018 of the rows and steps it would take 1.36x the cache
    pass's and training's time, so the plan runs LIGHT_EVAL's counts and gives the time to rows and steps; in 20
    minutes (0.75x) the recipe's eval is kept."""
    from argparse import Namespace

    from specdistill import plan_stage

    monkeypatch.setattr(plan_stage, "probe", lambda recipe, overrides: dict(RATES))
    monkeypatch.setattr(plan_stage, "fp32_overrides", lambda recipe, device: [])
    monkeypatch.setattr(plan_stage, "runtime_overrides", lambda recipe, device: ([], None))
    given = [f"output_dir={tmp_path}", "served.enabled=false", "budget_minutes=15"]
    recipe = load_recipe(DEFAULT, given)
    full = fit(recipe, RATES, 900 * AIM, spent_s=0.0)
    plan = plan_stage.run(recipe, Namespace(overrides=given))
    assert plan["overrides"][:3] == ["eval.num_prompts=8", "eval.tuning_prompts=0", "eval.workload_prompts=2"]
    assert plan["scale"] > 2 * full and plan["total_s"] <= 900
    est = plan["estimate_s"]
    assert est["eval"] + est["workloads"] < est["cache"] + est["train"]
    given[-1] = "budget_minutes=20"
    layout.plan_path(recipe.run_dir).unlink()
    plan = plan_stage.run(load_recipe(DEFAULT, given), Namespace(overrides=given))
    assert not any(o.startswith("eval.") for o in plan["overrides"])
    assert plan_stage.saves(default_recipe(tmp_path, "budget_minutes=20")) == 6  # the recipe's saves, kept


def test_the_lighter_eval_saves_three_times_and_gives_the_time_to_steps(tmp_path, monkeypatch):
    """With the lighter eval, training scores its held-out split LIGHT_SAVES times, not the recipe's 6 (each a fixed
    cost): the run saves 3 times and the plan fits more rows and steps than with 6 saves."""
    from argparse import Namespace

    from specdistill import plan_stage

    monkeypatch.setattr(plan_stage, "probe", lambda recipe, overrides: dict(RATES))
    monkeypatch.setattr(plan_stage, "fp32_overrides", lambda recipe, device: [])
    monkeypatch.setattr(plan_stage, "runtime_overrides", lambda recipe, device: ([], None))
    given = [f"output_dir={tmp_path}", "served.enabled=false", "budget_minutes=15"]
    plan = plan_stage.run(load_recipe(DEFAULT, given), Namespace(overrides=given))
    assert "train.save_every=224" in plan["overrides"]  # 672 steps / 3
    planned = default_recipe(tmp_path, "budget_minutes=15")
    assert plan_stage.saves(planned) == 3
    layout.plan_path(planned.run_dir).unlink()
    monkeypatch.setattr(plan_stage, "LIGHT_SAVES", 6)  # the recipe's own count: nothing saved there
    six = plan_stage.run(load_recipe(DEFAULT, given), Namespace(overrides=given))
    assert not any(o.startswith("train.save_every=224") for o in six["overrides"])
    assert plan["scale"] > six["scale"] and plan["total_s"] <= 900


def test_every_stage_applies_the_plan_and_a_changed_recipe_refuses_it(tmp_path):
    recipe = default_recipe(tmp_path)
    plan = layout.plan_path(recipe.run_dir)
    plan.parent.mkdir(parents=True)
    plan.write_text(json.dumps({"for": plan_key(recipe), "overrides": ["corpus.max_rows=2702", "train.max_steps=227",
                                                                      "target.dtype=float32"],
                                "estimate_s": {"plan": 60, "prepare": 60, "cache": 600, "train": 1200}}))
    planned = default_recipe(tmp_path)
    assert (planned.corpus.max_rows, planned.train.max_steps, planned.target.dtype) == (2702, 227, "float32")
    assert planned.run_name == recipe.run_name and planned.source == DEFAULT
    assert default_recipe(tmp_path, "budget_minutes=null").corpus.max_rows == 8000  # no budget: the plan is ignored
    # the recipe the plan sized, written out and read again (what every training rank loads: train_recipe.yaml)
    resized = tmp_path / "train_recipe.yaml"
    resized.write_text(json.dumps(recipe_dump(planned)))
    again = load_recipe(resized)
    assert recipe_dump(again) == {**recipe_dump(planned)}
    with pytest.raises(SpecdistillError, match=f"{plan}: made for .*'max_rows': 8000.* now says .*'max_rows': 100"):
        default_recipe(tmp_path, "corpus.max_rows=100")
    assert time_left(planned, "prepare", 90.0) == "plan: prepare took 1.5 min (planned 1.0); about 30 min of the run left"
    plan.write_text("{")
    with pytest.raises(SpecdistillError, match=f"{plan}: not a plan written by `specdistill plan`"):
        default_recipe(tmp_path)


@pytest.mark.slow
def test_auto_runtime_is_the_static_dtype_that_verifies_faster_here():
    """Forward costs (ms) as measured: the Intel Xeon without AMX, 1- and 3-token forwards (runtime-choice-xeon's
    cost curves; fp32 cheaper: the plan moves the eval to fp32); the AVX-512 EPYC, the runtime bench's 1- and 2-token forwards, put at "3" (bf16 far
    cheaper: auto stays bf16); and a made-up near tie (within the 5% margin: bf16 stays)."""
    xeon = {"static-bf16": {"1": 61.9, "3": 64.4}, "static-fp32": {"1": 39.8, "3": 47.6}}
    epyc = {"static-bf16": {"1": 34.8, "3": 34.9}, "static-fp32": {"1": 56.5, "3": 92.3}}
    tie = {"static-bf16": {"1": 40.0, "3": 42.0}, "static-fp32": {"1": 38.0, "3": 40.5}}
    assert [fastest_verify(c, 2) for c in (xeon, epyc, tie)] == ["static-fp32", "static-bf16", "static-bf16"]


def test_the_probe_measures_a_tiny_run_and_sizes_the_recipe(tmp_path, tiny_target_dir, monkeypatch):
    monkeypatch.setenv("SPECDISTILL_CHECKPOINTS", str(tmp_path / "runs"))
    recipe_file = write_recipe(tmp_path, tiny_target_dir, "eagle")
    toy = [*TOY, "train.num_gpus=1", "train.max_steps=100000", "train.save_every=50000",
           "served.enabled=false"]  # the probe takes a minute or two here; 100,000 steps do not fit in the 10 minutes
    assert main(["plan", "--recipe", str(recipe_file), *toy, "budget_minutes=10"]) == 0
    run_dir = tmp_path / "runs" / "eagle"
    plan = json.loads(layout.plan_path(run_dir).read_text())
    m = plan["measured"]
    assert m["cache_tokens"] > 0 and m["train_step_s"] > 0 and m["eval_fixed_s"] > 0 and m["plain_tokens_per_s"] > 0
    assert m["heldout_rows"] > 0 and m["heldout_chain_positions"] > 0  # the probe's save scored its held-out split
    assert 0 < m["workloads_decode_s"] < m["workloads_s"]  # the workloads stage's timed decodes, its warm-ups apart
    assert 0 < plan["scale"] < 1 and plan["total_s"] == pytest.approx(600.0 * AIM, abs=1.0)
    planned = load_recipe(recipe_file, [*toy, "budget_minutes=10"])
    assert planned.train.max_steps == pytest.approx(100000 * plan["scale"], abs=6) and planned.corpus.max_rows == 24  # the corpus' 24 rows: no fewer than 64

    assert plan["measured"]["corpus_rows"] == plan["measured"]["cache_rows"] == 24
    if devices.native_bf16("cpu"):  # eval.runtime auto: the plan timed a verify in both static dtypes and chose
        chosen = fastest_verify(m["verify_ms"], 2)
        assert set(m["verify_ms"]) == {"static-bf16", "static-fp32"}
        assert ("eval.runtime=static-fp32" in plan["overrides"]) == (chosen == "static-fp32")
        assert planned.eval.runtime == ("static-fp32" if chosen == "static-fp32" else "auto")
    assert not (tmp_path / "runs" / "eagle-plan-probe").exists()  # the probe's scratch run is gone
    # the probe computed its cache in a store of its own: a shared cache it found (or left behind) would time nothing
    assert m["cache_computed_tokens"] == m["cache_tokens"] and not any((tmp_path / "runs").glob("shared-cache/*/"))
