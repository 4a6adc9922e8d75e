"""Training throughput: tokens/s per draft kind, and 2-process / 1-process on a tiny model (CPU, gloo).

Tiny randomly initialised Llama target (hidden 64, 2 layers, SmolLM2's 49152 vocabulary), a cache
written in the docs/DESIGN.md format, the real training loop. Tokens/s is the median over steps
after the first (start-up excluded); the ratio compares two runs of this same process's machine.
"""
from __future__ import annotations

import os
import statistics
import tempfile
from pathlib import Path

import specdistill.recipe
from specdistill.train import launch
from tests.conftest import tiny_model
from tests.test_train import make_recipe, read_log, write_cache


def _median_tokens_per_s(run_dir: Path) -> float:
    return statistics.median(r["tokens_per_s"] for r in read_log(run_dir)[1:])


def main() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        os.environ["SPECDISTILL_CHECKPOINTS"] = str(tmp / "checkpoints")
        specdistill.recipe.CHECKPOINTS = tmp / "checkpoints"
        target = tmp / "target"
        tiny_model("llama").save_pretrained(target)
        steps = dict(max_steps=8, save_every=8, micro_batch_size=4, heldout_batches=1)
        results = {}
        for kind in ("eagle", "draft_lm"):
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


if __name__ == "__main__":
    main()
