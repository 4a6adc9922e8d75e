"""The package's import graph: every module imports first, alone, in a fresh interpreter (an import cycle
fails there, whatever the import order elsewhere), and the stages that only read JSON and YAML never import torch."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAPPED = {"specdistill": "specdistill", "data": "specdistill.data", "train": "specdistill.train", "eval": "specdistill.eval",
          "benchmarks": "benchmarks", "experiments": "experiments"}


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


# ----------------------------------------------------------------------------- which way imports run
# Layers, top to bottom (docs/DESIGN.md "Imports"): a module imports from its own layer or a lower one. The stage
# packages share a layer; between two of them imports run one way (train reads data's cache and eval's results).
# benchmarks/ and experiments/ stand on the whole product (experiments run the benches); the tests stand on everything
# and nothing imports them.
LAYERS = {"tests": 7, "experiments": 6, "benchmarks": 5, "cli": 4, "stages": 3, "config": 2, "kinds": 1, "core": 0}
TOOLS = ("benchmarks", "experiments", "tests")  # top-level import names of the project's own code besides specdistill
CONFIG = {"specdistill.recipe", "specdistill.stages"}  # the recipe schema gathers every kind's sections
HEAVY = ("torch", "transformers", "deepspeed")  # a deferred import may wait for these, nothing else
# parts of the core counted as packages of their own, so a two-way street between one and the rest is named
CORE_PACKAGES = ("decoding", "objective", "contracts")


def package_of(module: str) -> str:
    """The package a module counts in: cli, a stage package (data, train, eval, a specdistill/*_stage module),
    config, kinds or core."""
    parts = module.split(".")
    if parts[0] in TOOLS:
        return parts[0]
    if module in CONFIG:
        return "config"
    if len(parts) > 1 and (parts[1] in ("cli", "kinds", "data", "train", "eval", *CORE_PACKAGES)
                           or parts[1].endswith("_stage")):
        return parts[1]
    return "core"


def layer_of(package: str) -> str:
    if package in CORE_PACKAGES:
        return "core"
    return package if package in ("cli", "config", "kinds", "core", *TOOLS) else "stages"


def module_files(root: Path) -> dict[str, Path]:
    files = {}
    for folder, package in MAPPED.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            files[".".join((package, *parts))] = path
    return files


def skipped_block(node: ast.AST) -> bool:
    """A top-level `if TYPE_CHECKING:` (annotations) or `if __name__ == "__main__":` (a script's entry)."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    if isinstance(test, (ast.Name, ast.Attribute)):
        return (test.id if isinstance(test, ast.Name) else test.attr) == "TYPE_CHECKING"
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
            and len(test.comparators) == 1 and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value == "__main__")


def project_imports(path: Path):
    """(imported module, line, deferred) for each import of this package's code in `path` (deferred: inside a
    function); the bodies of a top-level `if TYPE_CHECKING:` and `if __name__ == "__main__":` left out (their
    `else:` is not). A relative import is yielded as written (leading dots), wherever it is."""
    tree = ast.parse(path.read_text())
    guarded = {id(n) for node in tree.body if skipped_block(node) for stmt in node.body for n in ast.walk(stmt)}
    in_function = {id(n) for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for n in ast.walk(node) if n is not node}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            yield "." * node.level + (node.module or ""), node.lineno, id(node) in in_function
            continue
        if id(node) in guarded:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module if f"{node.module}.{a.name}" not in ALL else f"{node.module}.{a.name}"
                     for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] in ("specdistill", *TOOLS):
                yield name, node.lineno, id(node) in in_function


ALL = set(module_files(ROOT))


def import_problems(root: Path = ROOT) -> list[str]:
    """Every import against the layers, every two-way street between packages, and every deferred import of our
    code with no heavy library behind it."""
    files = module_files(root)
    problems, streets = [], {}
    for module, path in files.items():
        src = package_of(module)
        for name, line, deferred in project_imports(path):
            where = f"{path.relative_to(root)}:{line}"
            if name.startswith("."):
                problems.append(f"{where}: relative import {name} (the project imports by absolute name)")
                continue
            dst = package_of(name)
            if LAYERS[layer_of(dst)] > LAYERS[layer_of(src)]:
                problems.append(f"{where}: {src} ({layer_of(src)}) imports {name} ({layer_of(dst)}), a higher layer")
            if dst != src:
                streets.setdefault((src, dst), where)
            target = files.get(name)
            if deferred and target is not None:
                heavy = [n for n in ast.parse(target.read_text()).body if isinstance(n, (ast.Import, ast.ImportFrom))
                         and any((getattr(n, "module", None) or a.name).split(".")[0] in HEAVY for a in n.names)]
                if not heavy:
                    problems.append(f"{where}: deferred import of {name}, which imports no heavy library")
    for (a, b), where in sorted(streets.items()):
        if a < b and (b, a) in streets:
            problems.append(f"two-way street {a} <-> {b}: {where} and {streets[(b, a)]}")
    return problems


def test_imports_run_one_way_cli_stages_kinds_core():
    assert import_problems() == []


def test_an_import_up_a_layer_and_a_two_way_street_are_named(tmp_path):
    """The check on a deliberately wrong tree: a kind reaching into eval/ (once plainly, once under a top-level
    `if` that is not TYPE_CHECKING), eval and train importing each other, the decoding package and the rest of
    the core importing each other, a relative import, a deferred import of a light module, and a benchmark
    importing the tests; an import under `if TYPE_CHECKING:` is not named."""
    for folder in MAPPED:
        (tmp_path / folder).mkdir()
    (tmp_path / "specdistill" / "kinds").mkdir()
    (tmp_path / "specdistill" / "kinds" / "k.py").write_text("from specdistill.eval.runtime import x\n")
    (tmp_path / "specdistill" / "light.py").write_text("X = 1\n")
    (tmp_path / "specdistill" / "kinds" / "guarded.py").write_text(
        "import os\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from specdistill.eval.runtime import x\n"
        "if os.name:\n    from specdistill.eval.runtime import y\n")
    (tmp_path / "specdistill" / "relative.py").write_text("from .light import X\n")
    (tmp_path / "specdistill" / "decoding").mkdir()
    (tmp_path / "specdistill" / "decoding" / "kv.py").write_text("from specdistill.formats import w\n")
    (tmp_path / "specdistill" / "formats.py").write_text("from specdistill.decoding.kv import z\n")
    (tmp_path / "eval" / "runtime.py").write_text("from specdistill.train.loop import y\n")
    (tmp_path / "benchmarks" / "bench.py").write_text("from tests.conftest import tiny_model\n")
    (tmp_path / "train" / "loop.py").write_text("from specdistill.eval.runtime import x\n\n\n"
                                                "def f():\n    from specdistill.light import X\n")
    assert sorted(import_problems(tmp_path)) == [
        "benchmarks/bench.py:1: benchmarks (benchmarks) imports tests.conftest (tests), a higher layer",
        "specdistill/kinds/guarded.py:7: kinds (kinds) imports specdistill.eval.runtime (stages), a higher layer",
        "specdistill/kinds/k.py:1: kinds (kinds) imports specdistill.eval.runtime (stages), a higher layer",
        "specdistill/relative.py:1: relative import .light (the project imports by absolute name)",
        "train/loop.py:5: deferred import of specdistill.light, which imports no heavy library",
        "two-way street core <-> decoding: specdistill/formats.py:1 and specdistill/decoding/kv.py:1",
        "two-way street eval <-> train: eval/runtime.py:1 and train/loop.py:1",
    ]
