"""The workloads stage's numbers and table (eval/by_workload.py, eval/workload_tables.py) from per-prompt records
(the stage itself runs end to end in tests/test_e2e.py and, at bench size, tests/test_benchmarks.py)."""
from __future__ import annotations

import pytest

from specdistill.eval.by_workload import pooled
from specdistill.eval.workload_tables import DRAFTERS, console_lines, rows, workload_section
from specdistill.formats import write_json_atomic


def record(tokens, steps, seconds, baseline_seconds, lossless=True, **more):
    return {"tokens": tokens, "steps": steps, "seconds": seconds, "baseline_tokens": tokens,
            "baseline_seconds": baseline_seconds, "accepted": tokens - steps, "tested": 2 * steps,
            "accepted_first": steps // 2, "tested_first": steps, "lossless": lossless, **more}


def test_pooled_numbers_and_the_reports_table(tmp_path):
    head = [record(64, 40, 2.0, 3.0), record(64, 32, 1.0, 2.0)]
    hybrid = [record(64, 20, 1.0, 3.0, lookup_steps=15, head_steps=5), record(64, 32, 1.0, 2.0, False, lookup_steps=0,
                                                                                head_steps=32)]
    got = pooled(head)
    assert got["tau"] == 128 / 72 and got["speedup"] == pytest.approx((128 / 3.0) / (128 / 5.0))
    assert got["tau_ci95"][0] <= got["tau"] <= got["tau_ci95"][1] and got["lossless"] is True
    mixed = pooled(hybrid)
    assert mixed["lookup_step_share"] == 15 / 52 and mixed["lossless"] is False  # one prompt differed: not lossless
    report = {"checkpoint": "step-0000002", "run_dir": "runs/run", "ci": "95% bootstrap", "k": 2,
              "runtime": "static-bf16", "max_new_tokens": 64, "cpu_isa": "AVX2",
              "workloads": {"chat": {"prompts": 2, "head": got, "lookup": got, "hybrid": mixed}}}
    report["mix"] = {"prompts": 2, **report["workloads"]["chat"]}
    chain_only = rows(report)  # a kind that drafts no trees: no tree rows
    assert [r[:2] for r in chain_only] == [[f"{w} (n=2)", d] for w in ("chat", "mix") for d in ("head", "lookup", "hybrid")]
    report["workloads"]["chat"].update(head_tree=got, hybrid_tree=mixed)
    report["mix"] = {"prompts": 2, **{d: report["workloads"]["chat"][d] for d in DRAFTERS}}
    table = rows(report)
    assert [r[:2] for r in table] == [[f"{w} (n=2)", d] for w in ("chat", "mix") for d in DRAFTERS]
    assert table[2][4] == "**no**" and table[2][5] == "29%" and table[0][4] == "yes"
    assert table[3][5] == "0%" and table[4][5] == "29%"  # the head's tree; the hybrid tree's lookup share
    assert console_lines(report)[0].startswith("checkpoint step-0000002 of runs/run, K=2, static-bf16, T=0")
    assert console_lines(report)[2:] == ["  ".join(row) for row in table]
    report["tree"] = {"kind": "dynamic", "depth": 4, "top_k": 3, "total_tokens": 10}
    assert console_lines(report)[0].startswith("checkpoint step-0000002 of runs/run, K=2, tree kind dynamic depth 4 "
                                               "top_k 3 total_tokens 10, static-bf16, T=0")
    run = tmp_path / "run"
    write_json_atomic(run / "eval" / "workloads-step-0000002.static-bf16.json", report)
    section = workload_section({"run": run})
    assert section.startswith("\n## By workload") and "### run / step-0000002 (K=2, tree kind dynamic depth 4 top_k 3 total_tokens 10, static-bf16" in section
    assert "| chat (n=2) | hybrid | 2.46 [" in section and workload_section({"run": tmp_path / "none"}) == ""
