"""The whole pipeline on the real default target (SmolLM2-135M-Instruct), at toy scale, through the CLI, with
the default recipe (EAGLE-3, what `make distill` runs). The other kinds run every stage, all in one interpreter,
on tiny Llama, Qwen3 and Gemma-3 targets (tests/test_other_targets.py) and Medusa in tests/test_medusa.py."""
import json
import os
import subprocess
import sys

import pytest

from specdistill import layout
from specdistill.eval.results import recipe_runtime
from specdistill.eval.workload_tables import DRAFTERS
from specdistill.eval.workloads import WORKLOADS
from specdistill.formats import read_manifest
from specdistill.recipe import load_recipe
from tests.conftest import DEFAULT_RECIPE as DEFAULT, as_distill_runs_here
from tests.test_evaluate import check_consistent

pytestmark = pytest.mark.slow

TOY = ["corpus.max_rows=40", "corpus.max_length=192", "train.max_steps=4", "train.save_every=2",
       "train.micro_batch_size=4", "train.warmup_steps=2", "eval.num_prompts=2", "eval.max_new_tokens=12",
       "eval.temperature=[0, 1]", "eval.tuning_prompts=1", "eval.comparators=false", "eval.checkpoints=last",
       "train.num_gpus=1", "eval.workload_prompts=1", "run_name=e2e"]  # one checkpoint decoded: choosing several is tests/test_evaluate.py's;
# one training process: the default's 2 ranks are tests/test_train.py's (test_two_processes_match_one)


STAGES = ["prepare", "cache", "train", "eval", "workloads", "report", "export"]


def run_stages(cmd, env, what):
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, f"{what} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def test_make_distill_pipeline_on_default_target(tmp_path):
    env = dict(os.environ, SPECDISTILL_CHECKPOINTS=str(tmp_path), DS_ACCELERATOR="cpu",
               TOKENIZERS_PARALLELISM="false")
    # as `make distill` runs here: where bf16 is emulated (no AVX-512 BF16, no AMX) the plan moves the run to fp32
    # (on an AVX2 EPYC this test took 14 of make test's 57 minutes in emulated bf16)
    toy = as_distill_runs_here(TOY)
    for stage in STAGES:  # as `make distill` runs it: one process per stage
        run_stages([sys.executable, "-m", "specdistill.cli", stage, "--recipe", DEFAULT, *toy], env, stage)
    run = tmp_path / "e2e"
    manifest = read_manifest(run / "cache")
    assert manifest["hidden_size"] == 576
    steps = sorted(p.name for p in run.glob("step-*"))
    assert steps == ["step-0000002", "step-0000004"]
    recipe = load_recipe(DEFAULT, toy)  # the result its eval settings and runtime name (layout.eval_result)
    result = json.loads(layout.eval_result(run, "step-0000004", recipe.eval, recipe_runtime(recipe)).read_text())
    by_t = {r["temperature"]: r for r in result["results"]}
    assert by_t[0.0]["lossless"] is True and result["exactness_check"]["exact"] is True
    for r in by_t.values():  # tau = tokens / steps <= K + 1 (3 at the default K = 2), speedup = the throughput ratio
        check_consistent(r, result["k"])
    # the workloads stage: every workload and the mix, each drafter lossless, in the report
    by_workload = json.loads((run / "eval" / f"workloads-step-0000004.{result['runtime']}.json").read_text())
    assert list(by_workload["workloads"]) == ["chat", *WORKLOADS] and by_workload["mix"]["prompts"] == 5
    for w in [*by_workload["workloads"].values(), by_workload["mix"]]:
        assert all(w[d]["lossless"] and w[d]["tau"] >= 1.0 for d in DRAFTERS)
    assert "## By workload" in (run / "report.md").read_text()
    assert (run / "export" / "vllm-eagle3" / "model.safetensors").exists()
