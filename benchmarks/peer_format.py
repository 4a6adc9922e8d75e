"""Our cache in vllm-project/speculators' offline training format (a format adapter for `benchmarks/peer_bench.py`).

What speculators' EAGLE-3 trainer reads from `--data-path` (its `train/data.py ArrowDataset` over
`hs_connectors.FileTransfer`, v0.9.0):
  - a `datasets` dataset saved with `save_to_disk`, torch format, one row per sequence: `input_ids`,
    `loss_mask`, `seq_len` (its sampler packs by `seq_len`); the first `train_data_ratio` of the rows train,
    the rest validate;
  - `hidden_states/hs_<row>.safetensors`: `token_ids` [T] and `hidden_states` [T, A + 1, H], the A aux
    layers' states then the target's last layer output *before* its final norm (vLLM's extraction; the
    trainer applies the verifier's norm and LM head to it to get its targets).
Our cache stores the aux states under the same convention (hidden_states[L], the input of layer L) but the
last state *after* the final norm (`hidden_last`: lm_head(hidden_last) = logits). RMSNorm ignores the scale
of its input, so hidden_last / norm.weight is a pre-norm state that the trainer's norm maps back to
hidden_last (up to its eps, i.e. exactly where the states' mean square is >> eps, as a trained target's
are): that is what the last slot holds.

Rows are our train split then our held-out split, so the trainer's validation split is our held-out split
(`train_data_ratio` from `split_ratio`).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from specdistill.data.cache_reader import CacheDataset
from specdistill.errors import SpecdistillError
from specdistill.formats import write_json_atomic, write_safetensors

SPLITS = ("train", "heldout")


def split_ratio(n_train: int, n_total: int) -> float:
    """speculators' `train_data_ratio` that makes int(n_total * ratio) == n_train exactly."""
    return (n_train + 0.5) / n_total


def pre_norm_state(hidden_last: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    """A state x with norm(x) * w == hidden_last: hidden_last / w (RMSNorm is scale-invariant)."""
    return (hidden_last.float() / norm_weight.float()).to(hidden_last.dtype)


def bytes_needed(data: CacheDataset) -> int:
    """Bytes of the hidden-state files for one split: per token the aux states and the last state."""
    if not len(data):
        return 0
    item = data[0]
    per_token = (item["hidden_aux"][0].numel() + item["hidden_last"][0].numel()) * item["hidden_aux"].element_size()
    return sum(data.lengths) * per_token


def write_offline_data(cache_dir: Path, out: Path, norm_weight: torch.Tensor) -> dict:
    """Write our cache at `cache_dir` as speculators' offline data under `out`; returns rows per split."""
    from datasets import Dataset

    if not bool((norm_weight != 0).all()):
        raise SpecdistillError(f"{cache_dir}: the target's final norm has zero weights; its last state cannot be "
                               f"un-normed for speculators' trainer")
    splits = {split: CacheDataset(cache_dir, split) for split in SPLITS}
    for split, data in splits.items():
        missing = {"hidden_aux", "hidden_last"} - set(data.kinds)
        if missing:
            raise SpecdistillError(f"{cache_dir}: the {split} split has no {', '.join(sorted(missing))}; "
                                   f"speculators' EAGLE-3 trainer needs cache.store [hidden_aux, hidden_last]")
    states = Path(out) / "hidden_states"
    states.mkdir(parents=True, exist_ok=True)
    need, free = sum(map(bytes_needed, splits.values())), shutil.disk_usage(states).free
    if need > free:
        raise SpecdistillError(f"{out}: speculators' copy of the cache needs {need / 2**30:.1f} GiB, the disk has "
                               f"{free / 2**30:.1f} GiB free")
    columns = {"input_ids": [], "loss_mask": [], "seq_len": []}
    for data in splits.values():
        for i in range(len(data)):
            item = data[i]
            ids = item["input_ids"].long()
            last = pre_norm_state(item["hidden_last"], norm_weight)[:, None]
            row = len(columns["seq_len"])
            write_safetensors(states / f"hs_{row}.safetensors",
                              {"token_ids": ids, "hidden_states": torch.cat([item["hidden_aux"], last], 1).contiguous()})
            columns["input_ids"].append(ids.tolist())
            columns["loss_mask"].append(item["loss_mask"].long().tolist())
            columns["seq_len"].append(len(ids))
    dataset = Dataset.from_dict(columns)
    dataset.set_format(type="torch")
    dataset.save_to_disk(str(out))
    counts = {split: len(data) for split, data in splits.items()}
    summary = {"rows": counts, "train_data_ratio": split_ratio(counts["train"], sum(counts.values())),
               "tokens": sum(columns["seq_len"]), "bytes": need}
    write_json_atomic(Path(out) / "specdistill_source.json", {"cache": str(cache_dir), **summary})
    return summary
