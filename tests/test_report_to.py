"""train.report_to: TensorBoard always; wandb / mlflow when installed (stand-ins here), offline by default,
a note and no failure when they are not."""
from __future__ import annotations

import importlib.machinery
import sys
import types

from specdistill.recipe import load_recipe
from specdistill.train.report_to import Reporters


def recipe(tmp_path, report_to: str):
    p = tmp_path / "r.yaml"
    p.write_text(f"run_name: rt\noutput_dir: {tmp_path}\ntarget: {{path: x}}\ncorpus: {{path: y}}\n"
                 f"draft: {{kind: eagle}}\ntrain: {{max_steps: 1, save_every: 1, report_to: {report_to}}}\n")
    return load_recipe(p)


def fake(name: str, calls: list, **attrs):
    m = types.ModuleType(name)
    m.__spec__ = importlib.machinery.ModuleSpec(name, None)
    for k, v in attrs.items():
        setattr(m, k, (lambda k, v: lambda *a, **kw: calls.append((name, k, a, kw)) or v(*a, **kw))(k, v))
    return m


def test_missing_trackers_are_a_note_not_a_failure(tmp_path, capsys, monkeypatch):
    for name in ("wandb", "mlflow"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails: "not installed"
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name in ("wandb", "mlflow") else
                        importlib.machinery.PathFinder.find_spec(name))
    r = Reporters(recipe(tmp_path, "[tensorboard, wandb, mlflow]"), tmp_path / "tb")
    r.add_scalar("train/loss", 1.5, 1)
    r.close()
    out = capsys.readouterr().out
    assert "wandb is not installed" in out and "mlflow is not installed" in out
    assert list((tmp_path / "tb").glob("events.*"))


def test_wandb_and_mlflow_get_the_same_scalars_offline(tmp_path, monkeypatch):
    calls: list = []
    run = types.SimpleNamespace(log=lambda d, step: calls.append(("wandb", "log", d, step)),
                                finish=lambda: calls.append(("wandb", "finish")))
    monkeypatch.setitem(sys.modules, "wandb", fake("wandb", calls, init=lambda **kw: run))
    monkeypatch.setitem(sys.modules, "mlflow", fake("mlflow", calls, set_tracking_uri=lambda u: None,
                                                    set_experiment=lambda n: None, start_run=lambda **kw: None,
                                                    log_params=lambda p: None, log_metric=lambda *a, **kw: None,
                                                    end_run=lambda: None))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    r = Reporters(recipe(tmp_path, "[tensorboard, wandb, mlflow]"), tmp_path / "tb")
    r.add_scalar("heldout/fkl", 0.25, 3)
    r.close()
    init = next(c for c in calls if c[:2] == ("wandb", "init"))
    assert init[3]["mode"] == "offline" and init[3]["config"]["train"]["report_to"] == ["tensorboard", "wandb", "mlflow"]
    assert ("wandb", "log", {"heldout/fkl": 0.25}, 3) in calls and ("wandb", "finish") in calls
    uri = next(c for c in calls if c[:2] == ("mlflow", "set_tracking_uri"))[2][0]
    assert uri.startswith("file://") and uri.endswith("/rt/mlruns")
    assert any(c[:2] == ("mlflow", "log_metric") and c[2] == ("heldout/fkl", 0.25) and c[3] == {"step": 3} for c in calls)
    assert list((tmp_path / "tb").glob("events.*"))
