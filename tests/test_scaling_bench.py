"""`make bench ARGS=scaling` at toy size: complete runs at 4 data sizes over one cache, each evaluated; the
table's points, the fits and the files it writes. (The prepare and cache stages are the pipeline's own and
are tested elsewhere; here the test cache of tests/test_train.py stands in for them.)"""
from __future__ import annotations

import json

import pytest
import yaml

from benchmarks import scaling_bench
from specdistill import cli
from specdistill.recipe import load_recipe
from tests.test_train import write_cache


def stage_in_this_process(stage: str, recipe_path: str, overrides) -> None:
    """The bench runs each stage in its own process, which would not see this test's patched checkpoints folder."""
    assert cli.main([stage, "--recipe", recipe_path, *overrides]) == 0, stage


def test_scaling_runs_each_size_completely_and_fits(tmp_path, tiny_target_dir, monkeypatch, one_thread):
    import specdistill.recipe

    monkeypatch.setattr(specdistill.recipe, "CHECKPOINTS", tmp_path / "checkpoints")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"category": "x", "turns": [t]}) + "\n"
                               for t in ("What is 3 plus 4?", "Write one line about the sea.")))
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump({
        "run_name": "toy", "target": {"path": str(tiny_target_dir)}, "corpus": {"path": "unused.jsonl"},
        "draft": {"kind": "eagle"}, "loss": {"terms": {"fkl": 1.0}},
        "train": {"max_steps": 8, "save_every": 8, "micro_batch_size": 2, "lr": 0.003, "warmup_steps": 4,
                  "heldout_batches": 2},
        "eval": {"prompts": str(prompts), "num_prompts": 2, "max_new_tokens": 8, "k": 2, "runtime": "static-fp32"}}))
    monkeypatch.setattr(scaling_bench, "run_stage", stage_in_this_process)
    base = load_recipe(path)
    for steps in (2, 4, 6, 8):  # what the skipped prepare + cache stages would have linked into each run
        write_cache(load_recipe(path, scaling_bench.run_overrides(base, steps)).run_dir, tiny_target_dir, n_train=16)
    result = scaling_bench.scaling(str(path), [0.25, 0.5, 0.75, 1.0], [], stages=("train", "eval"))
    points = result["points"]
    assert [p["step"] for p in points] == [2, 4, 6, 8]
    assert [p["tokens_seen"] for p in points] == sorted({p["tokens_seen"] for p in points})  # 4 distinct sizes
    for p in points:
        assert 1.0 <= p["simulated"] <= 3.0 and p["continuations"] == pytest.approx(p["measured"], abs=0.02)
    warmups = [load_recipe(path, scaling_bench.run_overrides(base, s)).train.warmup_steps for s in (2, 8)]
    assert warmups == [1, 4]  # each run's own complete schedule
    assert {f["series"] for f in result["fits"]} == {"simulated", "measured"}
    out = tmp_path / "checkpoints" / "bench"
    assert json.loads((out / "scaling.json").read_text())["points"] == json.loads(json.dumps(points))
    assert (out / "scaling.png").read_bytes().startswith(b"\x89PNG")
    assert "sim. τ (held-out chain" in scaling_bench.table(result)
