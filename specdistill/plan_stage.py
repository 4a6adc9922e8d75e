"""`specdistill plan`: size a run to its time budget on this machine (recipe key budget_minutes).

The same work runs up to 2.3x slower on one CPU than on another, and bf16 runs emulated (~8x slower) where the CPU
has no native bf16, so a recipe sized on one machine overruns on the next. The plan measures instead of guessing:
it runs prepare, cache, train, eval (twice, at two decode lengths), workloads (one prompt each), export and report at
a few rows in a scratch
run (<run>-plan-probe), reads each stage's own rate, and scales corpus.max_rows and train.max_steps down together
(never up: the recipe's sizes are the most it asks for) until the estimated total, the probe included, fits.
The run measures as well as learns, but measuring never gets more time than learning: where the recipe's eval
(the eval, workloads and served stages) would take longer than the cache pass and training at the fitted sizes
(a slow CPU: the eval's decoding does not shrink with the rows), or leaves no room at all, the plan runs a lighter
eval (LIGHT_EVAL; and LIGHT_SAVES held-out scorings in training) and gives the time it frees to more rows and steps.
On a CPU without native bf16 it also moves the run to fp32; on a CPU with it and `eval.runtime: auto`, it first times a
K+1-token verify in static-bf16 and static-fp32 (eval/runtime.py `verify_costs`) and moves the eval to fp32 where
that verifies faster (both Intel Xeons measured: their bf16 forwards cost more than fp32's). It writes <run_dir>/plan.json; every later stage of
the run applies its overrides (recipe._with_plan), the CLI prints the time left after each stage, and the eval
result carries the plan. The served stage is not probed (a vLLM start-up alone is minutes): its estimate is each
engine's start-up and fixed costs (VLLM_ENGINE_PLAIN_TOKENS, in the probe's plain decoding time) plus the decode at
twice our plain tokens/s.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import shutil
import statistics
import time

from specdistill import device as devices
from specdistill import layout
from specdistill.errors import SpecdistillError
from specdistill.eval.runtime import fastest_verify, static_supports, verify_costs
from specdistill.formats import read_json, read_jsonl
from specdistill.plan import format_plan
from specdistill.recipe import load_recipe, plan_key
from specdistill.target import load_target_config
from specdistill.stages import STAGES

PROBE_ROWS = 96
PROBE_STEPS = 6
PROBE_WORKLOAD_PROMPTS = 1  # the workloads stage's probe: one prompt of each workload
PROBE_TOKENS = (8, 24)  # two decode lengths: their difference is the eval's cost per token, the rest is fixed
# One vLLM engine's start-up and fixed costs, in the time the probe's plain decoding takes for this many tokens (a
# slower CPU starts vLLM slower too): the four default-90min records' served stages fit 1,240 to 1,960, median 1,340;
# their served minutes are then estimated -25% to +5% (a fixed 105 s, the served-parity median, gave -33% to +26%).
VLLM_ENGINE_PLAIN_TOKENS = 1340
VLLM_OVER_OURS = 2.0  # vLLM's decoding over the probe's plain tokens/s (served-parity: 26.6 vs 14.0, rounded)
MIN_ROWS = 64
# Where the recipe's eval would take longer than the learning, or leaves no room (a slow CPU): 1 MT-bench prompt per
# category, K as the recipe sets it (no tuning prompts), 2 prompts per workload; the served stage decodes the eval's
# prompts, so it shrinks too.
LIGHT_EVAL = {"eval.num_prompts": 8, "eval.tuning_prompts": 0, "eval.workload_prompts": 2}
# With it, training saves and scores its held-out split this many times at most, not the recipe's 6: a save's scoring
# is a fixed cost (capped rows and positions; 73 s in default-90min-avx2, against ~10 s a step: 6 took 42% of its
# training), and the eval decodes the last checkpoint only. Three still draw the held-out curve's shape.
LIGHT_SAVES = 3
EVAL_STAGES, LEARN_STAGES = ("eval", "workloads", "served"), ("cache", "train")
AIM = 0.95  # the plan aims 5% under the budget: the same work's time varies by a few percent on a shared machine


def fp32_overrides(recipe, device) -> list[str]:
    """bf16 emulated (a CPU without AVX-512 BF16 or AMX) costs ~8x fp32: the run goes fp32 there."""
    if device.type != "cpu" or devices.native_bf16(device):
        return []
    moves = []
    if recipe.target.dtype != "float32":
        moves.append("target.dtype=float32")
    if recipe.train.precision != "fp32":
        moves.append("train.precision=fp32")
    if recipe.eval.runtime in ("auto",) or recipe.eval.runtime.endswith("-bf16"):
        family = "static" if recipe.eval.runtime == "auto" else recipe.eval.runtime.split("-")[0]
        moves.append(f"eval.runtime={family}-fp32")
    return moves


def runtime_overrides(recipe, device) -> tuple[list[str], dict | None]:
    """`eval.runtime: auto` on a CPU with native bf16: the static dtype that verifies faster here (its override,
    where it is not auto's static-bf16) and the costs measured."""
    if device.type != "cpu" or recipe.eval.runtime != "auto" or not static_supports(load_target_config(recipe.target)):
        return [], None
    costs = verify_costs(recipe.target, device, recipe.eval.k)
    chosen, k = fastest_verify(costs, recipe.eval.k), str(recipe.eval.k + 1)
    print(f"plan: a {k}-token verify takes " + ", ".join(f"{ms[k]:.1f} ms in {name}" for name, ms in costs.items())
          + f" here: the eval decodes in {chosen}")
    return ([] if chosen == "static-bf16" else [f"eval.runtime={chosen}"]), costs


def timed(stage: str, source: str, overrides: list[str], **args) -> tuple[float, object]:
    """One stage in this process, as the CLI would run it; its wall seconds and what its run() returned."""
    recipe = load_recipe(source, overrides)
    t0 = time.time()
    out = importlib.import_module(STAGES[stage][0]).run(recipe, argparse.Namespace(**args))
    return time.time() - t0, out


def probe(recipe, overrides: list[str]) -> dict:
    """Each stage at a few rows; the rates the estimate scales."""
    name = f"{recipe.run_name}-plan-probe"
    probe_run = recipe.run_dir.parent / name
    shutil.rmtree(probe_run, ignore_errors=True)
    small = [*overrides, f"run_name={name}", "budget_minutes=null", f"corpus.max_rows={PROBE_ROWS}",
             f"train.max_steps={PROBE_STEPS}", f"train.save_every={PROBE_STEPS}", "train.warmup_steps=1",
             "eval.checkpoints=last", f"eval.num_prompts={min(2, recipe.eval.num_prompts)}",
             f"eval.tuning_prompts={min(1, recipe.eval.tuning_prompts)}",
             f"cache.dir={probe_run / 'cache-store'}"]  # a cache of its own: a shared one found would time nothing
    m = {}
    m["prepare_s"], prepared = timed("prepare", recipe.source, small)
    m["cache_rows"] = prepared["rows_read"]  # skipped rows included: max_rows counts rows read
    m["corpus_rows"] = m["cache_rows"] if m["cache_rows"] < PROBE_ROWS else None  # None: more than the probe read
    m["cache_s"], manifest = timed("cache", recipe.source, small)
    done = manifest.get("_run") or {}
    m["cache_tokens"] = sum(manifest["splits"][s]["tokens"] for s in manifest["splits"])
    m["cache_computed_tokens"] = done.get("computed_tokens", 0)
    m["cache_tokens_per_s"] = done.get("tokens_per_s") or m["cache_tokens"] / m["cache_s"]
    m["cache_fixed_s"] = max(0.0, m["cache_s"] - done.get("computed_tokens", 0) / m["cache_tokens_per_s"])
    m["train_s"], _ = timed("train", recipe.source, small)
    steps = read_jsonl(probe_run / "train_log.jsonl")
    step_seconds = [s["tokens"] / s["tokens_per_s"] for s in steps]
    m["train_step_s"] = statistics.median(step_seconds[2:] or step_seconds)  # past the first steps' warm-up
    m["train_tokens_per_step"] = statistics.median(s["tokens"] for s in steps)
    cost = read_jsonl(layout.heldout_cost_path(probe_run))[-1]  # the probe's one save scored its held-out split
    m["heldout_rows"], m["heldout_chain_positions"] = cost["rows"], cost["chain_positions"]
    m["heldout_offline_s"], m["heldout_chain_s"] = cost["offline_s"], cost["chain_s"]
    scoring = cost["offline_s"] + cost["chain_s"]
    m["train_fixed_s"] = max(0.0, m["train_s"] - sum(step_seconds) - scoring)  # start-up, the JIT build, the save
    evals = []
    for tokens in PROBE_TOKENS:
        seconds, _ = timed("eval", recipe.source, [*small, f"eval.max_new_tokens={tokens}"], checkpoint=None)
        evals.append(seconds)
    result = json.loads(max((probe_run / "eval").glob("*.json"), key=lambda p: p.stat().st_mtime).read_text())
    m["eval_s"] = evals
    m["eval_per_token_s"] = max(0.0, (evals[1] - evals[0]) / (PROBE_TOKENS[1] - PROBE_TOKENS[0]))
    m["eval_fixed_s"] = max(0.0, evals[0] - PROBE_TOKENS[0] * m["eval_per_token_s"])
    m["eval_prompts"] = min(2, recipe.eval.num_prompts) + min(1, recipe.eval.tuning_prompts)
    m["plain_tokens_per_s"] = min(r["baseline_tokens_per_s"] for r in result["results"])
    last = [*small, f"eval.max_new_tokens={PROBE_TOKENS[-1]}"]  # export and report read the eval the recipe names
    m["export_s"], _ = timed("export", recipe.source, last, checkpoint=None, format=None)
    m["workloads_s"], out = timed("workloads", recipe.source, [*last, f"eval.workload_prompts={PROBE_WORKLOAD_PROMPTS}"])
    m["workloads_decode_s"] = sum(w["wall_s"] - w["warmup_s"] for w in read_json(out)["workloads"].values())
    m["report_s"], _ = timed("report", recipe.source, last, runs=None)
    shutil.rmtree(probe_run, ignore_errors=True)
    return m


def workloads_s(recipe, m: dict) -> float:
    """The workloads stage: the probe's timed decodes (PROBE_WORKLOAD_PROMPTS prompts a workload, PROBE_TOKENS[-1]
    new tokens) scaled by prompts and new tokens; the rest of the probe's stage (loading the target and the draft,
    each workload's untimed warm-up) is fixed. A prompt's prefill scales with its tokens too, which errs high."""
    if recipe.eval.workload_prompts == 0:
        return 0.0
    scale = recipe.eval.workload_prompts / PROBE_WORKLOAD_PROMPTS * recipe.eval.max_new_tokens / PROBE_TOKENS[-1]
    return m["workloads_s"] + m["workloads_decode_s"] * (scale - 1)


def rows_to_cache(recipe, corpus_rows: int | None) -> int:
    """The rows the run reads: max_rows, or all of a corpus the probe read to its end (corpus_rows)."""
    if corpus_rows is None:
        if recipe.corpus.max_rows is None:
            raise SpecdistillError(f"{recipe.source}: budget_minutes needs corpus.max_rows (the most rows the plan "
                                   "may run): the corpus is larger than the probe reads")
        return recipe.corpus.max_rows
    return corpus_rows if recipe.corpus.max_rows is None else min(recipe.corpus.max_rows, corpus_rows)


def estimate(recipe, m: dict, scale: float) -> dict:
    """Seconds per stage at `scale` times the recipe's rows and steps (each stage's fixed cost plus its rate)."""
    rows = rows_to_cache(recipe, m["corpus_rows"]) * scale
    steps = recipe.train.max_steps * scale  # unrounded: the estimate stays linear in the scale (fit solves it)
    tokens_per_row = m["cache_tokens"] / m["cache_rows"]
    heldout_s = heldout_scoring_s(recipe, m)
    prompts = recipe.eval.num_prompts + recipe.eval.tuning_prompts
    checkpoints = recipe.eval.checkpoints if isinstance(recipe.eval.checkpoints, int) else 1
    decode = m["eval_per_token_s"] * recipe.eval.max_new_tokens * prompts / m["eval_prompts"]
    out = {"prepare": m["prepare_s"],
           "cache": m["cache_fixed_s"] + rows * tokens_per_row / m["cache_tokens_per_s"],
           "train": m["train_fixed_s"] + steps * m["train_step_s"] + saves(recipe) * heldout_s,
           "eval": m["eval_fixed_s"] + checkpoints * decode,
           "workloads": workloads_s(recipe, m), "export": m["export_s"], "served": 0.0, "report": m["report_s"]}
    if recipe.served.enabled:
        engines = 1 + len(recipe.export.formats or [None]) + len(recipe.served.methods)
        served_tokens = len(recipe.temperatures) * recipe.eval.num_prompts * recipe.eval.max_new_tokens
        out["served"] = engines * (VLLM_ENGINE_PLAIN_TOKENS + served_tokens / VLLM_OVER_OURS) / m["plain_tokens_per_s"]
    return out


def heldout_scoring_s(recipe, m: dict) -> float:
    """One save's held-out scoring (offline metrics, then the T=0 chain), from the probe's save. Both are capped
    (train.heldout_batches batches, train.heldout_chain_positions positions), which a run reaches at a small part
    of its rows, so it is priced at the recipe's full rows and stays a fixed cost of each save."""
    if not m["heldout_rows"]:
        return 0.0
    rows = rows_to_cache(recipe, m["corpus_rows"]) * recipe.corpus.heldout_fraction
    scored = min(rows, recipe.train.heldout_batches * recipe.train.micro_batch_size)
    offline = m["heldout_offline_s"] / m["heldout_rows"] * scored
    if not m["heldout_chain_positions"]:
        return offline
    positions = min(recipe.train.heldout_chain_positions, m["heldout_chain_positions"] / m["heldout_rows"] * scored)
    return offline + m["heldout_chain_s"] / m["heldout_chain_positions"] * positions


def fit(recipe, m: dict, budget_s: float, spent_s: float) -> float:
    """The largest scale <= 1 whose estimate fits the budget (every stage is linear in the scale)."""
    parts = {"plan": spent_s, **estimate(recipe, m, 0.0)}
    fixed = sum(parts.values())
    per_unit = sum(estimate(recipe, m, 1.0).values()) + spent_s - fixed
    scale = min(1.0, (budget_s - fixed) / per_unit) if per_unit > 0 else 1.0
    available = rows_to_cache(recipe, m["corpus_rows"])
    too_few = available >= MIN_ROWS and scale * available < MIN_ROWS  # a smaller corpus is all cached, or nothing
    if scale <= 0 or too_few:
        raise SpecdistillError(f"budget_minutes={recipe.budget_minutes:g}: the stages' fixed costs alone take "
                               f"{fixed / 60:.0f} min on this machine ("
                               + ", ".join(f"{k} {v / 60:.0f}" for k, v in parts.items() if v >= 30)
                               + f"), leaving room for under {MIN_ROWS} rows; raise "
                               "budget_minutes, or set budget_minutes=null to run the recipe's sizes")
    return scale


def saves(recipe) -> int:
    """How many times training saves (and scores its held-out split): the recipe's steps over its save_every."""
    return math.ceil(recipe.train.max_steps / recipe.train.save_every)


def lighter_eval(recipe) -> list[str]:
    """Overrides that shrink the eval's, the workloads stage's and the served stage's fixed costs (LIGHT_EVAL's
    counts) and training's saves (LIGHT_SAVES), each only where it is below the recipe's: what the plan falls back
    to where the recipe's own counts leave no room, or outweigh the learning. Empty: nothing would shrink."""
    out = [f"{key}={value}" for key, value in LIGHT_EVAL.items() if value < getattr(recipe.eval, key.split(".")[1])]
    if saves(recipe) > LIGHT_SAVES:
        out.append(f"train.save_every={math.ceil(recipe.train.max_steps / LIGHT_SAVES)}")
    return out


def eval_over_learning(recipe, m: dict, scale: float) -> float:
    """The eval-type stages' estimated seconds over the cache pass's and training's, at `scale`."""
    est = estimate(recipe, m, scale)
    return sum(est[s] for s in EVAL_STAGES) / max(1e-9, sum(est[s] for s in LEARN_STAGES))


def sizes(recipe, scale: float, corpus_rows: int | None) -> dict:
    """The recipe's rows and steps times the scale, with as many saves as the recipe makes and a warm-up of at
    most a tenth of the steps."""
    steps = max(1, round(recipe.train.max_steps * scale))
    available = rows_to_cache(recipe, corpus_rows)
    return {"corpus.max_rows": max(min(MIN_ROWS, available), int(available * scale)), "train.max_steps": steps,
            "train.save_every": max(1, math.ceil(steps / saves(recipe))),
            "train.warmup_steps": min(recipe.train.warmup_steps, max(1, steps // 10))}


def run(recipe, args) -> dict | None:
    plan_file = layout.plan_path(recipe.run_dir)
    if recipe.budget_minutes is None:
        print("plan: budget_minutes is null: the recipe's sizes run as written")
        return None
    t0 = time.time()
    plan_file.unlink(missing_ok=True)  # a stale plan must not size this one's probe
    device = devices.resolve(recipe.device)
    moves = fp32_overrides(recipe, device)
    print(f"plan: probing this machine ({devices.cpu_isa() if device.type == 'cpu' else device}) at {PROBE_ROWS} "
          f"rows and {PROBE_STEPS} steps" + (f"; no native bf16 here, so {', '.join(moves)}" if moves else ""))
    runtime_moves, runtime_ms = runtime_overrides(recipe, device) if not moves else ([], None)
    moves += runtime_moves
    overrides = [*getattr(args, "overrides", []), *moves]
    planned = load_recipe(recipe.source, overrides)
    m = probe(planned, overrides)
    if runtime_ms:
        m["verify_ms"] = runtime_ms
    spent = time.time() - t0
    budget_s = recipe.budget_minutes * 60 * AIM
    lighter = lighter_eval(planned)
    lightens = bool(lighter)
    try:
        scale = fit(planned, m, budget_s, spent)
    except SpecdistillError as full:  # a slow machine: a lighter eval before giving up
        if not lightens:
            raise
        why = str(full)
    else:
        ratio = eval_over_learning(planned, m, scale)
        why = (f"the recipe's eval would take {ratio:.1f}x the cache pass's and training's time (x{scale:.2f} of "
               "the recipe's rows and steps)") if ratio > 1 and lightens else None
    if why:
        light = load_recipe(recipe.source, [*overrides, *lighter])
        try:
            scale = fit(light, m, budget_s, spent)
        except SpecdistillError as still:
            raise SpecdistillError(f"{why}; with a lighter eval ({' '.join(lighter)}) still: {still}") from None
        print(f"plan: {why}; so the eval is lighter: {' '.join(lighter)}")
        planned, moves = light, [*moves, *lighter]
    stages = {"plan": spent, **estimate(planned, m, scale)}
    plan = {"for": plan_key(recipe), "budget_minutes": recipe.budget_minutes,
            "machine": devices.cpu_isa() if device.type == "cpu" else str(device),
            "made_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "scale": round(scale, 4),
            "overrides": [*moves, *(f"{k}={v}" for k, v in sizes(planned, scale, m["corpus_rows"]).items())],
            "estimate_s": {k: round(v, 1) for k, v in stages.items()},
            "total_s": round(sum(stages.values()), 1), "measured": m}
    plan_file.parent.mkdir(parents=True, exist_ok=True)
    plan_file.write_text(json.dumps(plan, indent=1) + "\n")
    print(format_plan(plan, recipe))
    return plan
