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
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from specdistill import device as devices
from specdistill import integrity, kinds
from specdistill.data.prepare import SPLITS, fingerprint, load_prepared, select_rows
from specdistill.data.regenerate import regenerated_corpus
from specdistill.errors import SpecdistillError
from specdistill.formats import (read_json, read_manifest, shard_name, write_json_atomic, write_manifest,
                                 write_shard, write_yaml)
from specdistill.layout import cache_dir, corpus_dir, shared_cache_root
from specdistill.processes import join, launcher_command, process_env, run_ranks
from specdistill.recipe import load_recipe, recipe_dump
from specdistill.strict import strict_device_from_env
from specdistill.target import (DTYPES, fingerprint_target, fingerprint_tokenizer, load_target, load_target_config,
                                load_tokenizer, resolve_aux_layers, resolve_target, target_logits_from_hidden,
                                target_weight_files)

LOGIT_CHUNK = 1024  # tokens per LM-head chunk: bounds the [tokens, vocab] float32 buffer
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


def plan_batches(indices, lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Sort by length (longest first) and fill each batch up to batch_tokens padded tokens."""
    order = sorted(indices, key=lambda i: (-lengths[i], i))
    batches, current = [], []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        if current and (len(current) + 1) * longest > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


# ---------------------------------------------------------------------------------------- compute

def topk_of(model, hidden: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """Top-k log-probs at T=1 (descending), their ids and the probability mass left outside them."""
    values, ids = [], []
    for a in range(0, hidden.shape[0], LOGIT_CHUNK):
        logits = target_logits_from_hidden(model.config, model.get_output_embeddings(), hidden[a:a + LOGIT_CHUNK])
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # capped in the model's dtype, as its own forward does
        v, i = logprobs.topk(k, dim=-1)
        values.append(v)
        ids.append(i)
    values, ids = torch.cat(values), torch.cat(ids)
    tail = (1.0 - values.exp().sum(-1)).clamp_min(0.0)
    return {"topk_logprobs": values.float(), "topk_ids": ids.to(torch.int32), "tail_mass": tail.float()}


def real_rows(hidden: torch.Tensor, valid: torch.Tensor, device) -> torch.Tensor:
    """hidden[valid] ([N, H], real tokens only) on `device`. A target spread with device_map="auto" leaves each
    layer's hidden state on the GPU that computed it and the mask on the first: the small mask goes to the
    state, only the selected rows travel."""
    return hidden[valid.to(hidden.device)].to(device)


@torch.inference_mode()
def target_outputs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, store: list[str],
                   aux_layers: list[int], k: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One padded batch -> the stored kinds for its real tokens, concatenated row by row ([N, ...]).
    Safe for a target spread over devices: each hidden state is masked where it lives, the aux layers are
    stacked on the mask's device, and the final state stays where the final norm ran (the LM head reads it)."""
    need_aux = "hidden_aux" in store
    out = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                              output_hidden_states=need_aux, use_cache=False)
    valid = attention_mask.bool()
    last = real_rows(out.last_hidden_state, valid, out.last_hidden_state.device)
    result = {}
    if "hidden_last" in store:
        result["hidden_last"] = last.to(dtype)
    if need_aux:
        result["hidden_aux"] = torch.stack([real_rows(out.hidden_states[l], valid, valid.device) for l in aux_layers],
                                           dim=1).to(dtype)
    if "topk" in store:
        result.update(topk_of(model, last, k))
    return result


def pad_batch(seqs: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right padding with token 0 (masked out, so its value does not matter); built on the host, one copy over."""
    longest = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), longest, dtype=torch.long, device="cpu")
    mask = torch.zeros(len(seqs), longest, dtype=torch.long, device="cpu")
    for r, s in enumerate(seqs):
        ids[r, :len(s)] = torch.tensor(s, dtype=torch.long, device="cpu")
        mask[r, :len(s)] = 1
    return ids.to(device), mask.to(device)


def compute_shard(model, split_ds, indices: range, lengths: list[int], settings: dict, bar=None) -> dict:
    """The shard's tensors (DESIGN.md table), sequences in corpus order."""
    # where the inputs go: the embedding's device (the first GPU of a target spread with device_map)
    device = model.get_input_embeddings().weight.device if model is not None else "cpu"
    rows = split_ds.select(indices)
    input_ids = [list(x) for x in rows["input_ids"]]
    loss_masks = [list(x) for x in rows["loss_mask"]]
    pieces: dict[int, dict] = {}
    local_lengths = [lengths[i] for i in indices]
    for batch in plan_batches(range(len(indices)), local_lengths, settings["batch_tokens"]) if settings["store"] else []:
        ids, mask = pad_batch([input_ids[i] for i in batch], device)
        out = target_outputs(model, ids, mask, settings["store"], settings["aux_layers"], settings["topk"],
                             DTYPES[settings["dtype"]])
        sizes = [local_lengths[i] for i in batch]
        for name, tensor in out.items():
            for i, part in zip(batch, tensor.cpu().split(sizes)):
                pieces.setdefault(i, {})[name] = part
        if bar is not None:
            bar.update(sum(sizes))
    order = range(len(indices))
    tensors = {
        "input_ids": torch.tensor([t for i in order for t in input_ids[i]], dtype=torch.int32, device="cpu"),
        "loss_mask": torch.tensor([m for i in order for m in loss_masks[i]], dtype=torch.uint8, device="cpu"),
        "seq_lens": torch.tensor(local_lengths, dtype=torch.int64, device="cpu"),
    }
    for name in pieces.get(0, {}):
        tensors[name] = torch.cat([pieces[i][name] for i in order]).contiguous()
    if bar is not None and not settings["store"]:
        bar.update(sum(local_lengths))
    return tensors


# ---------------------------------------------------------------------------------------- manifest

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


# ---------------------------------------------------------------------------------------- the stage

def cache_settings(recipe, store: list[str]) -> dict:
    """The cache keys that shape the shards: regenerate_* act through the corpus fingerprint, topk only when stored;
    where the cache lives, how training reads it and how it is checked (dir, mode, verify) do not shape it."""
    skip = {k for k in type(recipe.cache).model_fields if k.startswith("regenerate")} | (set() if "topk" in store else {"topk"})
    return recipe.cache.model_dump(mode="json", exclude=skip | {"dir", "mode", "verify"})


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model")


def remembered_tokenizer_fingerprint(recipe, compute) -> str:
    """The target tokenizer's fingerprint without loading transformers when its files are unchanged: loading a
    tokenizer costs seconds of imports, most of a cache stage that only finds its shared cache. Remembered in
    <shared cache root>/tokenizer-fingerprints.json by a hash of the tokenizer files (local targets only)."""

    where = Path(resolve_target(recipe.target))
    if not where.is_dir():
        return compute()
    from importlib.metadata import version

    h = hashlib.sha256(version("transformers").encode())  # how the files are read is part of it
    for name in TOKENIZER_FILES:
        f = where / name
        if f.is_file():
            h.update(name.encode() + b"\0" + f.read_bytes())
    key = h.hexdigest()
    memo_file = shared_cache_root(recipe) / "tokenizer-fingerprints.json"
    try:
        memo = read_json(memo_file)
    except SpecdistillError:  # none yet, or damaged: computed again
        memo = {}
    if key not in memo:
        memo[key] = compute()
        try:
            memo_file.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(memo_file, memo)
        except OSError:
            pass
    return memo[key]


def cache_key(fingerprints: dict, store: list[str], aux_layers: list[int]) -> str:
    """The shared cache folder's name: a hash of everything that shapes the cache (what it is made from, what it stores)."""
    what = {**fingerprints, "store": store, "aux_layers": aux_layers}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


class _Lock:
    """An exclusive lock file, so two runs never write one shared cache at the same time."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fh = open(self.path, "w")
        try:
            fcntl.flock(self.fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another process writing the same cache ({self.path}) ...", flush=True)
            fcntl.flock(self.fh, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        self.fh.close()


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
            with _Lock(Path(shared_root) / f"{key}.lock"):
                return _build(recipe, dd, lengths, total_tokens, corpus_path, cache_path, fingerprints, settings,
                              store, aux_layers, cfg, per_token, plans, model, t0, rank, world)
    return _build(recipe, dd, lengths, total_tokens, corpus_path, cache_path, fingerprints, settings, store,
                  aux_layers, cfg, per_token, plans, model, t0, rank, world)


def _build(recipe, dd, lengths, total_tokens, corpus_path, cache_path, fingerprints, settings, store, aux_layers,
           cfg, per_token, plans, model, t0, rank: int = 0, world: int = 1) -> dict:
    if world > 1:
        _barrier()  # rank 0 holds the run's lock before anyone reads the manifest
    manifest = read_manifest(cache_path)
    bad = {}  # split -> indices of a complete cache's shards to rebuild
    if manifest is not None:
        check_fingerprints(manifest["fingerprints"], fingerprints, cache_path)
        if manifest.get("complete"):
            if rank == 0:
                bad_shards_set_aside(cache_path, manifest, recipe.cache.verify)
            if world > 1:
                _barrier()  # bad shards are moved aside before any rank looks
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
        return _build_ranked(manifest, dd, lengths, total_tokens, cache_path, settings, per_token, plans, model,
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


# ---------------------------------------------------------------------------------------- N ranks

def _barrier() -> None:
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


def _build_ranked(manifest, dd, lengths, total_tokens, cache_path, settings, per_token, plans, model, t0,
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
    _barrier()  # folders and manifest exist
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
    _barrier()  # every rank's shards are written
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
    _barrier()  # the manifest is complete before any rank returns
    manifest = read_manifest(cache_path)
    manifest["_run"] = {"tokens": total_tokens, "computed_tokens": int(computed), "ranks": world,
                        "seconds": round(time.time() - t0, 2),
                        "tokens_per_s": round(computed / max(compute_seconds, 1e-9), 1)}
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


def fits_one_device(target_cfg, device: torch.device) -> bool:
    """Whether the target's weights fit in the device's free memory with room for activations (always on the CPU)."""
    if torch.device(device).type != "cuda":
        return True
    weights = sum(f.stat().st_size for f in target_weight_files(resolve_target(target_cfg)))  # files' bytes
    free, _ = torch.cuda.mem_get_info(device)
    return weights <= 0.8 * free


def load_model(recipe, device: torch.device):
    """The target on `device`; one larger than the GPU's free memory spread over every GPU (accelerate's
    device_map="auto"), so a target no single GPU holds can still be cached."""
    devices.warn_if_bf16_emulated(DTYPES[recipe.target.dtype], device, "the cache pass runs the target",
                                  "target.dtype=float32")
    if fits_one_device(recipe.target, device):
        return load_target(recipe.target, device)
    from transformers import AutoModelForCausalLM

    print(f"target {recipe.target.path} does not fit in {device}'s free memory: loading it across "
          f"{torch.cuda.device_count()} GPUs (device_map=auto)", flush=True)
    load_target_config(recipe.target)  # a readable error on a bad path or architecture
    model = AutoModelForCausalLM.from_pretrained(resolve_target(recipe.target), dtype=DTYPES[recipe.target.dtype],
                                                 trust_remote_code=recipe.target.trust_remote_code,
                                                 device_map="auto")
    return model.eval().requires_grad_(False)


def cache_processes(recipe, device: torch.device) -> int:
    """How many processes run the pass: one per GPU of `train.num_gpus` on CUDA when the target fits on one;
    otherwise one (the CPU's cores are one process's; a spread target is one process over all GPUs; `cuda:N`
    names one GPU)."""
    if torch.device(device).type != "cuda" or recipe.train.num_gpus <= 1:
        return 1
    if devices.names_one_gpu(recipe.device):  # `device: cuda:N`: the pass runs on that GPU, in this process
        return 1
    return min(recipe.train.num_gpus, torch.cuda.device_count()) if fits_one_device(recipe.target, device) else 1


def link_run_cache(link: Path, shared: Path) -> None:
    """Point checkpoints/<run>/cache at the shared cache (atomically: a temp link renamed over the old one)."""
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(f".{link.name}.link-{os.getpid()}")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(Path(shared).resolve(), target_is_directory=True)
    os.replace(tmp, link)


def run(recipe, args=None) -> dict:
    device = devices.resolve(recipe.device)  # `device: cuda` without CUDA stops here, naming the key
    processes = cache_processes(recipe, device)
    if processes == 1:
        return stage(recipe, device)
    if recipe.cache.regenerate:  # one process answers the prompts first; the ranks then find it done and reuse it
        regenerated_corpus(recipe, corpus_dir(recipe.run_dir), shared_cache_root(recipe), load_model(recipe, device))
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
        model = load_model(recipe, device)
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
