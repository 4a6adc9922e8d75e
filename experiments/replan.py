"""`python -m experiments.replan NAME [key=value ...]`: what the plan would size on a recorded run's probe.

A default-run record keeps its plan (`results.main.plan`): the probe's measured rates and the overrides it chose.
This refits that plan (specdistill/plan_stage.py `fit`, `sizes`) with the same moves (dtype, runtime, lighter eval)
plus the given overrides, on the same rates and budget: the estimate a plan change would have made on that
machine, without a run. It prints the recorded sizes, then the refitted ones.
"""
from __future__ import annotations

import json
import sys

from experiments.schema import RECORDS, load, pinned_recipe
from specdistill import plan_stage

SIZES = ("corpus.max_rows", "train.max_steps", "train.save_every", "train.warmup_steps")


def replan(name: str, extra: list[str]) -> dict:
    plan = json.loads((RECORDS / f"{name}.json").read_text())["results"]["main"]["plan"]
    moves = [o for o in plan["overrides"] if o.split("=")[0] not in SIZES]
    exp = load(name)
    recipe = pinned_recipe(exp.model_copy(update={"arms": {"main": [*exp.arms["main"], *moves, *extra]}}), "main")
    m = plan["measured"]
    scale = plan_stage.fit(recipe, m, plan["budget_minutes"] * 60 * plan_stage.AIM, plan["estimate_s"]["plan"])
    return {"scale": round(scale, 4), **plan_stage.sizes(recipe, scale, m["corpus_rows"])}


if __name__ == "__main__":
    name, extra = sys.argv[1], sys.argv[2:]
    print("recorded: ", replan(name, []))
    print("refitted: ", replan(name, extra), "with", " ".join(extra))
