"""benchmarks/gpu_check.py without a pipeline run: what the pipeline part makes of eval's T=0 result."""
from __future__ import annotations

import json
from argparse import Namespace

from benchmarks import gpu_check


def eval_result(divergences: list[dict]) -> dict:
    t0 = {"temperature": 0.0, "lossless": not divergences, "tau": 1.5, "divergences": divergences,
          "lossless_vs_transformers": True, "transformers_divergences": []}
    return {"results": [t0, {"temperature": 1.0, "tau": 1.2}], "hardware": {"device": "cpu"}}


def fake_pipeline_run(tmp_path, monkeypatch, divergences: list[dict]) -> dict:
    """part_pipeline with its stages skipped: the eval JSON and export folder they would have written."""
    run = tmp_path / "runs" / "pipeline"
    (run / "eval").mkdir(parents=True)
    (run / "export" / "eagle3").mkdir(parents=True)
    (run / "eval" / "step-4.json").write_text(json.dumps(eval_result(divergences)))
    monkeypatch.setattr(gpu_check, "stages", lambda recipe, names, *o: {name: 0.0 for name in names})
    args = Namespace(device="cpu", tiny_target=str(tmp_path / "t"), corpus=str(tmp_path / "c.jsonl"),
                     prompts=str(tmp_path / "p.jsonl"))
    return gpu_check.part_pipeline(args, tmp_path)


def test_a_t0_divergence_is_recorded_with_its_logit_gap_not_failed_on(tmp_path, monkeypatch):
    """On cuBLAS a near-tie can flip a greedy token without any device bug: the part passes and keeps each
    divergence with the top-2 logit gap eval measured there."""
    tie = {"decoder": "chain K=2", "prompt": 1, "position": 7, "top2_logit_gap": 0.00390625}
    result = fake_pipeline_run(tmp_path, monkeypatch, [tie])
    assert result["T0_lossless"] is False and result["T0_divergences"] == [tie]
    assert result["T0_max_divergence_gap"] == 0.0039 and result["tau_T0"] == 1.5
    line = gpu_check.summary_line({"part": "pipeline", "ok": True, "result": result})
    assert line.startswith("T=0 1 divergence(s), largest top-2 logit gap 0.0039") and "exported eagle3" in line


def test_a_lossless_run_says_so(tmp_path, monkeypatch):
    result = fake_pipeline_run(tmp_path, monkeypatch, [])
    assert result["T0_lossless"] is True and result["T0_divergences"] == [] and result["T0_max_divergence_gap"] is None
    assert gpu_check.summary_line({"part": "pipeline", "ok": True, "result": result}).startswith("T=0 lossless,")
