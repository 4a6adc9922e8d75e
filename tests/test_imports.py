"""The package's import graph: every module imports first, alone, in a fresh interpreter (an import cycle
fails there, whatever the import order elsewhere), and the stages that only read JSON and YAML never import torch."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAPPED = {"specdistill": "specdistill", "data": "specdistill.data", "train": "specdistill.train", "eval": "specdistill.eval"}


def package_modules() -> list[str]:
    """Every module of the installed package, by its import name (data/ -> specdistill.data, ...)."""
    names = []
    for folder, package in MAPPED.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            names.append(".".join((package, *parts)))
    return names


# One interpreter imports the third-party libraries (seconds of torch/transformers/deepspeed start-up, paid once),
# never this package; then each module is imported first in a fork of it, so every fork meets the package
# fresh: an import cycle among our modules fails there whatever was loaded before. Forks run one per core.
FORK_EACH = """
import json, os, sys
for lib in ("torch", "transformers", "deepspeed", "safetensors", "pydantic", "yaml", "numpy", "tqdm", "datasets",
            "matplotlib.pyplot", "torch.utils.tensorboard"):
    try:
        __import__(lib)
    except ImportError:
        pass
assert not any(m == "specdistill" or m.startswith("specdistill.") for m in sys.modules)
failed, running = {}, {}


def reap():
    pid, _ = os.wait()
    module, read = running.pop(pid)
    with os.fdopen(read) as fh:  # a child's message is short: it fits the pipe before the child exits
        message = fh.read()
    if message:
        failed[module] = message


for module in sys.argv[1:]:
    if len(running) >= (os.cpu_count() or 1):
        reap()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            __import__(module)
            message = ""
        except BaseException as e:
            message = f"{type(e).__name__}: {e}"
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    running[pid] = (module, read)
while running:
    reap()
print(json.dumps(failed))
"""


def test_every_module_imports_first_alone_in_a_fresh_interpreter():
    modules = package_modules()
    assert "specdistill.kinds.eagle3.drafter" in modules and "specdistill.train.export" in modules
    done = subprocess.run([sys.executable, "-c", FORK_EACH, *modules], capture_output=True, text=True, cwd=ROOT,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    failed = json.loads(done.stdout.strip().splitlines()[-1])
    assert not failed, failed


NO_TORCH = """
import sys
from specdistill.cli import main
rc = main(sys.argv[1:])
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print("TORCH" if loaded else "NO-TORCH", rc)
"""


@pytest.mark.parametrize("stage", ["config", "report"])
def test_config_and_report_do_not_import_torch(stage, tmp_path):
    """`specdistill config` and `specdistill report` (its recipe loaded, its results read, its figures and
    TensorBoard scalars written) run without importing torch."""
    from tests.test_report import eval_json, write_run

    target = tmp_path / "target"  # a target on disk: its config is read as JSON (the stale guard's runtime)
    target.mkdir()
    (target / "config.json").write_text('{"model_type": "llama"}')
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"run_name: runA\noutput_dir: {tmp_path}\ntarget: {{path: {target}}}\n"
                      "corpus: {path: x.jsonl}\ndraft: {kind: eagle3}\ntrain: {max_steps: 2, save_every: 1}\n")
    write_run(tmp_path, "runA", [eval_json(100, 0.5, 1.2), eval_json(200, 0.55, 1.31)])
    out = subprocess.run([sys.executable, "-c", NO_TORCH, stage, "--recipe", str(recipe)],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip().splitlines()[-1] == "NO-TORCH 0", out.stdout[-2000:] + out.stderr[-2000:]
