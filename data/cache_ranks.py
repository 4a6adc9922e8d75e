"""The cache pass as N processes (one per GPU): rank r computes every N-th shard and records it in
`ranks/rank-R.json`; rank 0 merges them into the one manifest once all are done."""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch
from tqdm import tqdm

from specdistill import device as devices
from specdistill.data.cache_checks import check_disk
from specdistill.data.prepare import SPLITS
from specdistill.data.target_pass import compute_shard
from specdistill.errors import SpecdistillError
from specdistill.formats import read_json, read_manifest, shard_name, write_json_atomic, write_manifest, write_shard


def barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def rank_shards(planned: int, rank: int, world: int) -> list[int]:
    """The shard indices rank `rank` of `world` computes: every world-th, so each rank gets short and long ones."""
    return list(range(rank, planned, world))


def rank_file(cache_path: Path, rank: int) -> Path:
    return cache_path / "ranks" / f"rank-{rank}.json"


def finished_by_ranks(manifest: dict, cache_path: Path) -> dict[str, dict[int, dict]]:
    """Per split, shard index -> manifest entry of every whole shard finished so far: the manifest's own and those
    in the rank files of an interrupted N-process run (any N: an entry is a shard's, whoever computed it)."""
    found = {s: {i: sh for i, sh in enumerate(manifest["splits"][s]["shards"])} for s in SPLITS}
    for f in sorted((cache_path / "ranks").glob("rank-*.json")):
        for s, entries in (read_json(f) or {}).items():
            found[s].update({int(i): sh for i, sh in entries.items()})
    for s in SPLITS:  # keep only shards whose file is still there, whole
        found[s] = {i: sh for i, sh in found[s].items() if (cache_path / s / sh["file"]).exists()
                    and (cache_path / s / sh["file"]).stat().st_size == sh["bytes"]}
    return found


def build_ranked(manifest, dd, lengths, total_tokens, cache_path, settings, per_token, plans, model, t0,
                  rank: int, world: int) -> dict:
    """This rank's shards; then rank 0 writes the one manifest with every rank's shards in corpus order."""
    import torch.distributed as dist

    done = finished_by_ranks(manifest, cache_path)
    todo = {s: [i for i in rank_shards(len(plans[s]), rank, world) if i not in done[s]] for s in SPLITS}
    if rank == 0:
        (cache_path / "ranks").mkdir(parents=True, exist_ok=True)
        for s in SPLITS:
            (cache_path / s).mkdir(exist_ok=True)
        check_disk(cache_path, total_tokens - sum(sh["tokens"] for s in SPLITS for sh in done[s].values()), per_token)
        write_manifest(cache_path, manifest)
    barrier()  # folders and manifest exist
    mine = {s: {i: sh for i, sh in done[s].items() if i % world == rank} for s in SPLITS}
    own = sum(sum(lengths[s][j] for j in plans[s][i]) for s in SPLITS for i in todo[s])
    bar = tqdm(total=own, unit="tok", unit_scale=True, desc=f"caching (rank {rank} of {world})", mininterval=1.0,
               disable=rank != 0)
    compute_t0 = time.time()
    for s in SPLITS:
        for i in todo[s]:
            tensors = compute_shard(model, dd[s], plans[s][i], lengths[s], settings, bar)
            mine[s][i] = write_shard(cache_path / s / shard_name(i), tensors)
            write_json_atomic(rank_file(cache_path, rank), {k: {str(i): sh for i, sh in v.items()}
                                                            for k, v in mine.items()})
    bar.close()
    on = devices.resolve("cuda") if dist.get_backend() == "nccl" else torch.device("cpu")  # NCCL: GPU tensors only
    computed = torch.tensor(float(own), dtype=torch.float64, device=on)
    compute_seconds = torch.tensor(time.time() - compute_t0, dtype=torch.float64, device=on)
    dist.all_reduce(computed)  # tokens computed by all ranks
    dist.all_reduce(compute_seconds, op=dist.ReduceOp.MAX)  # the slowest rank's time is the pass's
    computed, compute_seconds = computed.item(), compute_seconds.item()
    barrier()  # every rank's shards are written
    if rank == 0:
        done = finished_by_ranks(manifest, cache_path)
        for s in SPLITS:
            missing = [i for i in range(len(plans[s])) if i not in done[s]]
            if missing:
                raise SpecdistillError(f"{cache_path}: shards {missing} of split {s} are missing after every rank "
                                       f"finished; rerun `specdistill cache` to compute them")
            manifest["splits"][s]["shards"] = [done[s][i] for i in range(len(plans[s]))]
        manifest["complete"] = True
        write_manifest(cache_path, manifest)
        shutil.rmtree(cache_path / "ranks", ignore_errors=True)
    barrier()  # the manifest is complete before any rank returns
    manifest = read_manifest(cache_path)
    manifest["_run"] = {"tokens": total_tokens, "computed_tokens": int(computed), "ranks": world,
                        "seconds": round(time.time() - t0, 2),
                        "tokens_per_s": round(computed / max(compute_seconds, 1e-9), 1)}
    manifest["_path"] = str(cache_path)
    return manifest
