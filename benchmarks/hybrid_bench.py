"""Hybrid bench: the head alone, prompt lookup alone and their hybrid (specdistill/decoding/hybrid.py), per workload.

For the recipe's last checkpoint (checkpoints/<run_name>/), in the recipe's eval runtime, at T=0 and the recipe's
K, on eval.num_prompts prompts of each workload:
  chat        the recipe's eval prompts (MT-bench by default);
  summarise, passage_qa, code, math   the categories of eval/workloads.py (an essay chunk to summarise, a SQuAD
              passage to answer from, a stdlib function to edit or complete, an MMATH problem; PyPI data);
and the mix: every workload's prompts pooled. Each prompt is decoded by plain decoding and by each drafter,
interleaved, every decode checked token-identical to plain decoding. Prints tau and speedup over plain decoding,
each with its 95% bootstrap interval over prompts (eval/summary.py bootstrap_per_prompt), lossless, per workload
and drafter, and for the hybrid the share of steps lookup drafted. With no checkpoint it runs an untrained head
and says so (decode_bench.draft_for). `make bench ARGS="hybrid [recipe.yaml] [section.key=value ...]"`, e.g.
`make bench ARGS="hybrid run_name=smollm2-135m-eagle3 eval.num_prompts=8"`, or
`python -m benchmarks.hybrid_bench [recipe] [section.key=value ...]`; it writes checkpoints/bench/hybrid.json.
"""
from __future__ import annotations

import json
import sys
import time

import torch

from specdistill import device as devices
from benchmarks.decode_bench import draft_for
from specdistill.decoding.hybrid import HybridDrafter
from specdistill.decoding.lookup import PromptLookup
from specdistill.eval.engine import SpeculativeDecoder, eos_token_ids, make_drafter, merge_counts
from specdistill.eval.prompts import load_prompts
from specdistill.eval.runtime import StaticRuntime, make_runtime
from specdistill.eval.summary import CI_NOTE, bootstrap_per_prompt, per_prompt
from specdistill.eval.workloads import BUDGET, SOURCES, WORKLOADS, code_source, load_workload
from specdistill.formats import write_json_atomic
from specdistill.recipe import load_recipe
from specdistill.target import load_target, load_tokenizer, vocab_size_of

DRAFTERS = ("head", "lookup", "hybrid")


def timed(runs) -> list[dict]:
    return [{"tokens": len(r.tokens), "seconds": r.total_s} for r in runs]


def workload(decoders: dict, hybrid: HybridDrafter, prompts, max_new_tokens: int) -> dict:
    """Every decoder on every prompt (plain first on even prompts, last on odd ones); per drafter tau, speedup,
    their intervals and the per-prompt records they come from."""
    runs = {name: [] for name in decoders}
    steps = []  # the hybrid's (lookup, head) steps per prompt
    for i, p in enumerate(prompts):
        order = list(decoders) if i % 2 == 0 else [*list(decoders)[1:], "plain"]
        for name in order:
            runs[name].append(decoders[name].decode(p.ids, max_new_tokens))
            if name == "hybrid":
                steps.append((hybrid.steps["lookup"], hybrid.steps["head"]))
    plain = runs["plain"]
    out = {"plain_tokens_per_s": merge_counts(plain)["tokens_per_s"]}
    for name in DRAFTERS:
        records = per_prompt(runs[name], plain)
        for r, s, b in zip(records, runs[name], plain):
            r["lossless"] = s.tokens == b.tokens
        if name == "hybrid":
            for r, (lookup, head) in zip(records, steps):
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


# toy: one prompt per workload, 4 new tokens (it proves the bench runs; tests/test_benchmarks.py)
TOY = ["eval.num_prompts=1", "eval.max_new_tokens=4", "run_name=bench-toy"]


def run(recipe_path: str, overrides: list[str] = ()) -> dict:
    """The benchmark at full size on a pinned recipe (experiments/run.py's bench runner)."""
    return main(recipe_path, overrides)


def main(recipe_path: str = "recipes/smollm2-135m-eagle3.yaml", overrides: list[str] = (), toy: bool = False) -> dict:
    recipe = load_recipe(recipe_path, [*(TOY if toy else []), *overrides])
    tokenizer = load_tokenizer(recipe.target)
    n = recipe.eval.num_prompts
    sets = {"chat": load_prompts(recipe.eval, tokenizer)}  # every set before the target: a missing package stops it
    sets.update((name, load_workload(name, tokenizer, n)) for name in WORKLOADS)
    target = load_target(recipe.target, device=devices.resolve(recipe.device))
    runtime = make_runtime(target, recipe.eval.runtime)
    draft, checkpoint, _ = draft_for(recipe, target)
    draft = draft.to(device=runtime.device, dtype=runtime.dtype)
    eos, k = eos_token_ids(target, tokenizer), recipe.eval.k
    hybrid = HybridDrafter(make_drafter(draft, target, static=isinstance(runtime, StaticRuntime)),
                           PromptLookup(vocab_size_of(target)))
    decoders = {"plain": SpeculativeDecoder(runtime, None, eos_ids=eos),
                "head": SpeculativeDecoder(runtime, draft, k=k, eos_ids=eos),
                "lookup": SpeculativeDecoder(runtime, PromptLookup(vocab_size_of(target)), k=k, eos_ids=eos),
                "hybrid": SpeculativeDecoder(runtime, hybrid, k=k, eos_ids=eos)}
    report = {"checkpoint": checkpoint, "run_dir": str(recipe.run_dir), "k": k, "runtime": runtime.name,
              "max_new_tokens": recipe.eval.max_new_tokens, "num_prompts": n, "cpu_isa": devices.cpu_isa(),
              "sources": {"chat": recipe.eval.prompts, **SOURCES, "code": code_source()}, "budget_tokens": BUDGET,
              "ci": CI_NOTE, "workloads": {}}
    with torch.inference_mode():
        for name, prompts in sets.items():
            started = time.time()
            for d in decoders.values():  # warm-up, untimed
                d.decode(prompts[0].ids, 8)
            report["workloads"][name] = {"prompts": len(prompts),
                                         **workload(decoders, hybrid, prompts, recipe.eval.max_new_tokens)}
            report["workloads"][name]["wall_s"] = round(time.time() - started, 1)
            print(f"{name}: {len(prompts)} prompts in {report['workloads'][name]['wall_s']} s", flush=True)
    every = report["workloads"].values()
    report["mix"] = {"prompts": sum(w["prompts"] for w in every),
                     **{d: pooled([r for w in every for r in w[d]["per_prompt"]]) for d in DRAFTERS}}
    print(f"checkpoint {report['checkpoint']} of {report['run_dir']}, K={k}, {runtime.name}, T=0, "
          f"max_new_tokens {report['max_new_tokens']}, cpu_isa {report['cpu_isa']}; {CI_NOTE}")
    print("  ".join(HEADER))
    for row in rows(report):
        print("  ".join(row))
    out = recipe.run_dir.parent / "bench" / "hybrid.json"  # beside the runs, as checkpoints/bench/runtime.json
    write_json_atomic(out, report)
    print(f"wrote {out}")
    return report


HEADER = ["workload (prompts)", "drafter", "tau [95% CI]", "speedup over plain [95% CI]", "lossless",
          "lookup's share of steps"]


def rows(report: dict) -> list[list[str]]:
    """One row per workload and drafter, then the mix's: tau [95% CI], speedup over plain decoding [95% CI],
    lossless, lookup's share of the steps."""
    ci = lambda pair: "[{:.2f}, {:.2f}]".format(*(pair or (float("nan"), float("nan"))))  # noqa: E731
    out = []
    named = [*report["workloads"].items(), *([("mix", report["mix"])] if "mix" in report else [])]
    for name, w in named:
        for d in DRAFTERS:
            r = w[d]
            share = f"{r['lookup_step_share']:.0%}" if d == "hybrid" else ("100%" if d == "lookup" else "0%")
            tau = f"{r['tau']:.2f}" + (f" {ci(r['tau_ci95'])}" if "tau_ci95" in r else "")
            out.append([f"{name} (n={w['prompts']})", d, tau, f"{r['speedup']:.2f}× {ci(r['speedup_ci95'])}",
                        "yes" if r["lossless"] else "**no**", share])
    return out


if __name__ == "__main__":
    args = sys.argv[1:]
    path = args.pop(0) if args and not "=" in args[0] else "recipes/smollm2-135m-eagle3.yaml"
    print(json.dumps(main(path, args), indent=1, default=str))
