"""cache.mode online: the cache stage stores tokens only and training computes the target's outputs in the
step; the losses equal offline training's on the same data to float tolerance."""
from __future__ import annotations

import json

import pytest

from specdistill import kinds
from specdistill.cli import main
from specdistill.formats import read_manifest
from tests.helpers import draft_section
from tests.test_other_targets import CHAT


def run(tmp_path, target_dir, kind: str, mode: str) -> tuple[list[dict], dict, dict]:
    corpus = tmp_path / "chat.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in CHAT))
    draft = draft_section(kind)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"output_dir: {tmp_path / 'runs'}\ntarget: {{path: {target_dir}}}\n"
                      f"corpus: {{path: {corpus}, format: messages, max_length: 64, heldout_fraction: 0.2}}\n"
                      f"cache: {{dtype: float32, mode: {mode}, topk: 8}}\ndraft: {draft}\n"
                      f"train: {{max_steps: 3, save_every: 3, micro_batch_size: 4, warmup_steps: 1, log_every: 1}}\n")
    name = f"{kind}-{mode}"
    for stage in ("prepare", "cache", "train"):
        assert main([stage, "--recipe", str(recipe), f"run_name={name}"]) == 0, stage
    run_dir = tmp_path / "runs" / name
    log = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    manifest = read_manifest(run_dir / "cache")
    metrics = json.loads((run_dir / "step-0000003" / "metrics.json").read_text())["heldout"]
    return log, manifest, metrics


@pytest.mark.parametrize("kind", kinds.KIND_NAMES)
def test_online_training_matches_offline(tmp_path, tiny_target_dir, monkeypatch, kind):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    off, off_manifest, off_metrics = run(tmp_path, tiny_target_dir, kind, "offline")
    on, on_manifest, on_metrics = run(tmp_path, tiny_target_dir, kind, "online")
    assert on_manifest["mode"] == "online" and on_manifest["store"] == [] and off_manifest["store"]
    assert on_manifest["online"]["store"] == off_manifest["store"]
    assert sum(on_manifest["bytes_per_token"].values()) == 5  # tokens and masks only
    assert [r["step"] for r in on] == [1, 2, 3]
    for a, b in zip(off, on):
        for key in a:
            if key in ("lr", "step") or "loss" in key or key in ("fkl", "tvd", "feature_smooth_l1", "distribution") \
                    or key.startswith("step"):
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
    for key, value in off_metrics.items():
        if isinstance(value, float):
            assert on_metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
