"""One reader and one writer per on-disk format (docs/DESIGN.md), used by the stages and by the tests'
fixtures alike, so that nothing re-encodes a format by hand. Paths come from specdistill/layout.py.

  corpus summary   corpus/summary.json                      (data/prepare.py writes the DatasetDict beside it)
  cache            cache/manifest.json, cache/<split>/shard-NNNNN.safetensors
  checkpoint       step-XXXXXXX/{draft.safetensors, draft_config.json, metrics.json, COMPLETE}
                   (train/checkpoint.py adds ds/, DeepSpeed's own state)
  eval result      eval/<checkpoint>.json
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specdistill import faults, integrity
from specdistill.errors import SpecdistillError


def write_json_atomic(path: Path, obj) -> None:
    """Write JSON under a temp name, then rename: a reader never sees half a file."""
    write_text_atomic(path, json.dumps(obj, indent=1))


def write_text_atomic(path: Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
    except OSError as e:  # disk full: the old file stays whole, no temp file is left
        tmp.unlink(missing_ok=True)
        raise SpecdistillError(faults.write_failed(path, e, "the previous version is kept; rerun once there is room")) from None
    os.replace(tmp, path)


def read_json(path: Path):
    try:
        return json.loads(Path(path).read_text())
    except OSError as e:
        raise SpecdistillError(f"{path}: cannot read ({e})") from None
    except json.JSONDecodeError as e:
        raise SpecdistillError(f"{path}: not valid JSON ({e})") from None


# ---- corpus summary -----------------------------------------------------------------------------------

def write_corpus_summary(corpus_dir: Path, summary: dict) -> None:
    write_json_atomic(Path(corpus_dir) / "summary.json", summary)


def read_corpus_summary(corpus_dir: Path) -> dict | None:
    path = Path(corpus_dir) / "summary.json"
    return read_json(path) if path.exists() else None


# ---- cache manifest -----------------------------------------------------------------------------------

def write_manifest(cache_dir: Path, manifest: dict) -> None:
    write_json_atomic(Path(cache_dir) / "manifest.json", manifest)


def read_manifest(cache_dir: Path) -> dict | None:
    """The cache's manifest, None where there is none (no cache yet)."""
    path = Path(cache_dir) / "manifest.json"
    return read_json(path) if path.exists() else None


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


def write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> dict:
    """One cache shard (whole sequences on a flat token axis, with `seq_lens`), written under a temp name
    and renamed; returns its manifest entry (with the checksums integrity.py reads back). A failed write
    (disk full) leaves no temp file behind and stops with one line."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        faults.point("shard", int(path.stem.rsplit("-", 1)[-1]))
        save_file(tensors, str(tmp))
    except Exception as e:
        tmp.unlink(missing_ok=True)
        raise SpecdistillError(faults.write_failed(path, e, "rerun `specdistill cache` once there is room: it "
                                                   "resumes after the last complete shard")) from None
    os.replace(tmp, path)
    return {"file": path.name, "sequences": int(tensors["seq_lens"].numel()),
            "tokens": int(tensors["input_ids"].numel()), **integrity.file_digest(path)}


def read_shard(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


# ---- checkpoint ---------------------------------------------------------------------------------------

def write_checkpoint(step_dir: Path, own_state: dict[str, torch.Tensor], draft_config: dict, metrics: dict) -> None:
    """The draft's files of a checkpoint, COMPLETE last: it records the size and sha256 of every file in
    step_dir (DeepSpeed's ds/ included when it was written first), which readers check before trusting
    the checkpoint. draft_config: {kind, config (the draft's own config dict), step, ...}; metrics:
    {step, heldout: {...}, ...}."""
    step_dir = Path(step_dir)
    step_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in own_state.items()}, str(step_dir / "draft.safetensors"))
    write_json_atomic(step_dir / "draft_config.json", draft_config)
    write_json_atomic(step_dir / "metrics.json", metrics)
    files = integrity.digest_tree(step_dir, skip=("COMPLETE",))
    write_json_atomic(step_dir / "COMPLETE", {"step": draft_config.get("step"), "files": files})


def read_draft_config(step_dir: Path) -> dict:
    """draft_config.json of a checkpoint, with its `kind` and `config` checked to be there."""
    path = Path(step_dir) / "draft_config.json"
    if not path.is_file():
        raise SpecdistillError(f"{step_dir}: no draft_config.json (not a checkpoint)")
    cfg = read_json(path)
    for key in ("kind", "config"):
        if key not in cfg:
            raise SpecdistillError(f"{path}: missing key '{key}'")
    return cfg


def read_checkpoint(step_dir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(draft_config, the draft's own tensors) of a complete checkpoint whose draft files match their checksums."""
    step_dir = Path(step_dir)
    if not (step_dir / "COMPLETE").exists():
        raise SpecdistillError(f"{step_dir}: checkpoint is incomplete (no COMPLETE marker)")
    integrity.check_checkpoint(step_dir, only=DRAFT_FILES)
    return read_draft_config(step_dir), load_file(str(step_dir / "draft.safetensors"))


DRAFT_FILES = ("draft.safetensors", "draft_config.json", "metrics.json")  # what eval and export read


def checkpoint_fingerprint(step_dir: Path) -> str:
    """sha256 (16 hex) of what defines a checkpoint: its weights, its config and its offline metrics."""
    h = hashlib.sha256()
    for name in DRAFT_FILES:
        f = Path(step_dir) / name
        h.update(name.encode())
        if f.is_file():
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()[:16]


def read_metrics(step_dir: Path) -> dict | None:
    path = Path(step_dir) / "metrics.json"
    return read_json(path) if path.is_file() else None


# ---- eval result --------------------------------------------------------------------------------------

def write_eval(path: Path, result: dict) -> None:
    write_json_atomic(path, result)


def read_eval(path: Path) -> dict:
    """An eval result, checked for what every reader needs (checkpoint, step, results with temperatures)."""
    data = read_json(path)
    for key in ("checkpoint", "step", "results"):
        if key not in data:
            raise SpecdistillError(f"{path}: missing key '{key}'")
    if not isinstance(data["results"], list) or not data["results"]:
        raise SpecdistillError(f"{path}: key 'results' must be a non-empty list")
    for i, r in enumerate(data["results"]):
        if not isinstance(r, dict) or "temperature" not in r:
            raise SpecdistillError(f"{path}: results[{i}] has no 'temperature'")
    data["_file"] = str(path)
    return data
