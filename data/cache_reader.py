"""Read a cache written by `specdistill cache`: one sequence per item, sliced lazily from the shards.

Shards are opened with safetensors' `safe_open` (memory-mapped) and only the rows of the requested
sequence are read, so a cache larger than RAM trains fine. Handles are opened on first use in each
process, which keeps the dataset safe to pass to DataLoader workers.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch.utils.data import Dataset

from specdistill.data.target_pass import target_outputs
from specdistill.errors import SpecdistillError
from specdistill.formats import read_manifest
from specdistill.target import DTYPES, load_target, one_device_shortfall

PER_TOKEN = ("input_ids", "loss_mask", "hidden_last", "hidden_aux", "topk_logprobs", "topk_ids", "tail_mass")
AS_LONG = ("input_ids", "loss_mask", "topk_ids")  # integer tensors come back as int64, ready for indexing


class CacheDataset(Dataset):
    def __init__(self, cache_dir, split: str = "train"):
        self.cache_dir = Path(cache_dir)
        self.manifest = read_manifest(self.cache_dir)
        if self.manifest is None:
            raise SpecdistillError(f"{self.cache_dir}: no cache manifest; run `specdistill cache --recipe ...` first")
        if not self.manifest.get("complete"):
            raise SpecdistillError(f"{self.cache_dir}: the cache is incomplete (interrupted?); rerun "
                                   f"`specdistill cache` to finish it")
        if split not in self.manifest["splits"]:
            raise SpecdistillError(f"{self.cache_dir}: no split '{split}'; have {sorted(self.manifest['splits'])}")
        self.split = split
        self.files = [self.cache_dir / split / s["file"] for s in self.manifest["splits"][split]["shards"]]
        self.kinds = [k for k in PER_TOKEN if k in self._open(0).keys()] if self.files else []
        self.lengths: list[int] = []  # tokens per sequence, over all shards
        self._locate = []  # per sequence: (shard, first token)
        for s, f in enumerate(self.files):
            lens = self._open(s).get_tensor("seq_lens").tolist()
            starts = [0]
            for n in lens[:-1]:
                starts.append(starts[-1] + n)
            self._locate.extend((s, a) for a in starts)
            self.lengths.extend(lens)

    def _open(self, s: int):
        handles = self.__dict__.setdefault("_handles", {})
        if s not in handles:
            handles[s] = safe_open(str(self.files[s]), framework="pt")
        return handles[s]

    def __getstate__(self):  # handles stay in their process; workers reopen
        state = dict(self.__dict__)
        state.pop("_handles", None)
        return state

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        s, a = self._locate[i]
        b = a + self.lengths[i]
        f = self._open(s)
        item = {}
        for k in self.kinds:
            t = f.get_slice(k)[a:b]
            item[k] = t.long() if k in AS_LONG else t
        return item


def collate(items: list[dict]) -> dict[str, torch.Tensor]:
    """Pad every per-token tensor with 0 to the longest sequence; attention_mask marks real tokens."""
    longest = max(x["input_ids"].shape[0] for x in items)
    out = {}
    for k in items[0]:
        first = items[0][k]
        padded = first.new_zeros((len(items), longest) + tuple(first.shape[1:]))
        for r, x in enumerate(items):
            padded[r, :x[k].shape[0]] = x[k]
        out[k] = padded
    mask = torch.zeros(len(items), longest, dtype=torch.long, device=items[0]["input_ids"].device)
    for r, x in enumerate(items):
        mask[r, :x["input_ids"].shape[0]] = 1
    out["attention_mask"] = mask
    return out


class OnlineDataset(CacheDataset):
    """`cache.mode: online`: the shards hold tokens only; each item's target outputs (hidden_last, hidden_aux,
    top-k: the manifest's `online.store`) are computed by the target when the item is read, exactly as the
    cache stage would store them (same function, same dtype), so training sees what an offline cache holds."""

    def __init__(self, cache_dir, split: str, target_model):
        super().__init__(cache_dir, split)
        self.online = self.manifest["online"]
        self.target = target_model
        self.kinds = self.kinds + [k for k in PER_TOKEN if k in self._computed_kinds()]

    def _computed_kinds(self) -> set[str]:
        store = set(self.online["store"])
        return ({"hidden_last"} & store) | ({"hidden_aux"} & store) | \
            ({"topk_logprobs", "topk_ids", "tail_mass"} if "topk" in store else set())

    def __getstate__(self):
        raise TypeError("an online cache computes with the target in this process; read it without worker processes")

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        s, a = self._locate[i]
        f = self._open(s)
        item = {k: f.get_slice(k)[a:a + self.lengths[i]] for k in ("input_ids", "loss_mask")}
        item["input_ids"], item["loss_mask"] = item["input_ids"].long(), item["loss_mask"]
        device = next(self.target.parameters()).device
        ids = item["input_ids"][None].to(device)
        out = target_outputs(self.target, ids, torch.ones_like(ids), self.online["store"], self.online["aux_layers"],
                             self.online["k"], DTYPES[self.online["dtype"]])
        for k, v in out.items():
            item[k] = v.long() if k in AS_LONG else v
        item["loss_mask"] = item["loss_mask"].long()
        return item


_TARGETS: dict = {}


def open_cache(cache_dir, split: str, target_cfg=None, device="cpu") -> CacheDataset:
    """The cache at cache_dir: offline shards as they are, or an online one bound to the target (loaded once)."""
    mode = (read_manifest(cache_dir) or {}).get("mode", "offline")
    if mode != "online":
        return CacheDataset(cache_dir, split)
    if target_cfg is None:
        raise SpecdistillError(f"{cache_dir}: an online cache (tokens only) needs the target to compute its features")
    key = (target_cfg.path, target_cfg.dtype, str(device))
    if key not in _TARGETS:
        if short := one_device_shortfall(target_cfg, device):  # each training process holds the whole target
            raise SpecdistillError(f"cache.mode online: {short}: each training process holds the target on its GPU; "
                                   "cache.mode=offline spreads it over the GPUs for the cache pass alone")
        _TARGETS.clear()
        _TARGETS[key] = load_target(target_cfg, device)
    return OnlineDataset(cache_dir, split, _TARGETS[key])
