"""The llama8b part's measurements for `make gpu-check` (benchmarks/gpu_check.py): the cache pass's tokens/s,
the static runtime's v(M), d and T=0 exactness, and compiled-bf16 beside it; with the part's progress record."""
from __future__ import annotations

import gc
import json
import signal
import time
import traceback
from contextlib import nullcontext
from pathlib import Path

import torch

from benchmarks.runtime_bench import _median_ms
from specdistill import device as devices
from specdistill import kinds, layout
from specdistill.data.cache import resolve_store
from specdistill.data.prepare import load_prepared
from specdistill.data.target_pass import compute_shard, load_model
from specdistill.eval import runtime as runtimes
from specdistill.eval.engine import SpeculativeDecoder
from specdistill.eval.prompts import Prompt, load_prompts
from specdistill.eval.reference import divergences
from specdistill.recipe import load_recipe
from specdistill.target import load_target, load_tokenizer, resolve_aux_layers

# compiled-bf16 is timed at the end of llama8b only if this much of the part's time is left (a cold compile of
# the 8B forward plus nine CUDA-graph captures: about 60-120 s on the lent machine, by estimate), and stopped
# this long before the part's limit.
COMPILED_MIN_S = 120
COMPILED_MARGIN_S = 10

# What the running part has done so far, rewritten to its part-<name>.json after each step, so that a part
# killed at its time limit still says which steps passed and where it was.
RECORD: dict = {}


def progress(step: str, done: bool = False) -> None:
    if done:
        RECORD.setdefault("done", []).append(step)
        RECORD.pop("running", None)
    else:
        RECORD["running"] = step
    if RECORD.get("path"):
        Path(RECORD["path"]).write_text(json.dumps({k: v for k, v in RECORD.items() if k != "path"}, indent=1))


def _strict(args):
    return devices.strict_device() if not args.no_strict else nullcontext()


def measure_cache(recipe_path: Path, args) -> dict:
    """Tokens/s of the cache pass (data/cache.py compute_shard, what `specdistill cache` runs per shard) on the
    train split, after a warm-up batch, timed with the device's synchronising clock."""
    recipe = load_recipe(recipe_path)
    dev = devices.resolve(args.device)
    dd, _ = load_prepared(layout.corpus_dir(recipe.run_dir))
    split = dd["train"]
    lengths = [len(x) for x in split["input_ids"]]
    model = load_model(recipe, dev)
    store = resolve_store(recipe)  # the settings build_cache hands compute_shard (data/cache.py)
    settings = {"store": store, "aux_layers": resolve_aux_layers(recipe, model.config.num_hidden_layers),
                "dtype": recipe.cache.dtype, "topk": recipe.cache.topk, "batch_tokens": recipe.cache.batch_tokens}
    now = devices.clock(dev)
    with _strict(args):
        compute_shard(model, split, range(0, 1), lengths, settings)  # warm-up
        t0 = now()
        compute_shard(model, split, range(len(lengths)), lengths, settings)
        seconds = now() - t0
    if not settings["store"] or seconds <= 0:
        raise RuntimeError(f"the cache pass computed nothing (store {settings['store']})")
    del model
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return {"tokens": sum(lengths), "seconds": round(seconds, 3), "tokens_per_s": round(sum(lengths) / seconds, 1),
            "store": settings["store"], "model_device": str(dev)}


@torch.inference_mode()
def measure_decode(recipe_path: Path, args, prefix: int = 256, k: int = 4, new_tokens: int = 64,
                   record: dict | None = None) -> dict:
    """v(M), d (a draft step / one target forward) and T=0 exactness in the static bf16 runtime, every timer
    through device.clock; the head is the one llama8b just trained (4 steps: its acceptance is not the point)."""
    recipe = load_recipe(recipe_path)
    dev = devices.resolve(args.device)
    now = devices.clock(dev)
    model = load_target(recipe.target, dev)
    tokenizer = load_tokenizer(recipe.target)
    prompt = load_prompts(recipe.eval, tokenizer)[0].ids
    head = kinds.load_draft(layout.checkpoints(recipe.run_dir)[-1], model)
    name = runtimes.resolve_runtime_name("auto", model.config)
    runtime = runtimes.make_runtime(model, name)
    ids = torch.tensor((prompt * (prefix // len(prompt) + 2))[:prefix + 16], device=dev)
    with _strict(args):
        forward_ms = forward_costs(runtime, ids, prefix, now, args.repeats)

        decoder = SpeculativeDecoder(runtime, head, k=k)
        seq = torch.cat([ids, torch.zeros(k + 1, dtype=torch.long, device=dev)])
        decoder.target.reset(prefix + 64)
        decoder.drafter.reset(prefix + 64)
        _, features = decoder.target.forward(seq[:prefix], 0)
        draft_ms = _median_ms(lambda: decoder.drafter.propose(seq, prefix + 1, features[-1:], k, 0.0, None),
                              now, args.repeats) / k

        plain = SpeculativeDecoder(runtime, None, 0).decode(prompt, new_tokens, 0.0)
        spec = SpeculativeDecoder(runtime, head, k).decode(prompt, new_tokens, 0.0)
        # a differing decode is recorded with its logit gap (a near-tie on cuBLAS is no device bug), not failed on
        found = divergences(runtime, [Prompt("", "", prompt)], [plain], {f"chain K={k}": [spec]})
    one = forward_ms["1"]
    result = {"runtime": name, "prefix_tokens": prefix, **cost_curve(forward_ms), "draft_step_ms": round(draft_ms, 3),
              "d": round(draft_ms / one, 4), "k": k, **t0_compare(plain, spec, found), "tau_T0": round(spec.tau, 3)}
    if record is not None:  # the part's result, written now: it stands if the compiled step is stopped
        record.update(result)
        progress("measure static-bf16", done=True)
    result["compiled"] = measure_compiled(model, head, ids, prompt, prefix, k, new_tokens, now, args)
    return result


def forward_costs(runtime, ids, prefix: int, now, repeats: int) -> dict[str, float]:
    """Median ms of one forward of M = 1..9 new tokens after a `prefix`-token prefill (one untimed call first)."""
    forward_ms = {}
    runtime.reset(prefix + 32)
    runtime.forward(ids[:prefix], 0, logits_to_keep=1)
    for m in range(1, 10):
        def forward(m=m):
            runtime.forward(ids[prefix:prefix + m], prefix)
            runtime.crop(prefix)
        forward_ms[str(m)] = _median_ms(forward, now, repeats)
    return forward_ms


def cost_curve(forward_ms: dict[str, float]) -> dict:
    one = forward_ms["1"]
    return {"forward_ms": {m: round(v, 3) for m, v in forward_ms.items()},
            "v": {m: round(v / one, 3) for m, v in forward_ms.items()}}


def t0_compare(plain, spec, found: list[dict]) -> dict:
    """Plain greedy against T=0 speculative decoding: identical or not, and eval's divergence records."""
    first = next((i for i, (a, b) in enumerate(zip(plain.tokens, spec.tokens)) if a != b), None)
    return {"T0_identical": list(plain.tokens) == list(spec.tokens), "first_divergence": first,
            "T0_divergences": found, "T0_max_divergence_gap": round(found[0]["top2_logit_gap"], 4) if found else None,
            "tokens_compared": min(len(plain.tokens), len(spec.tokens))}


class _OutOfTime(Exception):
    pass


def measure_compiled(model, head, ids, prompt, prefix: int, k: int, new_tokens: int, now, args) -> dict:
    """compiled-bf16 beside static-bf16 on the same weights: the first decode forwards (torch.compile's
    compile and, on CUDA, each M's CUDA-graph capture: `warmup_s`), then ms(M) and v(M) as for static, and
    plain greedy against T=0 speculative decoding over `new_tokens`.

    Guarded, since a cold compile of an 8B forward takes a minute or more and nothing of it has run on a GPU:
    skipped when less than COMPILED_MIN_S of the part's time is left (--deadline), stopped by an alarm shortly
    before the part's limit, and an error is recorded here: the static measurements before it stand either way.
    Not under the strict-device mode: Dynamo would trace the mode's frame walk; the code it compiles is the
    static runtime's, which has just run under it."""

    from specdistill.eval.engine import SpeculativeDecoder
    from specdistill.eval.reference import divergences

    left = (args.deadline - time.time()) if getattr(args, "deadline", None) else float("inf")
    if left < COMPILED_MIN_S:
        return {"runtime": "compiled-bf16", "skipped": f"{left:.0f} s of the part left, under {COMPILED_MIN_S} s"}
    progress("measure compiled-bf16")

    def out_of_time(*_):
        raise _OutOfTime(f"stopped {COMPILED_MARGIN_S} s before the part's limit")

    alarm = left != float("inf")
    if alarm:
        before = signal.signal(signal.SIGALRM, out_of_time)
        signal.alarm(max(1, int(left - COMPILED_MARGIN_S)))
    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            runtime = runtimes.make_runtime(model, "compiled-bf16")  # the weights are already bf16: nothing is copied
            runtime.reset(prefix + 32)
            runtime.forward(ids[:prefix], 0, logits_to_keep=1)
            for m in range(1, 10):  # compile, and on CUDA one graph capture per M
                runtime.forward(ids[prefix:prefix + m], prefix)
                runtime.crop(prefix)
            warmup_s = time.perf_counter() - t0
            forward_ms = forward_costs(runtime, ids, prefix, now, args.repeats)
            plain = SpeculativeDecoder(runtime, None, 0).decode(prompt, new_tokens, 0.0)
            spec = SpeculativeDecoder(runtime, head, k).decode(prompt, new_tokens, 0.0)
            found = divergences(runtime, [Prompt("", "", prompt)], [plain], {f"chain K={k}": [spec]})
    except Exception as e:  # noqa: BLE001 - recorded beside the static numbers, which stand
        traceback.print_exc()
        return {"runtime": "compiled-bf16", "seconds": round(time.perf_counter() - t0, 1),
                "error": f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[-1]}"[:300]}
    finally:
        if alarm:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, before)
    progress("measure compiled-bf16", done=True)
    return {"runtime": runtime.name, "warmup_s": round(warmup_s, 1), "seconds": round(time.perf_counter() - t0, 1),
            **cost_curve(forward_ms), **t0_compare(plain, spec, found)}
