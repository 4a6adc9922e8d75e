"""Runtime benchmark: what a forward over M new tokens and a draft step cost in each runtime, in one run.

For the default target and the default head kind (the recipe's last checkpoint, or an untrained head of
the same shape: a draft step's cost does not depend on its weights), in every runtime of eval/runtime.py:
ms for M = 1..9 new tokens after a 256-token cached prefix, v(M) = ms(M) / ms(1), ms per draft step and
d = draft step / ms(1), plain decoding tokens/s through our engine, and transformers' generate() tokens/s
with the same weights in the same dtype. `eager-fp32` (transformers' forward in float32, the runtime
before eval/runtime.py existed) is the reference every ratio is taken against.
Writes checkpoints/bench/runtime.json. `make bench ARGS=runtime`.
"""
from __future__ import annotations

import json
import statistics
import time

import torch

from benchmarks.decode_bench import _draft_for
from specdistill.eval.engine import SpeculativeDecoder, eos_token_ids
from specdistill.eval.prompts import load_prompts
from specdistill.eval.runtime import forward_costs, make_runtime, resolve_runtime_name
from specdistill.recipe import CHECKPOINTS, load_recipe
from specdistill.target import load_target, load_tokenizer

RUNTIMES = ["eager-fp32", "eager-bf16", "static-fp32", "static-bf16"]
PREFIX = 256
REPEATS = 15
DECODE_TOKENS = 64
DRAFT_K = 4


def _median_ms(fn, repeats: int = REPEATS) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def _prefix_ids(prompts) -> torch.Tensor:
    """Real text: MT-bench prompts back to back, cut to PREFIX + 16 tokens."""
    ids = [t for p in prompts for t in p.ids]
    while len(ids) < PREFIX + 16:
        ids = ids + ids
    return torch.tensor(ids[:PREFIX + 16])


@torch.inference_mode()
def measure(recipe, name: str, ids: torch.Tensor, prompt: list[int], eos) -> dict:
    model = load_target(recipe.target)
    draft, _, _ = _draft_for(recipe, model)
    runtime = make_runtime(model, name)
    forward_ms = forward_costs(runtime, ids[:PREFIX + 9], range(1, 10), REPEATS)

    # A draft step as the engine times it: K drafted tokens after one verify (the head first runs the
    # target's features of the newly committed position), divided by K.
    decoder = SpeculativeDecoder(runtime, draft, k=DRAFT_K)
    engine_draft, target = decoder.drafter, decoder.target
    seq = torch.cat([ids, torch.zeros(DRAFT_K + 1, dtype=torch.long)])
    target.reset(PREFIX + 64)
    engine_draft.reset(PREFIX + 64)
    _, features = target.forward(seq[:PREFIX], 0)
    n = PREFIX + 1

    def draft_step():
        engine_draft.propose(seq, n, features[-1:], DRAFT_K, 0.0, None)

    draft_step_ms = _median_ms(draft_step) / DRAFT_K

    baseline = SpeculativeDecoder(runtime, None, eos_ids=eos)
    baseline.decode(prompt, 8)  # warm-up
    res = baseline.decode(prompt, DECODE_TOKENS)
    ar_tps = len(res.tokens) / res.total_s

    gen_ids = torch.tensor([prompt])
    model.generate(gen_ids, max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(gen_ids))
    t0 = time.perf_counter()
    out = model.generate(gen_ids, max_new_tokens=DECODE_TOKENS, min_new_tokens=DECODE_TOKENS, do_sample=False,
                         attention_mask=torch.ones_like(gen_ids), pad_token_id=0)
    hf_tps = (out.shape[1] - gen_ids.shape[1]) / (time.perf_counter() - t0)

    one = forward_ms["1"]
    return {"forward_ms": forward_ms, "v": {m: ms / one for m, ms in forward_ms.items()},
            "draft_step_ms": draft_step_ms, "d": draft_step_ms / one, "ar_tokens_per_s": ar_tps,
            "hf_generate_tokens_per_s": hf_tps}


def main(recipe_path: str = "recipes/smollm2-135m-eagle3.yaml", toy: bool = False) -> dict:
    global PREFIX, REPEATS, DECODE_TOKENS
    if toy:  # proves the benchmark runs; measures nothing (and writes no result)
        PREFIX, REPEATS, DECODE_TOKENS = 16, 1, 4
    recipe = load_recipe(recipe_path, ["run_name=bench-toy"] if toy else [])
    tokenizer = load_tokenizer(recipe.target)
    prompts = load_prompts(recipe.eval, tokenizer)
    ids = _prefix_ids(prompts)
    reference = load_target(recipe.target)
    eos = eos_token_ids(reference, tokenizer)
    prompt = prompts[0].ids
    default = resolve_runtime_name("auto", reference.config)
    report = {"default": default, "target": recipe.target.path, "draft_kind": recipe.draft.kind,
              "prefix_tokens": PREFIX, "threads": torch.get_num_threads(), "runtimes": {}}
    for name in RUNTIMES:
        print(f"measuring {name} ...", flush=True)
        report["runtimes"][name] = measure(recipe, name, ids, prompt, eos)
    ref = report["runtimes"]["eager-fp32"]
    print(f"\ntarget {recipe.target.path}, {recipe.draft.kind} head, {PREFIX}-token cached prefix, "
          f"{torch.get_num_threads()} threads, median of {REPEATS}; default runtime: {default}")
    print(f"{'runtime':12} {'ms M=1':>7} {'M=5':>7} {'M=9':>7} {'v(4)':>5} {'v(5)':>5} {'v(9)':>5} "
          f"{'draft ms':>8} {'d':>5} {'AR tok/s':>8} {'AR vs eager-fp32':>16} {'hf tok/s':>8}")
    for name, r in report["runtimes"].items():
        f, v = r["forward_ms"], r["v"]
        print(f"{name:12} {f['1']:7.1f} {f['5']:7.1f} {f['9']:7.1f} {v['4']:5.2f} {v['5']:5.2f} {v['9']:5.2f} "
              f"{r['draft_step_ms']:8.2f} {r['d']:5.3f} {r['ar_tokens_per_s']:8.1f} "
              f"{r['ar_tokens_per_s'] / ref['ar_tokens_per_s']:15.2f}x {r['hf_generate_tokens_per_s']:8.1f}")
    if toy:
        return report
    out = CHECKPOINTS / "bench" / "runtime.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
