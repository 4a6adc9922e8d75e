"""benchmarks/gpu_check.py without a pipeline run: what the pipeline part makes of eval's T=0 result."""
from __future__ import annotations

import json
from argparse import Namespace

from benchmarks import gpu_check, gpu_measure


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
    return gpu_measure.measure_compiled(model, head, ids, prompt, 24, 2, 12, devices.clock("cpu"), args)


def llama8b_record(c: dict) -> dict:
    return {"part": "llama8b", "ok": True, "result": {"decode": {"compiled": c}}}


def test_compiled_bf16_is_timed_and_its_t0_decode_compared(monkeypatch):
    c = compiled(monkeypatch, deadline_in_s=None)
    assert c["runtime"] == "compiled-bf16" and sorted(c["forward_ms"]) == [str(m) for m in range(1, 10)]
    assert c["v"]["1"] == 1.0 and c["warmup_s"] >= 0 and c["T0_identical"] is True and c["T0_divergences"] == []
    line = gpu_check.compiled_line(llama8b_record(c))
    assert line.startswith("compiled-bf16 ms(1) ") and "compile and graph capture" in line and "T=0 lossless" in line


def test_compiled_bf16_is_skipped_when_the_part_has_too_little_time_left(monkeypatch):
    c = compiled(monkeypatch, deadline_in_s=gpu_measure.COMPILED_MIN_S - 30)
    assert set(c) == {"runtime", "skipped"} and "under 120 s" in c["skipped"]
    assert gpu_check.compiled_line(llama8b_record(c)).startswith("compiled-bf16: skipped, ")


def test_a_compile_past_the_part_limit_is_stopped_and_recorded_not_raised(monkeypatch):
    """The alarm stops the compiled step COMPILED_MARGIN_S before the part's limit: the static numbers stand."""
    monkeypatch.setattr(gpu_measure, "COMPILED_MIN_S", 2)
    monkeypatch.setattr(gpu_measure, "COMPILED_MARGIN_S", 1)
    c = compiled(monkeypatch, deadline_in_s=3, build_s=30)
    assert c["error"].startswith("_OutOfTime: stopped 1 s before") and c["seconds"] < 10
    assert gpu_check.compiled_line(llama8b_record(c)).startswith("compiled-bf16: ERROR _OutOfTime")
    assert gpu_check.compiled_line({"part": "pipeline", "ok": True, "result": {}}) is None


# ---- the .whl/ folder benchmarks/gpu_wheels.sh writes for the GPU machine (no network: its list and a fake build) --

NOT_NEEDED = {"gguf": "reads GGUF targets only; gpu-check's tokenizer comes from .whl/smollm2-tokenizer",
              "pytest": "the tests' (and on the image)", "setuptools": "the build's"}


def requirement_names(requirements, carried: dict[str, str]) -> list[str]:
    """What a list of requirement strings asks for on CPython 3.12 / Linux, extras' own left out; an `==` pin
    on a carried package is checked against the carried version."""
    from packaging.requirements import Requirement

    from benchmarks.gpu_wheels import canonical

    env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython", "extra": ""}
    names = []
    for text in requirements:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = canonical(req.name)
        if name in carried:
            assert req.specifier.contains(carried[name], prereleases=True), (
                f"{text}: the script carries {name}=={carried[name]}")
        names.append(name)
    return names


def test_the_carried_wheels_are_this_venvs_versions_and_complete_what_gpu_check_imports():
    """Every wheel pinned in gpu_wheels.sh is the version this venv runs (so the tests have run it), and every
    requirement of a carried wheel and of the project is carried, on the lent machine's image, or not needed."""
    import importlib.metadata as metadata
    import tomllib

    from benchmarks import gpu_wheels

    carried, image = gpu_wheels.pins(), gpu_wheels.on_image()
    assert {"pydantic", "datasets", "deepspeed"} <= set(carried) and not set(carried) & image
    for name, version in carried.items():
        assert metadata.version(name) == version, f"{name}: the script pins {version}, this venv has {metadata.version(name)}"
    covered = set(carried) | image | set(NOT_NEEDED)
    for name in carried:
        missing = set(requirement_names(metadata.requires(name) or [], carried)) - covered
        assert not missing, f"{name}=={carried[name]} needs {sorted(missing)}: neither carried nor on the image"
    project = tomllib.loads((gpu_check.REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    missing = set(requirement_names(project, carried)) - covered
    assert not missing, f"the project needs {sorted(missing)}: neither carried nor on the image"


def fake_build(folder, wheels: list[str], tokenizer: bool = True):
    folder.mkdir()
    for name in wheels:
        (folder / name).write_bytes(b"")
    if tokenizer:
        (folder / "smollm2-tokenizer").mkdir()
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            (folder / "smollm2-tokenizer" / f).write_text("{}")
    return folder


WHEELS = ["pydantic-2.14.4-py3-none-any.whl", "pydantic_core-2.50.5-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
          "annotated_types-0.8.0-py3-none-any.whl", "typing_inspection-0.4.5-py3-none-any.whl",
          "typing_extensions-4.16.0-py3-none-any.whl", "datasets-5.1.0-py3-none-any.whl",
          "dill-0.4.1-py3-none-any.whl", "multiprocess-0.70.19-py312-none-any.whl",
          "fsspec-2026.7.0-py3-none-any.whl", "hjson-3.1.0-py3-none-any.whl", "deepspeed-0.19.8-py3-none-any.whl"]


def test_a_built_folder_is_checked_for_its_wheels_tags_tokenizer_and_size(tmp_path):
    from benchmarks import gpu_wheels

    assert gpu_wheels.check_dir(fake_build(tmp_path / "good", WHEELS)) == []
    bad = fake_build(tmp_path / "bad", [w for w in WHEELS if not w.startswith("hjson")] + [
        "pydantic_core-2.46.4-cp312-cp312-manylinux_2_17_x86_64.whl", "numpy-2.4.6-cp313-cp313-manylinux_2_28_x86_64.whl",
        "pydantic_core-2.50.5-cp312-cp312-macosx_11_0_arm64.whl"], tokenizer=False)
    with open(bad / "padding.bin", "wb") as fh:
        fh.truncate(65 * 2**20)  # sparse: 65 MiB counted, nothing written
    problems = "\n".join(gpu_wheels.check_dir(bad))
    for want in ("hjson==3.1.0: no wheel", "pydantic_core-2.46.4-cp312-cp312-manylinux_2_17_x86_64.whl: version 2.46.4, "
                 "the script pins 2.50.5", "numpy-2.4.6-cp313-cp313-manylinux_2_28_x86_64.whl: not in the script's list",
                 "numpy-2.4.6-cp313-cp313-manylinux_2_28_x86_64.whl: not installable by CPython 3.12",
                 "macosx_11_0_arm64.whl: not installable", "pydantic-core: 3 wheels",
                 "smollm2-tokenizer/tokenizer.json: missing", "65.0 MiB in all, over the 64 MiB"):
        assert want in problems, (want, problems)


def test_the_checkouts_own_whl_folder_when_built():
    import pytest

    from benchmarks import gpu_wheels

    folder = gpu_check.REPO_ROOT / ".whl"
    if not folder.is_dir():
        pytest.skip("no .whl/ here (bash benchmarks/gpu_wheels.sh builds it, with network)")
    assert gpu_wheels.check_dir(folder) == []
