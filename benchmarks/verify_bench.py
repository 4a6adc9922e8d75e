"""What checking a cache against its checksums costs (specdistill/integrity.py): seconds per GiB.

Writes a synthetic cache of --gib GiB (bf16 hidden states in 256 MiB shards, through the cache's own
shard writer, which records the checksums), then times each `cache.verify` mode over it, and projects
the sampled check to a 1 TiB cache (a 1/64 share of its blocks plus every shard's size and header).
The files were just written, so they are read from the page cache: this is the hashing cost (wall
and CPU time: on a shared machine the CPU time is the steadier figure); a cold read is bounded by the
disk as well. Run: `.venv/bin/python -m benchmarks.verify_bench --gib 2`.
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from specdistill import integrity
from specdistill.formats import shard_name, write_shard

SHARD_BYTES = 256 << 20


def make_cache(root: Path, gib: float) -> dict:
    tokens = SHARD_BYTES // (2 * 4096)
    shards = []
    g = torch.Generator().manual_seed(0)
    (root / "train").mkdir(parents=True)
    for i in range(max(1, int(gib * (1 << 30) / SHARD_BYTES))):
        tensors = {"hidden_last": torch.randn(tokens, 4096, generator=g).to(torch.bfloat16),
                   "input_ids": torch.zeros(tokens, dtype=torch.int32), "seq_lens": torch.tensor([tokens])}
        shards.append(write_shard(root / "train" / shard_name(i), tensors))
    return {"splits": {"train": {"shards": shards}}}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--dir", default=None, help="where to write the synthetic cache (default: a temp dir)")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="verify-bench-", dir=args.dir))
    try:
        t0 = time.time()
        manifest = make_cache(root, args.gib)
        size = sum(s["bytes"] for s in manifest["splits"]["train"]["shards"]) / (1 << 30)
        print(f"wrote {size:.2f} GiB in {len(manifest['splits']['train']['shards'])} shards "
              f"(writing + checksums) in {time.time() - t0:.1f} s")
        t0, c0 = time.time(), time.process_time()
        assert not integrity.cache_problems(root, manifest, "full")
        full_per_gib = (time.time() - t0) / size
        cpu_per_gib = (time.process_time() - c0) / size
        t0 = time.time()
        assert not integrity.cache_problems(root, manifest, "none")
        header_per_shard = (time.time() - t0) / len(manifest["splits"]["train"]["shards"])
        tib_shards = (1 << 40) / SHARD_BYTES
        print(f"cache.verify full: {full_per_gib:.3f} s/GiB wall ({1 / full_per_gib:.2f} GiB/s), "
              f"{cpu_per_gib:.3f} CPU-s/GiB; "
              f"none (sizes and headers only): {header_per_shard * 1000:.2f} ms per shard")
        projected = 1024 * integrity.SAMPLE_FRACTION * full_per_gib + tib_shards * header_per_shard
        print(f"cache.verify sample, projected for 1 TiB in {SHARD_BYTES >> 20} MiB shards: {projected:.0f} s "
              f"(1/64 of the data hashed at {full_per_gib:.3f} s/GiB + {tib_shards:.0f} headers)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
