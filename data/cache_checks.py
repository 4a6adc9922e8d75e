"""What the cache stage checks before it reuses or writes a cache: the fingerprints it was made from, the disk
it needs, which shards are there whole, and a complete cache against its checksums (bad shards set aside)."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from specdistill import device as devices
from specdistill import integrity
from specdistill.data.prepare import SPLITS
from specdistill.errors import SpecdistillError


def check_fingerprints(old: dict, new: dict, cache_path: Path) -> None:
    """A cache made from anything else is never reused: name the part that differs."""
    labels = {"target": "target", "tokenizer": "tokenizer", "corpus": "prepared corpus", "cache": "cache configuration"}
    for key, label in labels.items():
        if old.get(key) != new.get(key):
            if key == "cache":
                diff = sorted(k for k in set(old[key] or {}) | set(new[key]) if (old[key] or {}).get(k) != new[key].get(k))
                detail = f"keys {', '.join('cache.' + k for k in diff)}"
            else:
                detail = f"was {old.get(key)}, now {new.get(key)}"
            raise SpecdistillError(f"{cache_path}: this cache was made with a different {label} ({detail}), "
                                   f"so it is not reused; "
                                   f"delete {cache_path} to rebuild it, or use another run_name")


def check_disk(path: Path, tokens: int, per_token: dict[str, int]) -> int:
    need = tokens * sum(per_token.values())
    free = shutil.disk_usage(path).free
    if need > free:
        raise SpecdistillError(f"{path}: the cache needs about {need / 2**30:.2f} GiB but only "
                               f"{free / 2**30:.2f} GiB is free; free space, store fewer kinds (cache.store), "
                               f"or lower corpus.max_rows")
    return need


def completed_shards(manifest: dict, split: str, cache_path: Path) -> list[dict]:
    """The manifest's finished shards of a split whose files are still there, whole."""
    kept = []
    for shard in manifest["splits"][split]["shards"]:
        f = cache_path / split / shard["file"]
        if not f.exists() or f.stat().st_size != shard["bytes"]:
            break
        kept.append(shard)
    return kept


def bad_shards_set_aside(cache_path: Path, manifest: dict, mode: str) -> bool:
    """Check a complete cache against its checksums (integrity.py, recipe cache.verify); name each bad shard and
    move it aside (`.corrupt`), so the build under the lock rebuilds exactly those. True when any was bad."""
    bad = integrity.cache_problems(cache_path, manifest, mode)
    for _, _, line in bad:
        print(f"corrupt cache shard, to be rebuilt: {line}", flush=True)
    integrity.quarantine(cache_path, manifest, bad)
    return bool(bad)


def bad_on_reuse(cache_path: Path, manifest: dict, mode: str, rank: int, world: int) -> bool:
    """Before reusing a complete cache: rank 0 checks it (and sets bad shards aside); every rank learns the answer."""
    bad = bad_shards_set_aside(cache_path, manifest, mode) if rank == 0 else False
    if world > 1:
        import torch.distributed as dist

        on = devices.resolve("cuda") if dist.get_backend() == "nccl" else torch.device("cpu")  # NCCL: GPU tensors only
        flag = torch.tensor([float(bad)], device=on)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        bad = bool(flag.item())
    return bad


def missing_shards(cache_path: Path, manifest: dict) -> dict[str, list[int]]:
    """Per split, the indices of a complete cache's shards that are not there whole (moved aside, lost)."""
    out = {}
    for s in SPLITS:
        gone = [i for i, sh in enumerate(manifest["splits"][s]["shards"])
                if integrity.check_file(cache_path / s / sh["file"], sh, blocks=[])]
        if gone:
            out[s] = gone
    return out
