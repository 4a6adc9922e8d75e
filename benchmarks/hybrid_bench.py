"""Hybrid bench: the `workloads` stage's measurement (eval/by_workload.py: the head alone, prompt lookup alone and
their hybrid, per workload, T=0, every decode checked against plain decoding) with eval.num_prompts prompts of each
workload instead of eval.workload_prompts, on the recipe's last checkpoint (with none, an untrained head, and it says
so: decode_bench.draft_for), in the eval runtime, the target loaded in that runtime's dtype as the eval loads it.
`make bench ARGS="hybrid [recipe.yaml] [section.key=value ...]"`, e.g.
`make bench ARGS="hybrid run_name=smollm2-135m-eagle3 eval.num_prompts=8"`, or
`python -m benchmarks.hybrid_bench [recipe] [section.key=value ...]`; it writes checkpoints/bench/hybrid.json.
"""
from __future__ import annotations

import json
import sys

from benchmarks.decode_bench import draft_for
from specdistill import device as devices
from specdistill.eval.by_workload import measure, prompt_sets
from specdistill.eval.runtime import load_runtime
from specdistill.eval.workload_tables import console_lines
from specdistill.formats import write_json_atomic
from specdistill.recipe import load_recipe
from specdistill.target import load_tokenizer

# toy: one prompt per workload, 4 new tokens (it proves the bench runs; tests/test_benchmarks.py)
TOY = ["eval.num_prompts=1", "eval.max_new_tokens=4", "run_name=bench-toy"]


def run(recipe_path: str, overrides: list[str] = ()) -> dict:
    """The benchmark at full size on a pinned recipe (experiments/run.py's bench runner)."""
    return main(recipe_path, overrides)


def main(recipe_path: str = "recipes/smollm2-135m-eagle3.yaml", overrides: list[str] = (), toy: bool = False) -> dict:
    recipe = load_recipe(recipe_path, [*(TOY if toy else []), *overrides])
    tokenizer = load_tokenizer(recipe.target)
    sets = prompt_sets(recipe, tokenizer, recipe.eval.num_prompts)
    target, runtime = load_runtime(recipe.target, recipe.eval.runtime, devices.resolve(recipe.device))
    draft, checkpoint, _ = draft_for(recipe, target)
    report = {"checkpoint": checkpoint, "run_dir": str(recipe.run_dir), "num_prompts": recipe.eval.num_prompts,
              **measure(recipe, sets, runtime, target, tokenizer, draft)}
    print("\n".join(console_lines(report)))
    out = recipe.run_dir.parent / "bench" / "hybrid.json"  # beside the runs, as checkpoints/bench/runtime.json
    write_json_atomic(out, report)
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    args = sys.argv[1:]
    path = args.pop(0) if args and not "=" in args[0] else "recipes/smollm2-135m-eagle3.yaml"
    print(json.dumps(main(path, args), indent=1, default=str))
