"""Hybrid bench: the head alone, prompt lookup alone and their hybrid (specdistill/decoding/hybrid.py), per workload.

For the recipe's last checkpoint, in the recipe's eval runtime, at T=0 and the recipe's K, on two workloads:
  chat      the recipe's eval prompts (MT-bench by default);
  grounded  prompts that carry their own material: the Self-Instruct user-oriented tasks whose instance has an
            input (a passage to rewrite, summarise, answer from, code to edit), instruction + input as the user turn.
Each prompt is decoded by plain decoding and by each drafter, interleaved, every decode checked token-identical
to plain decoding. Prints tau, speedup over plain decoding (95% bootstrap over prompts) and lossless, per workload
and drafter, and for the hybrid the share of steps lookup drafted. With no checkpoint it runs an untrained head
and says so (decode_bench.draft_for). `make bench ARGS=hybrid`, or
`python -m benchmarks.hybrid_bench [recipe] [section.key=value ...]`; the record of a run:
`python -m experiments.run hybrid-workloads-avx512 --from-run checkpoints/<run_name>`.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from specdistill import device as devices
from benchmarks.decode_bench import draft_for
from specdistill.decoding.hybrid import HybridDrafter
from specdistill.decoding.lookup import PromptLookup
from specdistill.errors import SpecdistillError
from specdistill.eval.engine import SpeculativeDecoder, eos_token_ids, make_drafter, merge_counts
from specdistill.eval.prompts import Prompt, encode_prompt, load_prompts
from specdistill.eval.runtime import StaticRuntime, make_runtime
from specdistill.eval.summary import ratio_ci95
from specdistill.recipe import load_recipe
from specdistill.target import load_target, load_tokenizer, vocab_size_of

GROUNDED = Path(__file__).resolve().parents[2] / "shared" / "data" / "user_oriented_instructions.jsonl"


def grounded_prompts(tokenizer, limit: int, path: Path = GROUNDED) -> list[Prompt]:
    """The first `limit` user-oriented tasks whose first instance has an input: instruction, blank line, input."""
    if not path.is_file():
        raise SpecdistillError(f"hybrid bench: {path}: no such file (the grounded workload's prompts)")
    prompts = []
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        given = (row.get("instances") or [{}])[0].get("input", "").strip()
        if given and len(prompts) < limit:
            text = f"{row['instruction'].strip()}\n\n{given}"
            prompts.append(Prompt(text, row.get("motivation_app", "grounded"), encode_prompt(tokenizer, text)))
    return prompts


def timed(runs) -> list[dict]:
    return [{"tokens": len(r.tokens), "seconds": r.total_s} for r in runs]


def workload(decoders: dict, hybrid: HybridDrafter, prompts, max_new_tokens: int) -> dict:
    """Every decoder on every prompt (plain first on even prompts, last on odd ones); per decoder tau, speedup."""
    runs = {name: [] for name in decoders}
    lookup_steps = head_steps = 0
    for i, p in enumerate(prompts):
        order = list(decoders) if i % 2 == 0 else [*list(decoders)[1:], "plain"]
        for name in order:
            runs[name].append(decoders[name].decode(p.ids, max_new_tokens))
            if name == "hybrid":
                lookup_steps += hybrid.steps["lookup"]
                head_steps += hybrid.steps["head"]
    plain = runs["plain"]
    out = {}
    for name, rs in runs.items():
        m = merge_counts(rs)
        base = merge_counts(plain)
        out[name] = {"tau": m["tau"], "tokens_per_s": m["tokens_per_s"],
                     "speedup": m["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else 0.0,
                     "speedup_ci95": ratio_ci95(timed(rs), timed(plain)),
                     "lossless": all(r.tokens == b.tokens for r, b in zip(rs, plain))}
    out["hybrid"]["lookup_step_share"] = lookup_steps / max(1, lookup_steps + head_steps)
    return out


# toy: one prompt per workload, 4 new tokens (it proves the bench runs; tests/test_benchmarks.py)
TOY = ["eval.num_prompts=1", "eval.max_new_tokens=4", "run_name=bench-toy"]


def run(recipe_path: str, overrides: list[str] = ()) -> dict:
    """The benchmark at full size on a pinned recipe (experiments/run.py's bench runner)."""
    return main(recipe_path, overrides)


def main(recipe_path: str = "recipes/smollm2-135m-eagle3.yaml", overrides: list[str] = (), toy: bool = False) -> dict:
    recipe = load_recipe(recipe_path, [*(TOY if toy else []), *overrides])
    target = load_target(recipe.target, device=devices.resolve(recipe.device))
    tokenizer = load_tokenizer(recipe.target)
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
    n = recipe.eval.num_prompts
    report = {"checkpoint": checkpoint, "k": k, "runtime": runtime.name, "max_new_tokens": recipe.eval.max_new_tokens,
              "cpu_isa": devices.cpu_isa(), "workloads": {}}
    with torch.inference_mode():
        for name, prompts in [("chat", load_prompts(recipe.eval, tokenizer)), ("grounded", grounded_prompts(tokenizer, n))]:
            for d in decoders.values():  # warm-up, untimed
                d.decode(prompts[0].ids, 8)
            report["workloads"][name] = workload(decoders, hybrid, prompts, recipe.eval.max_new_tokens)
            report["workloads"][name]["prompts"] = len(prompts)
    print(f"checkpoint {report['checkpoint']}, K={k}, {runtime.name}, T=0, max_new_tokens {report['max_new_tokens']}, "
          f"cpu_isa {report['cpu_isa']}")
    for row in rows(report):
        print("  ".join(row))
    return report


def rows(report: dict) -> list[list[str]]:
    """One row per workload and drafter: tau, speedup over plain decoding [95% CI], lossless, lookup's share."""
    out = []
    for name, w in report["workloads"].items():
        for d in ("head", "lookup", "hybrid"):
            r = w[d]
            lo, hi = r["speedup_ci95"] or (float("nan"), float("nan"))
            share = f"{r['lookup_step_share']:.0%}" if d == "hybrid" else ("100%" if d == "lookup" else "0%")
            out.append([f"{name} (n={w['prompts']})", d, f"{r['tau']:.2f}", f"{r['speedup']:.2f}× [{lo:.2f}, {hi:.2f}]",
                        "yes" if r["lossless"] else "**no**", share])
    return out


if __name__ == "__main__":
    args = sys.argv[1:]
    path = args.pop(0) if args and not "=" in args[0] else "recipes/smollm2-135m-eagle3.yaml"
    print(json.dumps(main(path, args), indent=1, default=str))
