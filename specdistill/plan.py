"""A run's plan (written by `specdistill plan`, specdistill/plan_stage.py): how it is shown, and the time left
after each stage. Torch-free: the CLI prints it after every stage, `config` and `report` included."""
from __future__ import annotations

import json

from specdistill import layout

STAGE_ORDER = ("plan", "prepare", "cache", "train", "eval", "workloads", "export", "served", "report")  # what `make distill` runs


def applied_plan(recipe) -> dict | None:
    """The plan this run's stages apply (recipe._with_plan), for results to carry: what the run was sized to."""
    path = layout.plan_path(recipe.run_dir)
    if recipe.budget_minutes is None or not path.is_file():
        return None
    plan = json.loads(path.read_text())
    return {k: plan[k] for k in ("budget_minutes", "machine", "made_at", "scale", "overrides", "estimate_s", "total_s")}


def format_plan(plan: dict, recipe) -> str:
    lines = [f"plan for {recipe.run_name} on {plan['machine']}, budget {plan['budget_minutes']:g} min: "
             f"{plan['total_s'] / 60:.0f} min in all ({layout.plan_path(recipe.run_dir)})",
             "  " + ", ".join(plan["overrides"]) + f" (x{plan['scale']:.2f} of the recipe's rows and steps)"]
    lines += [f"  {stage:<8} {plan['estimate_s'][stage] / 60:6.1f} min" + ("  (not probed: vLLM start-up)"
                                                                          if stage == "served" else "")
              for stage in STAGE_ORDER if stage in plan["estimate_s"]]
    return "\n".join(lines)


def time_left(recipe, stage: str, seconds: float) -> str | None:
    """After a stage of a planned run: what it took against the plan, and the plan's minutes still ahead."""
    plan_file = layout.plan_path(recipe.run_dir)
    if recipe.budget_minutes is None or stage not in STAGE_ORDER or not plan_file.is_file():
        return None
    est = json.loads(plan_file.read_text())["estimate_s"]
    ahead = sum(est.get(s, 0.0) for s in STAGE_ORDER[STAGE_ORDER.index(stage) + 1:])
    return (f"plan: {stage} took {seconds / 60:.1f} min (planned {est.get(stage, 0.0) / 60:.1f}); "
            f"about {ahead / 60:.0f} min of the run left")

