"""One reader and one writer per on-disk format (docs/DESIGN.md), used by the stages and by the tests'
fixtures alike, so that nothing re-encodes a format by hand. Paths come from specdistill/layout.py.

  corpus summary   corpus/summary.json                      (data/prepare.py writes the DatasetDict beside it)
  cache            cache/manifest.json, cache/<split>/shard-NNNNN.safetensors
  checkpoint       step-XXXXXXX/{draft.safetensors, draft_config.json, metrics.json, COMPLETE}
                   (train/checkpoint.py adds ds/, DeepSpeed's own state)
  eval result      eval/<checkpoint>.<prompt set>.<runtime>.json (layout.eval_result)
  run records      train_log.jsonl (append-only), best.json, train_recipe.yaml (train/)
  regeneration     <key>.partial/{inputs.json, replies.jsonl} (data/regenerate.py)
  export           export/<format>/{config.json, model.safetensors, README.md}
  released head    a directory of config.json + *.safetensors (draft.init_from)

torch and safetensors are imported by the functions that read or write tensors, so that the JSON formats
(what `specdistill report` reads) load without torch.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from typing import TYPE_CHECKING

from specdistill import faults, integrity
from specdistill.errors import SpecdistillError

if TYPE_CHECKING:
    import torch


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
    return _read_parsed(path, json.loads, json.JSONDecodeError, "JSON")


def _read_parsed(path: Path, parse, invalid, what: str):
    """parse(the file's text); SpecdistillError naming the file when it cannot be read or parsed."""
    try:
        return parse(Path(path).read_text())
    except OSError as e:
        raise SpecdistillError(f"{path}: cannot read ({e})") from None
    except invalid as e:
        raise SpecdistillError(f"{path}: not valid {what} ({e})".replace("\n", " ")) from None


def append_jsonl(path: Path, records: list[dict]) -> None:
    """Append records as JSON lines (one write: a kill cuts at most the last line; a line an earlier kill cut
    is ended first, so the first new record does not join it and get read as one broken line)."""
    with open(path, "a+b") as fh:
        cut = fh.tell() > 0 and (fh.seek(-1, 2), fh.read(1))[1] != b"\n"
        fh.write(("\n" if cut else "").encode() + "".join(json.dumps(r) + "\n" for r in records).encode())


def write_jsonl(path: Path, records: list[dict]) -> None:
    """Replace a JSON-lines file (atomically) by `records`."""
    write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in records))


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file written by `append_jsonl`; a line a kill cut short is left out (what it
    recorded is redone), [] where there is no file."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for line in filter(str.strip, path.read_text().splitlines()):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def write_yaml(path: Path, obj) -> None:
    import yaml

    write_text_atomic(path, yaml.safe_dump(obj, sort_keys=False))


def read_yaml(path: Path):
    import yaml

    return _read_parsed(path, yaml.safe_load, yaml.YAMLError, "YAML")


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
        write_safetensors(tmp, tensors)
    except Exception as e:
        tmp.unlink(missing_ok=True)
        raise SpecdistillError(faults.write_failed(path, e, "rerun `specdistill cache` once there is room: it "
                                                   "resumes after the last complete shard")) from None
    os.replace(tmp, path)
    return {"file": path.name, "sequences": int(tensors["seq_lens"].numel()),
            "tokens": int(tensors["input_ids"].numel()), **integrity.file_digest(path)}


def read_shard(path: Path, keys=None) -> dict[str, torch.Tensor]:
    """A cache shard's tensors (only `keys`, when given: the others are not read)."""
    if keys is None:
        return read_safetensors(path)
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in keys}


def shard_paths(cache_dir: Path, split: str) -> list[Path]:
    """The shard files of a cache split, in order."""
    return sorted((Path(cache_dir) / split).glob("shard-*.safetensors"))


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)


# ---- checkpoint ---------------------------------------------------------------------------------------

def write_checkpoint(step_dir: Path, own_state: dict[str, torch.Tensor], draft_config: dict, metrics: dict) -> None:
    """The draft's files of a checkpoint, COMPLETE last: it records the size and sha256 of every file in
    step_dir (DeepSpeed's ds/ included when it was written first), which readers check before trusting
    the checkpoint. draft_config: {kind, config (the draft's own config dict), step, ...}; metrics:
    {step, heldout: {...}, ...}."""
    step_dir = Path(step_dir)
    step_dir.mkdir(parents=True, exist_ok=True)
    write_safetensors(step_dir / "draft.safetensors", {k: v.detach().cpu().contiguous() for k, v in own_state.items()})
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
    return read_draft_config(step_dir), read_safetensors(step_dir / "draft.safetensors")


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


# ---- export, released heads ---------------------------------------------------------------------------

def write_export(out: Path, config: dict, state: dict[str, torch.Tensor]) -> None:
    """An export's config.json and model.safetensors (tensors sorted by name, as vLLM and HF write them)."""
    out = Path(out)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_safetensors(out / "model.safetensors", {k: v.contiguous() for k, v in sorted(state.items())},
                      metadata={"format": "pt"})


def write_replay(path: Path, depth: torch.Tensor, summary: dict, made_by: dict) -> None:
    """Draft-OPD's replay (docs/DESIGN.md "Replay"): `depth` int8 [N] and its summary and origin as JSON metadata,
    written under a temp name and renamed."""
    partial = path.with_name(path.name + ".partial")
    write_safetensors(partial, {"depth": depth}, metadata={"summary": json.dumps(summary), "made_by": json.dumps(made_by)})
    os.replace(partial, path)


def read_replay_header(path: Path) -> tuple[dict, dict]:
    """(summary, made_by) of a replay file, without reading its tensor."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    try:
        return json.loads(meta["summary"]), json.loads(meta["made_by"])
    except (KeyError, ValueError):
        raise SpecdistillError(f"{path}: not a replay file (no summary / made_by metadata); train with --restart") from None


def read_replay(path: Path) -> torch.Tensor:
    """A replay file's `depth` [N] int8."""
    return read_safetensors(path)["depth"]


def read_released_head(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, every *.safetensors merged) of a head directory; SpecdistillError naming what is missing."""
    d = Path(path).expanduser()
    if not (d / "config.json").is_file():
        raise SpecdistillError(f"draft.init_from {path}: expected a directory with config.json and *.safetensors "
                               f"(a released or exported head)")
    integrity.check_export(d, "draft.init_from: ")  # an export of ours carries SHA256SUMS: a corrupt one is refused
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise SpecdistillError(f"draft.init_from {path}: no .safetensors weight files")
    state = {}
    for f in files:
        state.update(read_safetensors(f))
    return read_json(d / "config.json"), state
