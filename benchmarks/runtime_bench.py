"""Runtime benchmark: what a forward over M new tokens and a draft step cost in each runtime, in one run.

For the default target and the default head kind (the recipe's last checkpoint, or an untrained head of
the same shape: a draft step's cost does not depend on its weights), in every runtime of eval/runtime.py,
on the recipe's device: ms for M = 1..9 new tokens after a 256-token cached prefix, v(M) = ms(M) / ms(1),
ms per draft step and d = draft step / ms(1), plain decoding tokens/s through our engine, whether
speculative decoding at T=0 (K=4) is token-identical to plain decoding in that runtime, and
transformers' generate() tokens/s with the same weights in the same dtype. `compiled-bf16` is the static
runtime under torch.compile: its compile time is measured apart (the first compiled forward) and kept out
of every per-token figure. `eager-fp32` (transformers' forward in float32, the runtime before
eval/runtime.py existed) is the reference every ratio is taken against; `static-fp32 nn.Linear` is static-fp32
without its packed weights and `static-fp32 unfused` without its fused products (the baselines of
specdistill/decoding/linear.py), also timed against static-fp32 forward by forward in turn (`paired`). Timers wait
for the device.
Writes checkpoints/bench/runtime.json. `make bench ARGS=runtime`.
"""
from __future__ import annotations

import json
import statistics

import torch

from benchmarks.decode_bench import draft_for
from specdistill import device as devices
from specdistill.eval.engine import SpeculativeDecoder, eos_token_ids
from specdistill.eval.prompts import load_prompts
from specdistill.eval.runtime import forward_costs, make_runtime, resolve_runtime_name
from specdistill.recipe import CHECKPOINTS, load_recipe
from specdistill.target import load_target, load_tokenizer

# "static-fp32 nn.Linear": the static runtime in fp32 through nn.Linear's own products (MKL's sgemm on the CPU), what
# static-fp32 ran before its weights were packed for oneDNN (specdistill/decoding/linear.py): that change's baseline
UNPACKED = "static-fp32 nn.Linear"
# "static-fp32 unfused": packed, but q, k, v and gate, up each their own call (decoding/linear.py's groups' baseline)
UNFUSED = "static-fp32 unfused"
BASELINES = {UNPACKED: {"pack": False}, UNFUSED: {"fuse": False}}
RUNTIMES = ["eager-fp32", "eager-bf16", "static-fp32", UNFUSED, UNPACKED, "static-bf16", "compiled-bf16"]
# The paired comparison: static-fp32 against its baselines, one forward each in turn (order alternating), so that
# the machine's drift over minutes cancels (one after the other, runtime-bench-avx2's columns disagreed on M=1)
PAIRED = ["static-fp32", UNFUSED, UNPACKED]
PAIRED_ROUNDS = 40
PAIRED_SIZES = (1, 3)
PREFIX = 256
REPEATS = 15
DECODE_TOKENS = 64
DRAFT_K = 4


def _median_ms(fn, now, repeats: int = REPEATS) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = now()
        fn()
        times.append(now() - t0)
    return 1000 * statistics.median(times)


def _runtime(model, name: str):
    return make_runtime(model, "static-fp32", **BASELINES[name]) if name in BASELINES else make_runtime(model, name)


@torch.inference_mode()
def paired(recipe, names: list[str], ids: torch.Tensor, device) -> dict:
    """Median ms of each runtime's M-token forward after the PREFIX-token cached prefix, the runtimes taking turns
    (one forward each, order alternating) for PAIRED_ROUNDS rounds, and the median over rounds of each one's time /
    the first's: a ratio the machine's drift does not move."""
    now = devices.clock(device)
    runtimes = {name: _runtime(load_target(recipe.target, device=device), name) for name in names}
    for runtime in runtimes.values():
        runtime.reset(PREFIX + 16)
        runtime.forward(ids[:PREFIX], 0, logits_to_keep=1)
    out = {}
    for m in PAIRED_SIZES:
        times = {name: [] for name in names}
        for i in range(PAIRED_ROUNDS + 1):
            for name in (names if i % 2 else names[::-1]):
                t0 = now()
                runtimes[name].forward(ids[PREFIX:PREFIX + m], PREFIX)
                times[name].append(now() - t0)
        times = {name: t[1:] for name, t in times.items()}  # the first round warms up
        first = times[names[0]]
        out[str(m)] = {name: {"ms": 1000 * statistics.median(t),
                              "ratio": statistics.median(a / b for a, b in zip(t, first))} for name, t in times.items()}
    return out


def _prefix_ids(prompts, device) -> torch.Tensor:
    """Real text: MT-bench prompts back to back, cut to PREFIX + 16 tokens."""
    ids = [t for p in prompts for t in p.ids]
    while len(ids) < PREFIX + 16:
        ids = ids + ids
    return torch.tensor(ids[:PREFIX + 16], device=device)


@torch.inference_mode()
def measure(recipe, name: str, ids: torch.Tensor, prompt: list[int], eos, device) -> dict:
    now = devices.clock(device)
    model = load_target(recipe.target, device=device)
    draft, _, _ = draft_for(recipe, model)
    runtime = _runtime(model, name)
    # The first compiled forwards compile (a decode step, then a verify): timed apart, before anything else.
    runtime.reset(PREFIX + 64)
    runtime.forward(ids[:PREFIX], 0, logits_to_keep=1)  # a prefill runs eagerly in every runtime
    t0 = now()
    runtime.forward(ids[PREFIX:PREFIX + 1], PREFIX)
    runtime.forward(ids[PREFIX:PREFIX + 5], PREFIX)
    first_forwards_s = now() - t0
    forward_ms = forward_costs(runtime, ids[:PREFIX + 9], range(1, 10), REPEATS)

    # A draft step as the engine times it: K drafted tokens after one verify (the head first runs the
    # target's features of the newly committed position), divided by K.
    decoder = SpeculativeDecoder(runtime, draft, k=DRAFT_K, eos_ids=eos)
    engine_draft, target = decoder.drafter, decoder.target
    seq = torch.cat([ids, torch.zeros(DRAFT_K + 1, dtype=torch.long, device=device)])
    target.reset(PREFIX + 64)
    engine_draft.reset(PREFIX + 64)
    _, features = target.forward(seq[:PREFIX], 0)
    n = PREFIX + 1

    def draft_step():
        engine_draft.propose(seq, n, None if features is None else features[-1:], DRAFT_K, 0.0, None)

    draft_step_ms = _median_ms(draft_step, now) / DRAFT_K

    baseline = SpeculativeDecoder(runtime, None, eos_ids=eos)
    baseline.decode(prompt, 8)  # warm-up
    res = baseline.decode(prompt, DECODE_TOKENS)
    ar_tps = len(res.tokens) / res.total_s
    spec = decoder.decode(prompt, DECODE_TOKENS)  # T=0: must be plain decoding's tokens, verify shapes and all

    gen_ids = torch.tensor([prompt], device=device)
    model.generate(gen_ids, max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(gen_ids))
    t0 = now()
    out = model.generate(gen_ids, max_new_tokens=DECODE_TOKENS, min_new_tokens=DECODE_TOKENS, do_sample=False,
                         attention_mask=torch.ones_like(gen_ids), pad_token_id=0)
    hf_tps = (out.shape[1] - gen_ids.shape[1]) / (now() - t0)

    one = forward_ms["1"]
    return {"forward_ms": forward_ms, "v": {m: ms / one for m, ms in forward_ms.items()},
            "draft_step_ms": draft_step_ms, "d": draft_step_ms / one, "ar_tokens_per_s": ar_tps,
            "t0_exact": spec.tokens == res.tokens, "plain_tokens": res.tokens,
            "first_forwards_s": first_forwards_s, "hf_generate_tokens_per_s": hf_tps}


def run(recipe_path: str) -> dict:
    """The benchmark at full size on a pinned recipe (experiments/run.py's bench runner)."""
    return main(recipe_path)


def main(recipe_path: str = "recipes/smollm2-135m-eagle3.yaml", toy: bool = False) -> dict:
    """toy: a 16-token prefix, 1 repeat, 4 decoded tokens, three runtimes (the eager-fp32 reference, the unpacked
    static-fp32 and `auto`'s: the others run the same measure(); the compiled one would spend minutes compiling on a
    CPU): proves the benchmark runs, measures nothing, writes no result. A CPU without native bf16 measures the fp32
    runtimes only."""
    global PREFIX, REPEATS, DECODE_TOKENS, PAIRED_ROUNDS
    if toy:
        PREFIX, REPEATS, DECODE_TOKENS, PAIRED_ROUNDS = 16, 1, 4, 1
    recipe = load_recipe(recipe_path, ["run_name=bench-toy"] if toy else [])
    device = devices.resolve(recipe.device)
    tokenizer = load_tokenizer(recipe.target)
    prompts = load_prompts(recipe.eval, tokenizer)
    ids = _prefix_ids(prompts, device)
    reference = load_target(recipe.target)
    eos = eos_token_ids(reference, tokenizer)
    prompt = prompts[0].ids
    default = resolve_runtime_name("auto", reference.config)
    native = devices.native_bf16(device)
    if not native:  # bf16 emulated (~8x an fp32 matmul): the plan runs fp32 here, and so does this bench
        default = default.replace("bf16", "fp32")
    runtimes = ["eager-fp32", UNPACKED, default] if toy else RUNTIMES
    if not toy and not native:
        print(f"no native bf16 on this CPU ({devices.cpu_isa()}): the bf16 runtimes are not measured")
        runtimes = [name for name in runtimes if "bf16" not in name]
    report = {"default": default, "target": recipe.target.path, "draft_kind": recipe.draft.kind,
              "prefix_tokens": PREFIX, "hardware": devices.hardware(device), "runtimes": {}}
    for name in runtimes:
        print(f"measuring {name} ...", flush=True)
        report["runtimes"][name] = measure(recipe, name, ids, prompt, eos, device)
    if default in PAIRED:
        print("paired: static-fp32 and its baselines, forwards in turn ...", flush=True)
        report["paired"] = paired(recipe, PAIRED, ids, device)
    ref = report["runtimes"]["eager-fp32"]
    default_tokens = report["runtimes"][default]["plain_tokens"]
    for r in report["runtimes"].values():
        r["same_tokens_as_default"] = r["plain_tokens"] == default_tokens
    hw = report["hardware"]
    print(f"\ntarget {recipe.target.path}, {recipe.draft.kind} head, {PREFIX}-token cached prefix, {hw['device']} "
          f"({hw.get('gpu') or hw['cpu']}), {hw['threads']} threads, median of {REPEATS}; default runtime: {default}")
    print(f"{'runtime':21} {'ms M=1':>7} {'M=5':>7} {'M=9':>7} {'v(4)':>5} {'v(5)':>5} {'v(9)':>5} "
          f"{'draft ms':>8} {'d':>5} {'AR tok/s':>8} {'AR vs eager-fp32':>16} {'T=0 exact':>9} {'1st fwd s':>9} "
          f"{'hf tok/s':>8}")
    for name, r in report["runtimes"].items():
        f, v = r["forward_ms"], r["v"]
        print(f"{name:21} {f['1']:7.1f} {f['5']:7.1f} {f['9']:7.1f} {v['4']:5.2f} {v['5']:5.2f} {v['9']:5.2f} "
              f"{r['draft_step_ms']:8.2f} {r['d']:5.3f} {r['ar_tokens_per_s']:8.1f} "
              f"{r['ar_tokens_per_s'] / ref['ar_tokens_per_s']:15.2f}x {'yes' if r['t0_exact'] else 'NO':>9} "
              f"{r['first_forwards_s']:9.1f} {r['hf_generate_tokens_per_s']:8.1f}")
    print("T=0 exact: speculative decoding (K=4) token-identical to plain decoding in the same runtime; "
          "1st fwd s: the first decode step and verify (compile time for compiled-bf16), not in any other figure")
    for m, row in report.get("paired", {}).items():
        print(f"paired, M={m}: " + ", ".join(f"{name} {r['ms']:.1f} ms ({r['ratio']:.3f}x)" for name, r in row.items()))
    if toy:
        return report
    out = CHECKPOINTS / "bench" / "runtime.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
