"""`specdistill cache`: run the target once over the prepared corpus and store what training needs.

Layout (docs/DESIGN.md): cache/manifest.json + cache/<split>/shard-NNNNN.safetensors, each shard a
run of whole sequences on a flat token axis. Shard boundaries depend only on the corpus order and
`cache.shard_tokens`; batches (sorted by length, up to `cache.batch_tokens` padded tokens) are made
inside a shard, so a resumed run computes exactly the batches an uninterrupted one would and the
shards come out byte-identical. A shard is written under a temp name and renamed; the manifest is
rewritten (atomically) after each one, so a crash at any instant loses at most the shard in flight.

The target runs through its decoder only; the LM head is applied to the real (unpadded) tokens and
only when top-k is stored, so a hidden-state cache costs less than a plain forward with logits.

Devices (recipe key `device`): the target, the batches and its outputs live on the device; shards are
written from host copies. On the CPU, and on one GPU, one process runs the pass. With `train.num_gpus` N > 1
GPUs the DeepSpeed launcher starts N processes (`python -m specdistill.data.cache`): rank r computes the
shards i with i % N == r on its own GPU and records them in `ranks/rank-R.json`; rank 0 merges them into
the one manifest once all are done. Shards are the same bytes whichever rank computes them, and a resumed
run keeps every whole shard any rank finished. A target larger than one GPU's free memory is loaded
across the GPUs with accelerate's `device_map="auto"` by one process instead.

One idea per file: this one is the stage (settings, shard plan, the build, resume); the target's pass over a
shard is data/target_pass.py, the checks before reuse data/cache_checks.py, the shared store and its lock
data/cache_shared.py, the N-process pass data/cache_ranks.py.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from specdistill import device as devices
from specdistill import kinds
from specdistill.data.cache_checks import (bad_on_reuse, bad_shards_set_aside, check_disk, check_fingerprints,
                                           completed_shards, missing_shards)
from specdistill.data.cache_ranks import barrier, build_ranked
from specdistill.data.cache_shared import CacheLock, cache_key, cache_settings, link_run_cache, remembered_tokenizer_fingerprint
from specdistill.data.prepare import SPLITS, load_prepared, select_rows
from specdistill.data.regenerate import regenerated_corpus
from specdistill.data.target_pass import compute_shard, load_model
from specdistill.errors import SpecdistillError
from specdistill.formats import read_manifest, shard_name, write_manifest, write_shard, write_yaml
from specdistill.layout import cache_dir, corpus_dir, shared_cache_root
from specdistill.processes import join, launcher_command, process_env, run_ranks
from specdistill.recipe import load_recipe, recipe_dump
from specdistill.strict import strict_device_from_env
from specdistill.target import (DTYPES, fingerprint_target, fingerprint_tokenizer, load_target_config, load_tokenizer,
                                one_device_shortfall, resolve_aux_layers)

MANIFEST_VERSION = 1


# ---------------------------------------------------------------------------------------- settings

def resolve_store(recipe) -> list[str]:
    store = recipe.cache.store if recipe.cache.store is not None else kinds.kind(recipe.draft.kind).STORE
    if not store:
        raise SpecdistillError(f"recipe {recipe.source}: cache.store is empty; store at least one of "
                               f"hidden_last, hidden_aux, topk")
    return sorted(set(store))


def bytes_per_token(store: list[str], hidden: int, num_aux: int, k: int, dtype: torch.dtype) -> dict[str, int]:
    size = torch.finfo(dtype).bits // 8
    out = {"input_ids+loss_mask": 5}
    if "hidden_last" in store:
        out["hidden_last"] = hidden * size
    if "hidden_aux" in store:
        out["hidden_aux"] = num_aux * hidden * size
    if "topk" in store:
        out["topk"] = k * 8 + 4  # float32 log-probs, int32 ids, float32 tail mass
    return out


# ---------------------------------------------------------------------------------------- planning

def plan_shards(lengths: list[int], shard_tokens: int) -> list[range]:
    """Contiguous runs of whole sequences, each closed once it holds >= shard_tokens tokens."""
    shards, start, total = [], 0, 0
    for i, n in enumerate(lengths):
        total += n
        if total >= shard_tokens:
            shards.append(range(start, i + 1))
            start, total = i + 1, 0
    if start < len(lengths):
        shards.append(range(start, len(lengths)))
    return shards


# ---------------------------------------------------------------------------------------- the stage

def build_cache(recipe, corpus_path: Path, cache_path: Path | None, model=None, tokenizer=None,
                shared_root: Path | None = None, rank: int = 0, world: int = 1) -> dict:
    """Cache the target's outputs for the prepared corpus at corpus_path into cache_path (resumable).

    With shared_root, the cache goes to shared_root/<cache_key> instead (cache_path is ignored) and a
    complete one there is reused whatever run made it; manifest["_path"] says where it is.
    rank, world: this process's share of the shards when a launcher started `world` of them.
    """

    t0 = time.time()
    corpus_path, cache_path = Path(corpus_path), (Path(cache_path) if cache_path is not None else None)
    dd, corpus_summary = load_prepared(corpus_path)
    dd, corpus_summary = select_rows(recipe, dd, corpus_summary, corpus_path)
    lengths = {s: [len(x) for x in dd[s]["input_ids"]] for s in SPLITS}
    total_tokens = sum(sum(v) for v in lengths.values())
    if total_tokens == 0:
        raise SpecdistillError(f"{corpus_path}: the prepared corpus is empty; nothing to cache")
    if corpus_summary["splits"]["train"]["assistant_tokens"] == 0:
        raise SpecdistillError(f"{corpus_path}: no trained tokens in the train split (every loss_mask is 0); "
                               f"check the corpus format and column mapping")
    tokenizer_fp = fingerprint_tokenizer(tokenizer) if tokenizer is not None else \
        remembered_tokenizer_fingerprint(recipe, lambda: fingerprint_tokenizer(load_tokenizer(recipe.target)))
    cfg = model.config if model is not None else load_target_config(recipe.target)
    store = resolve_store(recipe)
    aux_layers = resolve_aux_layers(recipe, cfg.num_hidden_layers) if "hidden_aux" in store else []
    online = None
    if recipe.cache.mode == "online":  # shards hold the tokens only; training computes `store` itself
        online = {"store": store, "aux_layers": aux_layers, "dtype": recipe.cache.dtype, "k": recipe.cache.topk}
        store, aux_layers = [], []
    settings = {"store": store, "aux_layers": aux_layers, "dtype": recipe.cache.dtype, "topk": recipe.cache.topk,
                "batch_tokens": recipe.cache.batch_tokens, "online": online}
    fingerprints = {"target": fingerprint_target(recipe.target), "tokenizer": tokenizer_fp,
                    "corpus": corpus_summary["fingerprint"], "cache": cache_settings(recipe, store)}
    if corpus_summary.get("tokenizer") not in (None, fingerprints["tokenizer"]):
        raise SpecdistillError(f"{corpus_path}: prepared with another tokenizer than target {recipe.target.path}'s "
                               f"(fingerprint {corpus_summary['tokenizer']} vs {fingerprints['tokenizer']}); "
                               f"rerun `specdistill prepare`")
    per_token = bytes_per_token(store, cfg.hidden_size, len(aux_layers), recipe.cache.topk,
                                DTYPES[recipe.cache.dtype])
    plans = {s: plan_shards(lengths[s], recipe.cache.shard_tokens) for s in SPLITS}
    if shared_root is not None:
        key = cache_key(fingerprints, store, aux_layers)
        cache_path = Path(shared_root) / key
        manifest = read_manifest(cache_path)
        if manifest is not None and manifest.get("complete"):
            check_fingerprints(manifest["fingerprints"], fingerprints, cache_path)
            if not bad_on_reuse(cache_path, manifest, recipe.cache.verify, rank, world):
                return {**manifest, "_path": str(cache_path), "_reused": True, "_seconds": round(time.time() - t0, 2)}
        if rank == 0:  # one lock per run: rank 0 holds it for all ranks, which wait for it at the first barrier
            with CacheLock(Path(shared_root) / f"{key}.lock"):
                return _build(recipe, dd, lengths, total_tokens, corpus_path, cache_path, fingerprints, settings,
                              store, aux_layers, cfg, per_token, plans, model, t0, rank, world)
    return _build(recipe, dd, lengths, total_tokens, corpus_path, cache_path, fingerprints, settings, store,
                  aux_layers, cfg, per_token, plans, model, t0, rank, world)


def _build(recipe, dd, lengths, total_tokens, corpus_path, cache_path, fingerprints, settings, store, aux_layers,
           cfg, per_token, plans, model, t0, rank: int = 0, world: int = 1) -> dict:
    if world > 1:
        barrier()  # rank 0 holds the run's lock before anyone reads the manifest
    manifest = read_manifest(cache_path)
    bad = {}  # split -> indices of a complete cache's shards to rebuild
    if manifest is not None:
        check_fingerprints(manifest["fingerprints"], fingerprints, cache_path)
        if manifest.get("complete"):
            if rank == 0:
                bad_shards_set_aside(cache_path, manifest, recipe.cache.verify)
            if world > 1:
                barrier()  # bad shards are moved aside before any rank looks
            bad = missing_shards(cache_path, manifest)
            if not bad:
                print(f"cache {cache_path} is complete, matches the recipe and its checksums; nothing to do")
                return {**manifest, "_path": str(cache_path)}
            if world > 1:
                manifest["complete"] = False  # the ranked pass computes the shards that are not there whole
        else:
            for s in SPLITS:
                manifest["splits"][s]["shards"] = completed_shards(manifest, s, cache_path)
    else:
        manifest = {
            "version": MANIFEST_VERSION, "fingerprints": fingerprints, "target_path": recipe.target.path,
            "corpus_path": str(corpus_path), "store": store, "aux_layers": aux_layers, "dtype": recipe.cache.dtype,
            "k": recipe.cache.topk if "topk" in store else None, "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size, "num_hidden_layers": cfg.num_hidden_layers,
            "bytes_per_token": per_token, "complete": False, "mode": "online" if settings["online"] else "offline",
            **({"online": settings["online"]} if settings["online"] else {}),
            "splits": {s: {"sequences": len(lengths[s]), "tokens": sum(lengths[s]), "planned_shards": len(plans[s]),
                           "shards": []} for s in SPLITS},
        }
    if store:  # an online cache holds tokens only: no target needed
        model = model if model is not None else load_model(recipe, devices.resolve(recipe.device))
    if world > 1:
        return build_ranked(manifest, dd, lengths, total_tokens, cache_path, settings, per_token, plans, model,
                             t0, rank, world)
    done_tokens = sum(sh["tokens"] for s in SPLITS for sh in manifest["splits"][s]["shards"])
    cache_path.mkdir(parents=True, exist_ok=True)
    check_disk(cache_path, total_tokens - done_tokens, per_token)
    write_manifest(cache_path, manifest)

    if done_tokens:
        print(f"resuming {cache_path}: {done_tokens:,} of {total_tokens:,} tokens already cached", flush=True)
    bar = tqdm(total=total_tokens, initial=done_tokens, unit="tok", unit_scale=True, desc="caching",
               mininterval=1.0, smoothing=0.1)
    computed_tokens, compute_t0 = 0, time.time()
    for s in SPLITS:
        (cache_path / s).mkdir(exist_ok=True)
        shards = manifest["splits"][s]["shards"]
        for i in [*bad.get(s, []), *range(len(shards), len(plans[s]))]:  # bad shards of a complete cache, then the rest
            tensors = compute_shard(model, dd[s], plans[s][i], lengths[s], settings, bar)
            shards[i:i + 1] = [write_shard(cache_path / s / shard_name(i), tensors)]  # replaces, or appends
            computed_tokens += shards[i]["tokens"]
            write_manifest(cache_path, manifest)
    bar.close()
    manifest["complete"] = True
    write_manifest(cache_path, manifest)
    seconds = time.time() - t0
    compute_seconds = time.time() - compute_t0
    manifest["_run"] = {"tokens": total_tokens, "computed_tokens": computed_tokens, "seconds": round(seconds, 2),
                        "tokens_per_s": round(computed_tokens / max(compute_seconds, 1e-9), 1)}
    manifest["_path"] = str(cache_path)
    return manifest


def print_summary(manifest: dict, cache_path: Path) -> None:
    run = manifest.get("_run", {})
    total = sum(manifest["splits"][s]["tokens"] for s in SPLITS)
    print(f"cached {cache_path}: {total:,} tokens "
          + ", ".join(f"{s} {manifest['splits'][s]['sequences']:,} seqs in {len(manifest['splits'][s]['shards'])} shards"
                      for s in SPLITS))
    per = manifest["bytes_per_token"]
    print("  bytes per token: " + ", ".join(f"{k} {v:,}" for k, v in per.items())
          + f" (total {sum(per.values()):,}, {total * sum(per.values()) / 2**20:.1f} MiB)")
    if run:
        print(f"  {run['seconds']} s, {run['tokens_per_s']:,} tokens/s over {run['computed_tokens']:,} computed tokens")


def cache_processes(recipe, device: torch.device) -> int:
    """How many processes run the pass: one per GPU of `train.num_gpus` on CUDA when the target fits on one;
    otherwise one (the CPU's cores are one process's; a spread target is one process over all GPUs; `cuda:N`
    names one GPU)."""
    if torch.device(device).type != "cuda" or recipe.train.num_gpus <= 1:
        return 1
    if devices.names_one_gpu(recipe.device):  # `device: cuda:N`: the pass runs on that GPU, in this process
        return 1
    return min(recipe.train.num_gpus, torch.cuda.device_count()) if one_device_shortfall(recipe.target, device) is None else 1


def run(recipe, args=None) -> dict:
    device = devices.resolve(recipe.device)  # `device: cuda` without CUDA stops here, naming the key
    processes = cache_processes(recipe, device)
    if processes == 1:
        return stage(recipe, device)
    if recipe.cache.regenerate:  # one process answers the prompts first; the ranks then find it done and reuse it
        model = load_model(recipe, device) if recipe.cache.regenerate_engine == "transformers" else None
        regenerated_corpus(recipe, corpus_dir(recipe.run_dir), shared_cache_root(recipe), model)
        del model
        torch.cuda.empty_cache()
    resolved = recipe.run_dir / "cache_recipe.yaml"  # what every rank loads
    write_yaml(resolved, recipe_dump(recipe))
    done = run_ranks(launcher_command("specdistill.data.cache", ["--recipe", str(resolved)], processes),
                     process_env(device, processes))
    if done.returncode != 0:
        raise SpecdistillError(f"cache: the DeepSpeed launcher exited with status {done.returncode} (see the "
                               f"messages above); rerun `specdistill cache` to resume")
    return read_manifest(cache_dir(recipe.run_dir))


def stage(recipe, device: torch.device, rank: int = 0, world: int = 1) -> dict:
    """The cache stage in this process: the whole pass, or rank `rank`'s share of it."""
    source = corpus_dir(recipe.run_dir)
    link = cache_dir(recipe.run_dir)
    model = None
    if recipe.cache.regenerate:
        # vLLM generates in its own process: the target is loaded here only after it, for the cache pass
        model = load_model(recipe, device) if recipe.cache.regenerate_engine == "transformers" else None
        shared = regenerated_corpus(recipe, source, shared_cache_root(recipe), model)
        regenerated_link = source.with_name("corpus-regenerated")
        if rank == 0 and (regenerated_link.is_symlink() or not regenerated_link.exists()):  # a real folder predates sharing: kept
            link_run_cache(regenerated_link, shared)  # the run's corpus-regenerated -> the shared, fingerprinted one
        source = shared
    if link.is_dir() and not link.is_symlink():  # a run cached inside itself before caches were shared: keep it
        manifest = build_cache(recipe, source, link, model=model, rank=rank, world=world)
        if rank == 0:
            print_summary(manifest, link)
        return manifest
    manifest = build_cache(recipe, source, None, model=model, shared_root=shared_cache_root(recipe), rank=rank,
                           world=world)
    shared = Path(manifest["_path"])
    if rank != 0:
        return manifest
    link_run_cache(link, shared)
    if manifest.get("_reused"):
        print(f"reused the shared cache {shared} (same target, tokenizer, corpus and cache settings): "
              f"nothing computed, {manifest['_seconds']} s; {link} -> it", flush=True)
    print_summary(manifest, link)
    return manifest


def main(argv=None) -> int:
    """One rank of an N-process cache pass (started by the DeepSpeed launcher from `run`)."""

    parser = argparse.ArgumentParser(description="one process of the cache pass (started by the DeepSpeed launcher)")
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--local_rank", type=int, default=None)  # set by the launcher (also in LOCAL_RANK)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        device = devices.resolve(recipe.device)
        rank, world = join(device)
        with strict_device_from_env():  # a launcher rank honours SPECDISTILL_STRICT_DEVICE as `specdistill` does
            stage(recipe, device, rank, world)
    except SpecdistillError as e:
        print(f"specdistill cache: error: {e}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
