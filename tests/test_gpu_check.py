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


# ---- compiled-bf16 beside static-bf16 (llama8b's measure_compiled), torch.compile stood in for --------------------

def compiled_inputs(monkeypatch, build_s: float = 0.0):
    """A tiny bf16 target and EAGLE-3 head, and make_runtime giving the static runtime under the compiled name
    (torch.compile costs a CPU-minute even here: tests/test_runtime.py runs it, marked slow)."""
    import time

    import torch

    from specdistill.eval import runtime as runtimes
    from tests.conftest import tiny_model
    from tests.test_engine import eagle3_for

    real = runtimes.make_runtime

    def stand_in(model, name):
        time.sleep(build_s)  # a compile that takes this long
        rt = real(model, name.replace("compiled", "static"))
        rt.name = name
        return rt

    monkeypatch.setattr(runtimes, "make_runtime", stand_in)
    model = tiny_model(vocab_size=512).to(torch.bfloat16)
    head = eagle3_for(model, list(range(0, 512, 4)))
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(0))
    return model, head, ids, [5, 9, 100, 42]


def compiled(monkeypatch, deadline_in_s: float | None, build_s: float = 0.0) -> dict:
    import time

    from specdistill import device as devices

    model, head, ids, prompt = compiled_inputs(monkeypatch, build_s)
    args = Namespace(repeats=2, deadline=None if deadline_in_s is None else time.time() + deadline_in_s)
    return gpu_check.measure_compiled(model, head, ids, prompt, 24, 2, 12, devices.clock("cpu"), args)


def llama8b_record(c: dict) -> dict:
    return {"part": "llama8b", "ok": True, "result": {"decode": {"compiled": c}}}


def test_compiled_bf16_is_timed_and_its_t0_decode_compared(monkeypatch):
    c = compiled(monkeypatch, deadline_in_s=None)
    assert c["runtime"] == "compiled-bf16" and sorted(c["forward_ms"]) == [str(m) for m in range(1, 10)]
    assert c["v"]["1"] == 1.0 and c["warmup_s"] >= 0 and c["T0_identical"] is True and c["T0_divergences"] == []
    line = gpu_check.compiled_line(llama8b_record(c))
    assert line.startswith("compiled-bf16 ms(1) ") and "compile and graph capture" in line and "T=0 lossless" in line


def test_compiled_bf16_is_skipped_when_the_part_has_too_little_time_left(monkeypatch):
    c = compiled(monkeypatch, deadline_in_s=gpu_check.COMPILED_MIN_S - 30)
    assert set(c) == {"runtime", "skipped"} and "under 120 s" in c["skipped"]
    assert gpu_check.compiled_line(llama8b_record(c)).startswith("compiled-bf16: skipped, ")


def test_a_compile_past_the_part_limit_is_stopped_and_recorded_not_raised(monkeypatch):
    """The alarm stops the compiled step COMPILED_MARGIN_S before the part's limit: the static numbers stand."""
    monkeypatch.setattr(gpu_check, "COMPILED_MIN_S", 2)
    monkeypatch.setattr(gpu_check, "COMPILED_MARGIN_S", 1)
    c = compiled(monkeypatch, deadline_in_s=3, build_s=30)
    assert c["error"].startswith("_OutOfTime: stopped 1 s before") and c["seconds"] < 10
    assert gpu_check.compiled_line(llama8b_record(c)).startswith("compiled-bf16: ERROR _OutOfTime")
    assert gpu_check.compiled_line({"part": "pipeline", "ok": True, "result": {}}) is None
