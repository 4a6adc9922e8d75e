"""The `workloads` stage: the head alone, prompt lookup alone and their hybrid (specdistill/decoding/hybrid.py), per
workload, on the run's last checkpoint (issue 37: on prompts that carry their own material, lookup can beat the head).

At T=0, the head drafting eval.k tokens a step and prompt lookup eval.lookup_k (alone and in the hybrid), in
eval.runtime, on eval.workload_prompts prompts of each workload (and, for a kind that drafts trees and a recipe with
eval.tree, the head's tree alone and the hybrid tree: lookup's draft grafted onto the head's
tree as one more branch, eval/tree.py):
  chat        the recipe's eval prompts (MT-bench by default; the first ones, as the eval decodes them);
  summarise, passage_qa, code, math   the categories of eval/workloads.py (PyPI data);
and the mix: every workload's prompts pooled. Each prompt is decoded by plain decoding and by each drafter,
interleaved (plain first on even prompts, last on odd ones), every decode checked token-identical to plain
decoding. Per workload and drafter: tau and speedup over plain decoding with 95% bootstrap intervals over prompts
(eval/summary.py), lossless, and for the hybrids the share of steps lookup drafted (the chain hybrid) or whose
accepted path ran through lookup's branch (the hybrid tree). Written to
eval/workloads-<checkpoint>.<runtime>.json; the report renders it (eval/workload_tables.py). eval.workload_prompts=0
skips the stage. `make bench ARGS=hybrid` runs the same measurement with more prompts.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from specdistill import device as devices
from specdistill import kinds, layout
from specdistill.decoding.hybrid import HybridDrafter
from specdistill.decoding.lookup import PromptLookup
from specdistill.errors import SpecdistillError
from specdistill.eval.engine import SpeculativeDecoder, eos_token_ids, make_drafter, merge_counts
from specdistill.eval.prompts import load_prompts
from specdistill.eval.runtime import StaticRuntime, load_runtime
from specdistill.eval.summary import CI_NOTE, bootstrap_per_prompt, per_prompt
from specdistill.eval.tree import TreeDecoder
from specdistill.eval.workload_tables import DRAFTERS, console_lines
from specdistill.eval.workloads import BUDGET, SOURCES, WORKLOADS, code_source, load_workload
from specdistill.formats import write_json_atomic
from specdistill.target import load_tokenizer, one_device_shortfall, vocab_size_of



def prompt_sets(recipe, tokenizer, n: int) -> dict:
    """chat (the recipe's eval prompts) and every workload of eval/workloads.py, n prompts each; read before the
    target is loaded, so a missing package stops the stage in seconds."""
    sets = {"chat": load_prompts(recipe.eval.model_copy(update={"num_prompts": n}), tokenizer)}
    sets.update((name, load_workload(name, tokenizer, n)) for name in WORKLOADS)
    return sets


def measure(recipe, sets: dict, runtime, target, tokenizer, draft) -> dict:
    """Every workload, then the mix: the report's numbers (without where they came from). The draft (a
    kinds.LoadedDraft) is moved to the runtime's device and dtype first, before any drafter wraps it."""
    draft.module.to(device=runtime.device, dtype=runtime.dtype)
    eos, k = eos_token_ids(target, tokenizer), recipe.eval.k
    lookup_k = recipe.eval.lookup_k or k
    hybrid = HybridDrafter(make_drafter(draft, target, static=isinstance(runtime, StaticRuntime)),
                           PromptLookup(vocab_size_of(target)), head_k=k)
    report = {"k": k, "lookup_k": lookup_k, "runtime": runtime.name, "max_new_tokens": recipe.eval.max_new_tokens,
              "cpu_isa": devices.cpu_isa(), "sources": {"chat": recipe.eval.prompts, **SOURCES, "code": code_source()},
              "budget_tokens": BUDGET, "ci": CI_NOTE, "workloads": {}}
    decoders = {"plain": SpeculativeDecoder(runtime, None, eos_ids=eos),
                "head": SpeculativeDecoder(runtime, draft, k=k, eos_ids=eos),
                "lookup": SpeculativeDecoder(runtime, PromptLookup(vocab_size_of(target)), k=lookup_k, eos_ids=eos),
                "hybrid": SpeculativeDecoder(runtime, hybrid, k=max(k, lookup_k), eos_ids=eos)}
    counters = {"hybrid": hybrid}  # what counts each hybrid's lookup and head steps (its .steps, reset per decode)
    if recipe.eval.tree and draft.kind.DRAFTS_TREES:
        decoders["head_tree"] = TreeDecoder(runtime, draft, recipe.eval.tree, eos_ids=eos)
        decoders["hybrid_tree"] = TreeDecoder(runtime, draft, recipe.eval.tree, eos_ids=eos, lookup=True)
        counters["hybrid_tree"] = decoders["hybrid_tree"].stepper
        report["tree"] = dict(recipe.eval.tree)
    with torch.inference_mode():
        for name, prompts in sets.items():
            started = time.time()
            for d in decoders.values():  # warm-up, untimed
                d.decode(prompts[0].ids, 8)
            warmed = time.time()
            report["workloads"][name] = {"prompts": len(prompts),
                                         **workload(decoders, counters, prompts, recipe.eval.max_new_tokens)}
            report["workloads"][name]["wall_s"] = round(time.time() - started, 1)
            report["workloads"][name]["warmup_s"] = round(warmed - started, 1)  # a fixed cost: the plan scales the rest
            print(f"{name}: {len(prompts)} prompts in {report['workloads'][name]['wall_s']} s", flush=True)
    every = report["workloads"].values()
    report["mix"] = {"prompts": sum(w["prompts"] for w in every),
                     **{d: pooled([r for w in every for r in w[d]["per_prompt"]]) for d in DRAFTERS if d in decoders}}
    return report


def workload(decoders: dict, counters: dict, prompts, max_new_tokens: int) -> dict:
    """Every decoder on every prompt; per drafter tau, speedup, their intervals and the per-prompt records."""
    runs = {name: [] for name in decoders}
    steps = {name: [] for name in counters}  # each hybrid's (lookup, head) steps per prompt
    for i, p in enumerate(prompts):
        order = list(decoders) if i % 2 == 0 else [*list(decoders)[1:], "plain"]
        for name in order:
            runs[name].append(decoders[name].decode(p.ids, max_new_tokens))
            if name in counters:
                steps[name].append((counters[name].steps["lookup"], counters[name].steps["head"]))
    plain = runs["plain"]
    out = {"plain_tokens_per_s": merge_counts(plain)["tokens_per_s"]}
    for name in (d for d in DRAFTERS if d in decoders):
        records = per_prompt(runs[name], plain)
        for r, s, b in zip(records, runs[name], plain):
            r["lossless"] = s.tokens == b.tokens
        for r, (lookup, head) in zip(records, steps.get(name, ())):
            r["lookup_steps"], r["head_steps"] = lookup, head
        out[name] = pooled(records)
    return out


def pooled(records: list[dict]) -> dict:
    """tau, speedup over plain decoding and lossless from per-prompt records, pooled as the eval pools them, with
    their 95% bootstrap intervals over prompts (eval/summary.py); the hybrid's share of steps lookup drafted."""
    tot = {k: sum(r[k] for r in records) for k in ("tokens", "steps", "seconds", "baseline_tokens", "baseline_seconds")}
    tps = tot["tokens"] / tot["seconds"] if tot["seconds"] else 0.0
    base = tot["baseline_tokens"] / tot["baseline_seconds"] if tot["baseline_seconds"] else 0.0
    ci = bootstrap_per_prompt(records)
    out = {"tau": tot["tokens"] / tot["steps"] if tot["steps"] else 0.0, "tau_ci95": ci["tau_ci95"],
           "tokens_per_s": tps, "speedup": tps / base if base else 0.0, "speedup_ci95": ci["speedup_ci95"],
           "lossless": all(r["lossless"] for r in records), "per_prompt": records}
    if records and "lookup_steps" in records[0]:
        lookup, head = (sum(r[k] for r in records) for k in ("lookup_steps", "head_steps"))
        out["lookup_step_share"] = lookup / max(1, lookup + head)
    return out


def run(recipe, args=None) -> Path | None:
    n = recipe.eval.workload_prompts
    if n == 0:
        print("workloads: eval.workload_prompts is 0: skipped")
        return None
    step_dir = layout.select_checkpoints(recipe.run_dir, "last")[-1]
    device = devices.resolve(recipe.device)
    if short := one_device_shortfall(recipe.target, device):
        raise SpecdistillError(f"workloads: {short}: the stage holds the target on one GPU")
    tokenizer = load_tokenizer(recipe.target)
    sets = prompt_sets(recipe, tokenizer, n)
    target, runtime = load_runtime(recipe.target, recipe.eval.runtime, device)
    draft = kinds.load_draft(step_dir, target)
    report = {"checkpoint": step_dir.name, "run_dir": str(recipe.run_dir), "num_prompts": n,
              **measure(recipe, sets, runtime, target, tokenizer, draft)}
    out = layout.workloads_result(recipe.run_dir, step_dir.name, runtime.name)
    write_json_atomic(out, report)
    print("\n".join(console_lines(report)))
    print(f"wrote {out}")
    return out
