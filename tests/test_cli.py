"""Command-line conventions: overrides anywhere, `specdistill config`, `output_dir`."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from specdistill.cli import main, parse
from specdistill.recipe import load_recipe

MINIMAL = """
target: {path: some/dir}
corpus: {path: data.jsonl}
draft: {kind: eagle3}
train: {max_steps: 10, save_every: 5}
"""


@pytest.fixture()
def recipe_file(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text(MINIMAL)
    return p


def test_overrides_anywhere_on_the_line(recipe_file):
    args = parse(["eval", "--recipe", str(recipe_file), "run_name=X", "--checkpoint", "step-2", "eval.k=3"])
    assert args.stage == "eval" and args.checkpoint == "step-2" and args.recipe == str(recipe_file)
    assert args.overrides == ["run_name=X", "eval.k=3"]
    args = parse(["export", "train.lr=1", "--recipe", str(recipe_file), "--format", "hf", "eval.k=2"])
    assert args.overrides == ["train.lr=1", "eval.k=2"] and args.format == "hf"
    args = parse(["train", "--recipe", str(recipe_file), "--restart", "train.max_steps=3"])
    assert args.restart and args.overrides == ["train.max_steps=3"]
    args = parse(["report", "run_name=a", "--recipe", str(recipe_file), "--runs", "a", "b", "eval.k=3"])
    assert args.runs == ["a", "b"] and args.overrides == ["eval.k=3", "run_name=a"]


def test_no_stage_prints_help(capsys):
    assert main([]) == 2
    assert "prepare" in capsys.readouterr().out


def test_config_prints_the_resolved_recipe(recipe_file, capsys, tmp_path):
    assert main(["config", "--recipe", str(recipe_file), "train.max_steps=7", "run_name=exp",
                 f"output_dir={tmp_path / 'out'}"]) == 0
    out = capsys.readouterr().out
    tree = yaml.safe_load(out)
    assert tree["train"]["max_steps"] == 7 and tree["run_name"] == "exp"
    assert tree["train"]["lr"] == pytest.approx(3e-4)  # defaults filled in
    assert tree["draft"]["ttt_steps"] == 7 and tree["output_dir"] == str(tmp_path / "out")
    assert f"# run directory: {tmp_path / 'out' / 'exp'}" in out
    # what it prints is itself a recipe that resolves to the same thing
    again = tmp_path / "again.yaml"
    again.write_text(out)
    assert load_recipe(again).model_dump() == load_recipe(recipe_file, ["train.max_steps=7", "run_name=exp",
                                                                        f"output_dir={tmp_path / 'out'}"]).model_dump()


def test_output_dir_in_the_recipe_wins_over_the_default(recipe_file, tmp_path):
    r = load_recipe(recipe_file)
    assert r.run_dir.name == "r" and r.output_dir is None
    r = load_recipe(recipe_file, [f"output_dir={tmp_path}/runs"])
    assert r.run_dir == Path(tmp_path) / "runs" / "r"


def test_strict_device_env_wraps_the_stage(recipe_file, monkeypatch):
    """SPECDISTILL_STRICT_DEVICE=1 (make gpu-check) runs the stage in device.strict_device(): a tensor made in
    project code without device= stops it, naming file:line; without the variable the same stage runs."""
    from specdistill import config_stage, device

    where = device.PROJECT_ROOT / "specdistill" / "probe_stage.py"  # a stage of the project (never written)
    namespace = {}
    exec(compile("import torch\ndef run(recipe, args):\n    torch.zeros(1)\n", str(where), "exec"), namespace)
    monkeypatch.setattr(config_stage, "run", namespace["run"])
    monkeypatch.delenv("SPECDISTILL_STRICT_DEVICE", raising=False)
    assert main(["config", "--recipe", str(recipe_file)]) == 0
    monkeypatch.setenv("SPECDISTILL_STRICT_DEVICE", "1")
    with pytest.raises(device.StrictDeviceError, match=r"specdistill/probe_stage\.py:3: torch\.zeros"):
        main(["config", "--recipe", str(recipe_file)])


@pytest.mark.parametrize("module", ["specdistill.train.loop", "specdistill.data.cache"])
def test_launcher_ranks_honour_the_strict_device_env(module, recipe_file, monkeypatch):
    """The processes the DeepSpeed launcher starts (training, an N-GPU cache pass) run their stage under the
    strict mode too when SPECDISTILL_STRICT_DEVICE=1 reaches them in their environment."""
    import importlib

    from specdistill import device
    from specdistill import processes

    rank_main = importlib.import_module(module)
    where = device.PROJECT_ROOT / "specdistill" / "probe_stage.py"  # a stage of the project (never written)
    namespace = {}
    exec(compile("import torch\ndef stage(*args, **kwargs):\n    torch.zeros(1)\n", str(where), "exec"), namespace)
    monkeypatch.setattr(rank_main, "train" if module.endswith("loop") else "stage", namespace["stage"])
    monkeypatch.setattr(processes, "join", lambda device: (0, 1))
    monkeypatch.delenv("SPECDISTILL_STRICT_DEVICE", raising=False)
    assert rank_main.main(["--recipe", str(recipe_file)]) == 0
    monkeypatch.setenv("SPECDISTILL_STRICT_DEVICE", "1")
    with pytest.raises(device.StrictDeviceError, match=r"specdistill/probe_stage\.py:3: torch\.zeros"):
        rank_main.main(["--recipe", str(recipe_file)])
