"""Every `make bench` entry still runs (at toy size: a few tokens, a step or two; nothing is measured), so a
refactor cannot leave a benchmark behind."""
from __future__ import annotations

import importlib
import inspect

import pytest

from benchmarks import run
from tests.conftest import as_distill_runs_here

pytestmark = pytest.mark.slow  # the real default target, DeepSpeed launches: ~minutes together on 2 cores


@pytest.mark.parametrize("name", [b for b in run.BENCHES if b not in run.LONG])  # scaling: tests/test_scaling_bench.py
def test_bench_runs_at_toy_size(name, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDISTILL_CHECKPOINTS", str(tmp_path / "checkpoints"))
    monkeypatch.setattr("specdistill.recipe.CHECKPOINTS", tmp_path / "checkpoints")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    main = importlib.import_module(run.BENCHES[name]).main
    # as `make distill` runs here: fp32 where bf16 is emulated (no AVX-512 BF16, no AMX; the hybrid bench took 6-7
    # minutes of make test in emulated bf16 on an AVX2 EPYC), for the benches that take a recipe's overrides
    here = as_distill_runs_here() if "overrides" in inspect.signature(main).parameters else []
    assert run.main(["--toy", name, *here]) == 0
    if name == "hybrid":  # chat + the four categories, one prompt each, and their mix; every decode lossless
        import json

        from specdistill.eval.workload_tables import DRAFTERS, rows
        from specdistill.eval.workloads import WORKLOADS

        report = json.loads((tmp_path / "checkpoints" / "bench" / "hybrid.json").read_text())
        assert list(report["workloads"]) == ["chat", *WORKLOADS] and report["mix"]["prompts"] == 5
        for w in [*report["workloads"].values(), report["mix"]]:
            for d in DRAFTERS:
                assert w[d]["lossless"] and w[d]["tau"] >= 1.0 and len(w[d]["tau_ci95"]) == 2
                assert w[d]["speedup_ci95"][0] <= w[d]["speedup_ci95"][1]
        assert len(rows(report)) == 6 * len(DRAFTERS)


def test_bench_overrides_go_only_to_benches_that_take_them():
    assert run.main(["cache", "eval.k=3"]) == 2  # refused before anything runs


def test_unknown_bench_is_refused():
    assert run.main(["--toy", "no-such-bench"]) == 2


def test_peer_bench_at_toy_size(tmp_path, monkeypatch):
    """`make bench ARGS="peer --toy"`: both trainers on one converted cache, both heads through our eval."""
    import json

    from benchmarks import peer_bench

    reason = peer_bench.missing_peer()
    if reason:
        pytest.skip(reason)
    monkeypatch.setenv("SPECDISTILL_CHECKPOINTS", str(tmp_path / "checkpoints"))
    monkeypatch.setattr("specdistill.recipe.CHECKPOINTS", tmp_path / "checkpoints")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert run.main(["peer", "--toy"]) == 0
    result = json.loads((tmp_path / "checkpoints" / "bench" / "peer.json").read_text())
    for arm in result["arms"].values():
        assert arm["steps"] == 2 and arm["measured_tau"] >= 1.0 and arm["lossless"] is True
        assert arm["heldout_top1"] is not None and arm["tokens_per_s"] > 0
    assert result["arms"]["speculators"]["checkpoint"] == "step-0000001"  # its head, read by draft.init_from
    assert result["eval_step_drift"] <= 1e-5 and result["draft_vocabulary_overlap"] > 0
