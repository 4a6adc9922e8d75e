"""Checkpoint housekeeping: keep_last, the `best` link, refusing a rerun with other settings, --restart."""
from __future__ import annotations

import argparse
import json

import pytest

from specdistill import layout
from specdistill.errors import SpecdistillError
from tests.test_train import checkpoints_root, make_recipe, write_cache  # noqa: F401  (fixture)


def test_keep_last_and_best_link(tmp_path, tiny_target_dir, checkpoints_root):
    from specdistill.train import checkpoint, launch

    recipe = make_recipe(tmp_path, tiny_target_dir, "keep", max_steps=4, save_every=1, keep_last=2,
                         best_metric="fkl")
    write_cache(recipe.run_dir, tiny_target_dir)
    launch.run(recipe)
    steps = layout.checkpoints(recipe.run_dir)
    assert len(steps) == 4
    with_state = [p.name for p in steps if (p / "ds").exists()]
    assert with_state == ["step-0000003", "step-0000004"]  # at most keep_last hold optimizer state
    assert all((p / "draft.safetensors").exists() and (p / "metrics.json").exists() for p in steps)
    fkl = {p.name: json.loads((p / "metrics.json").read_text())["heldout"]["fkl"] for p in steps}
    best = layout.best_link(recipe.run_dir)
    assert best.is_symlink() and best.resolve().name == min(fkl, key=fkl.get)
    stated = json.loads((recipe.run_dir / "best.json").read_text())
    assert stated == {"checkpoint": best.resolve().name, "metric": "heldout.fkl", "value": min(fkl.values()),
                      "rule": "lowest"}
    assert checkpoint.lower_is_better("tvd") and not checkpoint.lower_is_better("predicted_alpha")
    from specdistill.layout import select_checkpoint

    assert select_checkpoint(recipe.run_dir, "best") == best.resolve()


def test_rerun_with_other_settings_stops_and_restart_starts_over(tmp_path, tiny_target_dir, checkpoints_root):
    from specdistill.train import launch

    recipe = make_recipe(tmp_path, tiny_target_dir, "rerun", max_steps=2, save_every=2)
    write_cache(recipe.run_dir, tiny_target_dir)
    launch.run(recipe)
    changed = make_recipe(tmp_path, tiny_target_dir, "rerun", max_steps=2, save_every=2, lr=0.01)
    with pytest.raises(SpecdistillError, match=r"other settings \(train.lr: 0.003 -> 0.01\).*--restart"):
        launch.run(changed)
    # going on for longer is a resumption, not a change of settings
    longer = make_recipe(tmp_path, tiny_target_dir, "rerun", max_steps=4, save_every=2)
    history = launch.run(longer)
    assert [r["step"] for r in history] == [3, 4]
    history = launch.run(changed, argparse.Namespace(restart=True))
    assert [r["step"] for r in history] == [1, 2]
    assert [p.name for p in layout.checkpoints(recipe.run_dir)] == ["step-0000002"]
    launch.run(changed)  # the restarted run resumes under its own settings: nothing left to do, no error
