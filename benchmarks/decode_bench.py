"""Decode benchmark: our speculative speedup over our own AR baseline, and the transformers comparators.

For the recipe's last checkpoint (an untrained draft when there is none, and it says so), on the
recipe's eval prompts (MT-bench by default), at T=0 and T=1, all measured in one run on this machine:
tau, alpha, speedup, the time split per step (draft / verify), and hf generate / prompt lookup /
assisted speedups vs our baseline. `make bench ARGS=decode`, or
`python -m benchmarks.decode_bench [recipe] [section.key=value ...]`.
"""
from __future__ import annotations

import sys

import torch

from specdistill import device as devices
from specdistill import kinds, layout
from specdistill.eval import evaluate
from specdistill.eval.prompts import load_prompts
from specdistill.eval.tables import summary_line
from specdistill.recipe import load_recipe
from specdistill.target import load_target, load_tokenizer, parts_of, resolve_target


def draft_for(recipe, target):
    found = layout.checkpoints(recipe.run_dir)
    if found:
        return kinds.load_draft(found[-1], target), found[-1].name, layout.step_of(found[-1])
    print(f"no checkpoint under {recipe.run_dir}: benchmarking an UNTRAINED {recipe.draft.kind} draft "
          "(acceptance will be near zero; this measures the engine's overhead)", flush=True)
    torch.manual_seed(0)
    kind = kinds.kind(recipe.draft.kind)
    draft = kind.build(recipe, parts_of(target, resolve_target(recipe.target)))
    return kinds.LoadedDraft(draft.to(target.device).eval().requires_grad_(False), kind), "untrained", None


# toy: the chain at T=0 and T=1 on one prompt; the tuning prompts, the tree and the comparators run the same
# evaluate_checkpoint code tests/test_evaluate.py covers on tiny targets
TOY = ["eval.num_prompts=1", "eval.max_new_tokens=4", "eval.k_sweep=[]", "eval.tuning_prompts=0", "eval.tree=null",
       "eval.comparators=false", "run_name=bench-toy"]


def run(recipe_path: str, overrides: list[str] = ()) -> dict:
    """The benchmark at full size on a pinned recipe (experiments/run.py's bench runner)."""
    return main(recipe_path, overrides)


def main(recipe_path: str = "recipes/smollm2-135m-eagle3.yaml", overrides: list[str] = (), toy: bool = False) -> dict:
    recipe = load_recipe(recipe_path, ["eval.temperature=[0, 1]", *(TOY if toy else []), *overrides])
    target = load_target(recipe.target, device=devices.resolve(recipe.device))
    tokenizer = load_tokenizer(recipe.target)
    prompts = load_prompts(recipe.eval, tokenizer)
    draft, name, step = draft_for(recipe, target)
    report = evaluate.evaluate_checkpoint(evaluate.EvalRun(recipe, target, tokenizer, prompts), draft, name, step, None)
    hw = report["hardware"]
    print(f"target {recipe.target.path}, draft {draft.kind.NAME} ({name}), prompts {recipe.eval.prompts} "
          f"(n={len(prompts)}), max_new_tokens {recipe.eval.max_new_tokens}, K={recipe.eval.k}, "
          f"{hw['device']} ({hw.get('gpu') or hw['cpu']}), {hw['threads']} threads")
    for r in report["results"]:
        print(summary_line(report, r))
        print(f"  time split: draft {r['ms_per_draft_step']:.2f} ms/draft step, verify {r['ms_per_verify']:.2f} ms "
              f"(baseline {r['baseline_ms_per_verify']:.2f} ms/forward), {r['ms_per_token']:.2f} ms/token vs "
              f"baseline {r['baseline_ms_per_token']:.2f}; predicted tau (Leviathan, iid alpha) "
              f"{r['predicted_tau_leviathan']:.2f} vs measured {r['tau']:.2f}")
        if r.get("predicted_speedup_by_k"):
            print("  per K: " + "; ".join(
                f"K={k} tau {r['tau_by_k'][k]:.2f} speedup {r['speedup_by_k'][k]:.2f}x "
                f"(predicted tau/(Kd+v) {r['predicted_speedup_by_k'][k]:.2f}x)" for k in r["speedup_by_k"])
                  + f"; d {r['d']:.3f}, v(2..5) " + ", ".join(f"{report['costs']['v'][str(m)]:.2f}" for m in range(2, 6)))
    for cname, c in report["comparators"].items():
        print(f"  comparator {cname} (T=0): {c['tokens_per_s']:.1f} tok/s, speedup {c['speedup']:.2f}x vs our baseline")
    return report


if __name__ == "__main__":
    args = sys.argv[1:]
    main(*(args[:1] or ["recipes/smollm2-135m-eagle3.yaml"]), overrides=args[1:])
