"""`make bench ARGS=scaling`: how much data buys how much τ, from complete runs (not checkpoints of one run).

One run per data size, all over the same shared cache: a run of S optimizer steps trains on the first S
steps of the one-pass order (train/loop.py `step_micro_batches`: distinct sequences until the epoch ends),
with its own complete schedule (warmup scaled with S, cosine to the end), so the sizes differ in data only.
Each run's last checkpoint is evaluated by real chain decoding at T=0 (eval.k, no tree, no comparators).
Prints, per size: tokens seen, the held-out simulated τ (the chain replayed on held-out corpus text,
`chain_tau`), the simulated τ on the target's own continuations and the measured τ; then the report's
fit τ(N) = τ∞ − c·N^(−b) per series and the tokens it needs for the goal τ (eval/scaling.py TAU_GOAL; an
extrapolation beyond the largest run), and writes <output_dir>/bench/scaling.json and scaling.png.

    python -m benchmarks.scaling_bench [--recipe R] [--fractions 0.125 0.25 0.5 1] [overrides ...]

The fractions are of the recipe's train.max_steps (one pass for the default recipe). Every setting is the
recipe's plus the overrides given; the command line is printed with the table.
"""
from __future__ import annotations

import argparse
import os
import sys

from benchmarks.run import run_stage
from specdistill import layout
from specdistill.eval.plots import plot_tau_vs_tokens
from specdistill.eval.results import result_at, result_path
from specdistill.eval.scaling import fit_text, scaling_fits
from specdistill.eval.tables import num
from specdistill.eval.tables import table as markdown_table
from specdistill.formats import read_json, read_metrics, write_json_atomic
from specdistill.recipe import load_recipe

DEFAULT_RECIPE = "recipes/smollm2-135m-eagle3.yaml"
FRACTIONS = [0.125, 0.25, 0.5, 1.0]  # of the recipe's train.max_steps
EVAL = ["eval.checkpoints=last", "eval.temperature=[0]", "eval.k_sweep=[]", "eval.tree=null",
        "eval.comparators=false"]


def run_overrides(recipe, steps: int) -> list[str]:
    """One complete run of `steps` steps: its own name, one checkpoint at the end, warmup scaled with it."""
    tc = recipe.train
    warmup = max(1, round(tc.warmup_steps * steps / tc.max_steps)) if tc.warmup_steps else 0
    return [f"run_name={recipe.run_name}-scaling-{steps}", f"train.max_steps={steps}", f"train.save_every={steps}",
            f"train.warmup_steps={warmup}"]


def point(recipe_path: str, overrides: list[str]) -> dict:
    """What one finished run measured (its last checkpoint's metrics and eval JSON)."""
    recipe = load_recipe(recipe_path, overrides)
    step_dir = layout.checkpoints(recipe.run_dir)[-1]
    held = (read_metrics(step_dir) or {}).get("heldout") or {}
    e = read_json(result_path(recipe, step_dir.name))
    return {"run": "scaling", "checkpoint": recipe.run_name, "step": layout.step_of(step_dir),
            "tokens_seen": (read_metrics(step_dir) or {}).get("tokens_seen"), "k": recipe.eval.k,
            "heldout_top1": (held.get("top1_at") or [None])[0],
            "simulated": (held.get("chain_tau") or {}).get("0"),
            "continuations": ((e.get("offline") or {}).get("chain_on_continuations") or {}).get("tau"),
            "measured": result_at(e, 0.0).get("tau"), "stale": False, "evaluated": True}


def scaling(recipe_path: str, fractions: list[float], overrides: list[str],
            stages=("prepare", "cache", "train", "eval")) -> dict:
    """Run every size (stages in order per run, each in its own process; the cache is shared, so only the first
    run pays for it)."""
    base = load_recipe(recipe_path, overrides)
    sizes = sorted({max(1, round(f * base.train.max_steps)) for f in fractions})
    points = []
    for steps in sizes:
        run = overrides + run_overrides(base, steps)
        for stage in stages:
            run_stage(stage, recipe_path, [*run, *(EVAL if stage == "eval" else [])])
        points.append(point(recipe_path, run))
    fits = scaling_fits(points)
    out = base.run_dir.parent / "bench"  # beside the runs, as checkpoints/bench/runtime.json
    out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python -m benchmarks.scaling_bench --recipe", recipe_path, "--fractions",
                        *map(str, fractions), *overrides])
    figure = plot_tau_vs_tokens(points, fits, False, out / "scaling.png", command)
    result = {"command": command, "points": points, "fits": fits, "figure": str(figure)}
    write_json_atomic(out / "scaling.json", result)
    return result


def table(result: dict) -> str:
    k = result["points"][0]["k"] if result["points"] else "?"
    header = ["steps", "tokens seen", f"sim. τ (held-out chain, T=0, K={k})", "sim. τ (continuations)",
              "measured τ (chain, T=0)"]
    rows = [[str(p["step"]), f"{p['tokens_seen']:,}" if p["tokens_seen"] is not None else "—",
             num(p["simulated"]), num(p["continuations"]), num(p["measured"])]
            for p in result["points"]]
    fits = "\n".join(fit_text(f, False) for f in result["fits"])
    return f"{result['command']}\n\n{markdown_table(header, rows)}\n\n{fits}"


def run(recipe_path: str) -> dict:
    """The benchmark at full size on a pinned recipe (experiments/run.py's bench runner)."""
    return scaling(recipe_path, FRACTIONS, [])


def main(argv: list[str] | None = None) -> None:
    """argv: this benchmark's own arguments (`make bench ARGS="scaling --fractions ..."` passes what follows)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=DEFAULT_RECIPE)
    parser.add_argument("--fractions", type=float, nargs="+", default=FRACTIONS)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    print(table(scaling(args.recipe, args.fractions, args.overrides)))


if __name__ == "__main__":
    main(sys.argv[1:])
