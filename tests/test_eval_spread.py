"""`specdistill eval` spread over processes (eval/spread.py): the checkpoints dealt once each, and two real processes
on the CPU (eval.processes=2, the CUDA path's processes less CUDA_VISIBLE_DEVICES) writing the eval JSONs a serial
eval writes, but for the wall-clock numbers; a process that fails is named with its log."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from specdistill import layout
from specdistill.errors import SpecdistillError
from specdistill.eval import evaluate, spread
from specdistill.eval.results import check_freshness
from specdistill.recipe import EvalConfig
from specdistill.target import load_target
from tests.helpers import tiny_recipe
from tests.test_evaluate import QUESTIONS, write_eagle_checkpoint
from tests.test_golden import numbers

pytestmark = pytest.mark.usefixtures("one_thread")


def steps(n: int) -> list[Path]:
    return [Path(f"step-{i:07d}") for i in range(1, n + 1)]


@pytest.mark.parametrize("n", range(0, 10))
@pytest.mark.parametrize("processes", [1, 2, 3, 4])
def test_every_checkpoint_goes_to_one_process_and_the_shares_are_balanced(n, processes):
    shares = spread.assign(steps(n), processes)
    assert len(shares) == processes
    dealt = [p for share in shares for p in share]
    assert sorted(dealt) == steps(n) and len(set(dealt)) == n  # every checkpoint, each once
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    assert all(share == sorted(share) for share in shares)  # each process decodes its own in step order
    assert shares == spread.assign(steps(n), processes)  # the same deal every time
    if n >= processes:
        assert [share[0] for share in shares] == steps(n)[:processes]  # round robin from the oldest


def test_how_many_processes(setup):
    recipe, _ = setup
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert spread.process_count(recipe, cpu, 5) == 1  # auto on the CPU: one process
    recipe.eval.processes = 2
    assert spread.process_count(recipe, cpu, 5) == 2 and spread.process_count(recipe, cpu, 1) == 1
    if torch.cuda.device_count() < 2:  # more processes than the GPUs this process sees: refused in one line
        with pytest.raises(SpecdistillError, match=r"eval.processes=2, but this process sees \d GPU"):
            spread.process_count(recipe, cuda, 5)
    recipe.device = "cuda:1"
    with pytest.raises(SpecdistillError, match="names one GPU"):
        spread.process_count(recipe, cuda, 5)


def test_a_comma_separated_selection_names_several_checkpoints(setup):
    recipe, target = setup
    for step in (1, 2, 3):
        write_eagle_checkpoint(recipe, target, step)
    assert [p.name for p in layout.select_checkpoints(recipe.run_dir, "step-3,1")] == ["step-0000001", "step-0000003"]
    with pytest.raises(SpecdistillError, match="step-0000007"):
        layout.select_checkpoints(recipe.run_dir, "step-1,step-7")
    with pytest.raises(SpecdistillError, match="expected one checkpoint"):
        layout.select_checkpoint(recipe.run_dir, "step-1,step-2")


@pytest.fixture()
def setup(tmp_path, tiny_target_dir, monkeypatch):
    monkeypatch.setattr("specdistill.recipe.CHECKPOINTS", tmp_path / "checkpoints")  # the processes get output_dir
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the processes' threads, as this one's (`one_thread`)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"category": c, "turns": [q]}) + "\n" for c, q in QUESTIONS))
    recipe = tiny_recipe(tmp_path, tiny_target_dir, f"{{prompts: {prompts}, num_prompts: 2, max_new_tokens: 8, k: 2, "
                                                     "temperature: [0, 1]}")
    return recipe, load_target(recipe.target)


# what the clock decides: wall-clock numbers (numbers() leaves them out), when it was measured, and the plain decoder
# and K a timing chose
CLOCK = ("evaluated_at", "fastest_plain", "best_k")


def timeless(result: dict) -> dict:
    """An eval result's numbers (tests/test_golden.py's `numbers`: no timings) and its labels, less CLOCK."""
    strings = {k: v for k, v in result.items() if isinstance(v, str) and k not in CLOCK}
    return {"numbers": numbers(result), "labels": strings, "eval_settings": result["eval_settings"],
            "run_key": result["run_key"], "comparators": sorted(result["comparators"])}


def evaluated(recipe) -> dict[str, dict]:
    files = sorted(layout.eval_dir(recipe.run_dir).glob("step-*.json"))
    return {f.name: json.loads(f.read_text()) for f in files}


def summary_order(out: str) -> list[str]:
    """What each printed summary line is about (checkpoint, temperature or comparator), in printed order."""
    return [line.split(":")[0] for line in out.splitlines() if line.startswith("step-")]


def test_two_processes_write_what_one_writes(setup, capsys, monkeypatch):
    recipe, target = setup
    for step in (1, 2, 3):  # two processes: steps 1 and 3 in one (3, the last, with the comparators), 2 in the other
        write_eagle_checkpoint(recipe, target, step)
    recipe.eval.processes = 1
    serial_written = evaluate.run(recipe, argparse.Namespace(checkpoint=None))
    serial, serial_out = evaluated(recipe), capsys.readouterr().out
    for f in serial_written:
        f.unlink()

    recipe.eval.processes = 2
    monkeypatch.setenv("SPECDISTILL_STRICT_DEVICE", "1")  # each process runs under the strict-device mode
    written = evaluate.run(recipe, argparse.Namespace(checkpoint=None))
    out = capsys.readouterr().out
    assert written == serial_written  # the same files, in step order
    spread_results = evaluated(recipe)
    assert sorted(spread_results) == sorted(serial) and len(serial) == 3
    for name in serial:
        assert timeless(spread_results[name]) == timeless(serial[name]), name
    assert [bool(spread_results[n]["comparators"]) for n in sorted(serial)] == [False, False, True]
    assert summary_order(out) == summary_order(serial_out)  # every checkpoint's lines, in step order
    logs = recipe.run_dir / "eval-processes"
    assert "eval process 0 (cpu): step-0000001, step-0000003" in out and "eval process 1 (cpu): step-0000002" in out
    assert "step-0000002 T=0" in (logs / "process-1.log").read_text()


def test_a_failing_process_is_named_with_its_log(setup):
    recipe, target = setup
    for step in (1, 2):
        write_eagle_checkpoint(recipe, target, step)
    recipe.eval.processes = 2
    recipe.eval.prompts = str(Path(recipe.eval.prompts).with_name("gone.jsonl"))  # read by the processes only
    with pytest.raises(SpecdistillError) as failed:
        evaluate.run(recipe, argparse.Namespace(checkpoint=None))
    line = str(failed.value)
    assert "\n" not in line
    log = recipe.run_dir / "eval-processes" / f"process-{line.split()[2]}.log"
    assert line.startswith(("eval process 0 (cpu) exited with status 1", "eval process 1 (cpu) exited with status 1"))
    assert f"specdistill eval: error: eval.prompts {recipe.eval.prompts}: no such file (log {log})" in line
    assert "no such file" in log.read_text()


def test_how_many_processes_ran_never_makes_a_result_stale(tmp_path):
    """eval.processes is not an eval setting: a result recording it (the whole eval section) matches a recipe with
    another value, while another K still does not."""
    now = EvalConfig().model_dump(mode="json")
    evals = [{"checkpoint": "step-0000001", "eval_settings": {**now, "processes": 4}},
             {"checkpoint": "step-0000001", "eval_settings": {**now, "processes": 4, "k": 7}}]
    check_freshness(evals, tmp_path, now)
    assert [r for r in evals[0]["_stale"] if "settings" in r] == []
    assert evals[1]["_stale"][-1] == "eval settings differ from the recipe's: k 7 → 4"
