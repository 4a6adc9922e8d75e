"""Every `make bench` entry still runs (at toy size: a few tokens, a step or two; nothing is measured), so a
refactor cannot leave a benchmark behind."""
from __future__ import annotations

import pytest

from benchmarks import run

pytestmark = pytest.mark.slow  # the real default target, DeepSpeed launches: ~minutes together on 2 cores


@pytest.mark.parametrize("name", [b for b in run.BENCHES if b not in run.LONG])  # scaling: tests/test_scaling_bench.py
def test_bench_runs_at_toy_size(name, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDISTILL_CHECKPOINTS", str(tmp_path / "checkpoints"))
    monkeypatch.setattr("specdistill.recipe.CHECKPOINTS", tmp_path / "checkpoints")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert run.main(["--toy", name]) == 0


def test_unknown_bench_is_refused():
    assert run.main(["--toy", "no-such-bench"]) == 2
