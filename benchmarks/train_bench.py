"""Training throughput: tokens/s per draft kind, and 2-process / 1-process on a tiny model (CPU, gloo);
then the default head (the default recipe's EAGLE-3 head on SmolLM2-135M, a real bf16 cache of 96 gsm8k
rows): fp32 against bf16 (`train.precision`), and data parallelism measured where it means something:
N processes of one thread each against one process of one thread (ideal: N x), plus one process using
every core (the default). A user predicts multi-GPU efficiency from the N-process ratio. Last, whether the
cache reader keeps up with a step: the DataLoader's tokens/s over the same cache and data order (0 workers,
as on the CPU; 2 workers with prefetch, as on a GPU) against the training step's tokens/s.

Tiny randomly initialised Llama target (hidden 64, 2 layers, SmolLM2's 49152 vocabulary), a cache
written in the docs/DESIGN.md format, the real training loop. Tokens/s is the median over steps
after the first (start-up excluded); the ratio compares two runs of this same process's machine.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

import specdistill.recipe
from benchmarks.tiny import make_recipe, read_log, tiny_model, write_cache
from specdistill import layout
from specdistill.data import cache, prepare
from specdistill.data.cache_reader import open_cache
from specdistill.recipe import load_recipe
from specdistill.train import launch
from specdistill.train.loop import StepBatches, read_batches


def _median_tokens_per_s(run_dir: Path) -> float:
    return statistics.median(r["tokens_per_s"] for r in read_log(run_dir)[1:])


def main(toy: bool = False) -> None:
    """toy: 2 steps per run and a 16-row default-head cache of 128-token rows; proves the benchmark runs,
    measures nothing."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        os.environ["SPECDISTILL_CHECKPOINTS"] = str(tmp / "checkpoints")
        specdistill.recipe.CHECKPOINTS = tmp / "checkpoints"
        target = tmp / "target"
        tiny_model("llama").save_pretrained(target)
        steps = dict(max_steps=2 if toy else 8, save_every=2 if toy else 8, micro_batch_size=4, heldout_batches=1)
        results = {}
        for kind in ("eagle",) if toy else ("eagle", "draft_lm"):  # toy: one kind proves the loop runs
            recipe = make_recipe(tmp, target, f"bench-{kind}", kind=kind, **steps)
            write_cache(recipe.run_dir, target, n_train=32, n_heldout=4)
            launch.run(recipe)
            results[kind] = _median_tokens_per_s(recipe.run_dir)
        two = make_recipe(tmp, target, "bench-eagle-2proc", kind="eagle", num_gpus=2,
                          **{**steps, "micro_batch_size": 2})
        one = make_recipe(tmp, target, "bench-eagle-1proc", kind="eagle", gradient_accumulation_steps=2,
                          **{**steps, "micro_batch_size": 2})
        for r in (one, two):
            write_cache(r.run_dir, target, n_train=32, n_heldout=4)
            launch.run(r)
        t1, t2 = _median_tokens_per_s(one.run_dir), _median_tokens_per_s(two.run_dir)
    print("\ntrain throughput (tiny Llama target: hidden 64, 2 layers, vocab 49152; CPU, "
          f"{os.cpu_count()} cores; global batch 4 sequences of 10-19 tokens)")
    for kind, v in results.items():
        print(f"  {kind:9s} {v:8.0f} tokens/s (1 process)")
    print(f"  eagle 2 processes / 1 process (same global batch): {t2:.0f} / {t1:.0f} = {t2 / t1:.2f}x")
    if toy:  # one run of the default head: the others differ from it only in their overrides
        default_head(rows=16, steps=2, only=["bf16-all-cores"],
                     extra=["corpus.max_length=128", "train.log_every=1", "train.warmup_steps=1"])
    else:
        default_head()


def default_head(rows: int = 96, steps: int = 6, only: list[str] | None = None, extra: list[str] = ()) -> dict:
    """only: run just these of the runs below (`python -m benchmarks.train_bench reader`: bf16-all-cores and
    the reader, the check that the reader keeps up, in a few minutes)."""
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        base = [f"output_dir={tmp}", "corpus.path=/work/shared/data/gsm8k_train.jsonl", "corpus.format=columns",
                "corpus.columns={user: question, assistant: answer}", f"corpus.max_rows={rows}",
                "target.dtype=bfloat16", "corpus.heldout_fraction=0.05", f"train.max_steps={steps}",
                f"train.save_every={steps}", "train.heldout_batches=1", "train.warmup_steps=2", *extra]
        recipe = lambda name, *extra: load_recipe("recipes/smollm2-135m-eagle3.yaml", base + [f"run_name={name}", *extra])
        first = recipe("cache", "train.precision=fp32")
        prepare.run(first)
        cache.run(first)
        one_process = ["train.num_gpus=1", "train.micro_batch_size=8"]  # the recipe's 8 sequences a step, in one process
        runs = {  # name: (recipe overrides, torch threads of an in-process run)
            "fp32-all-cores": (["train.precision=fp32", *one_process], cores),
            "bf16-all-cores": (["train.precision=bf16", *one_process], cores),
            "bf16-1proc-1thread": (["train.precision=bf16", "train.num_gpus=1", "train.gradient_accumulation_steps=2",
                                    "train.micro_batch_size=4"], 1),
            f"bf16-{cores}proc-1thread": (["train.precision=bf16", f"train.num_gpus={cores}",
                                           f"train.micro_batch_size={8 // cores}"], cores),
        }
        out = {}
        reader = reader_tokens_per_s(first)
        for name, (extra, threads) in runs.items():
            if only is not None and name not in only:
                continue
            r = recipe(name, *extra)
            prepare.run(r), cache.run(r)  # reuses the shared cache: nothing recomputed
            before = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                launch.run(r)
            finally:
                torch.set_num_threads(before)
            out[name] = _median_tokens_per_s(r.run_dir)
    print(f"\ndefault head (EAGLE-3 on SmolLM2-135M, global batch 8 gsm8k sequences, {cores} cores):")
    for name, v in out.items():
        print(f"  {name:20s} {v:8.0f} tokens/s")
    step = max(out.values())
    for workers, v in reader.items():
        print(f"  cache reader, {workers} workers: {v:8.0f} tokens/s = {v / step:.1f}x the fastest step's "
              f"{step:.0f} tokens/s (>1: the reader keeps up)")
    if only is not None:
        return out
    one = out["bf16-1proc-1thread"]
    print(f"  bf16 / fp32 (all cores, 1 process): {out['bf16-all-cores'] / out['fp32-all-cores']:.2f}x")
    print(f"  {cores} processes x 1 thread / 1 process x 1 thread: {out[f'bf16-{cores}proc-1thread'] / one:.2f}x "
          f"(ideal {cores}x); 1 process x {cores} threads / 1 x 1: {out['bf16-all-cores'] / one:.2f}x")
    return out


def reader_tokens_per_s(recipe, steps: int = 40) -> dict[int, float]:
    """Tokens/s of the training reader alone (collated micro batches, the training order) over `recipe`'s cache."""
    data = open_cache(layout.cache_dir(recipe.run_dir), "train")
    out = {}
    for workers in (0, 2):
        t0, tokens = time.perf_counter(), 0
        for batch in read_batches(data, StepBatches(len(data), 0, steps, recipe.train, 1, 0), torch.device("cpu"),
                                  workers):
            tokens += int(batch["attention_mask"].sum())
        out[workers] = tokens / (time.perf_counter() - t0)
    return out


if __name__ == "__main__":
    import sys

    default_head(only=["bf16-all-cores"]) if sys.argv[1:] == ["reader"] else main()
