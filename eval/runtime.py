"""Runtimes: how the target runs its forwards while decoding (`eval.runtime` in the recipe).

The engine, the baseline, the tree decoder and the comparators ask a runtime for one thing: run M new
tokens after `past` committed cache slots and give back their logits (and, for EAGLE heads, hidden
states). Two families, measured by `make bench ARGS=runtime`:

  eager-<dtype>   transformers' own forward over a DynamicCache (the reference; any architecture).
  static-<dtype>  our forward for Llama-style targets (Llama, Mistral, Qwen2, Qwen3) over a KV cache
                  preallocated once per prompt and indexed by slot (gpt-fast's design): a rollback
                  only moves the committed length, nothing is copied or concatenated, and no
                  per-forward mask or cache bookkeeping runs through Python layers.
  compiled-<dtype>  the static runtime with its fixed-shape decode forwards (up to COMPILE_MAX_TOKENS new
                  tokens) captured by torch.compile: mode "reduce-overhead" on CUDA (CUDA graphs), the
                  default mode on the CPU; a prefill (its length differs per prompt) runs eagerly.

Exactness. Speculative decoding at T=0 is lossless only if a position's logits
do not depend on how many positions share its forward (1 in plain decoding, K+1 in a verify). The
static runtime is built so that they do not: every attention runs over the whole preallocated cache
with a mask (the reduction over keys has the same length whatever M is) as two plain matmuls with a
float32 softmax (torch's fused SDPA is not row-invariant in bf16 here), norms are per row in float32,
and bf16 matmuls on this CPU (oneDNN, float32 accumulation) give each row the same result for any
M >= 2 — a single row goes through a matrix-vector kernel that splits the reduction differently, so a
1-token bf16 forward runs as 2 rows (the cost is the same: the forward is bound by reading the weights).
In fp32 on the CPU the linears multiply through weights packed once for oneDNN (specdistill/decoding/linear.py:
MKL's sgemm behind nn.Linear made a 3-token verify cost up to twice a 1-token forward), which gives each row the
same result for any M, as do the attention's fp32 matmuls for M >= 2: a 1-token fp32 forward runs as 2 rows too.
`tests/test_runtime.py` checks the whole forward, row by row. transformers' eager forward is not
batch-invariant in bf16 (its attention path changes with M), so `eager-bfloat16` can diverge from its
own plain decoding; the eval JSON then says so (`lossless` false, with each divergence's logit gap).
"""
from __future__ import annotations

import statistics

import torch

from specdistill import device as devices
from specdistill.decoding.linear import PackedLinears, packs, plain
from specdistill.decoding.kv import (SlotCache, additive, chain_mask, crop_cache, fused_groups, new_cache, rms_norm,
                                     tree_mask)
from specdistill.errors import SpecdistillError
from specdistill.eval.runtime_names import (  # noqa: F401  (parse_runtime, resolve_runtime_name: imported from here)
    STATIC_MODEL_TYPES, parse_runtime, resolve_runtime_name, runtime_name, static_supports)
from specdistill.target import DTYPES, load_target, load_target_config

# `auto`'s candidates on a CPU with native bf16, timed by the plan (specdistill/plan_stage.py): which verifies
# faster depends on the CPU (bf16 on the AVX-512 EPYC, fp32 on both Intel Xeons measured, experiments/README.md)
STATIC_CANDIDATES = ("static-bf16", "static-fp32")
VERIFY_MARGIN = 0.95  # fp32 is chosen over the default only where its verify costs at most this share of bf16's

# Forwards of at most this many new tokens (decode steps, verifies, trees) run compiled; longer ones are
# prefills, whose length differs per prompt, and run eagerly rather than compile a graph per prompt.
COMPILE_MAX_TOKENS = 64


def make_runtime(model, name: str, pack: bool = True, fuse: bool = True):
    """The target `model` wrapped in runtime `name` (or `auto`), its weights cast to the runtime's dtype (in place).
    pack=False, fuse=False: the baselines of a static runtime's products (StaticRuntime)."""
    name = resolve_runtime_name(name, model.config)
    family, dtype = parse_runtime(name)
    model.to(DTYPES[dtype])
    if family in ("static", "compiled"):
        if not static_supports(model.config):
            raise SpecdistillError(f"eval.runtime {name}: the static runtime supports {sorted(STATIC_MODEL_TYPES)} "
                                   f"without sliding-window attention, not this '{model.config.model_type}'; "
                                   f"use eager-{name.split('-')[1]}")
        return StaticRuntime(model, name, compiled=family == "compiled", pack=pack, fuse=fuse)
    return EagerRuntime(model, name)


def load_runtime(target_cfg, name: str, device):
    """The target loaded straight in runtime `name`'s dtype (`auto` resolved) and the runtime around it: target.dtype
    is what the cache pass ran in, and a bf16 load cast up to fp32 would not be the fp32 target."""
    name = resolve_runtime_name(name, load_target_config(target_cfg))
    target = load_target(target_cfg.model_copy(update={"dtype": parse_runtime(name)[1]}), device=device)
    return target, make_runtime(target, name)


class EagerRuntime:
    """transformers' forward over a DynamicCache that can be rolled back (sliding windows included)."""

    def __init__(self, model, name: str):
        self.model, self.name = model, name
        self.cache = None

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        return self.model.device

    def reset(self, capacity: int) -> None:
        self.cache = new_cache(self.model.config)

    def forward(self, ids: torch.Tensor, past: int, hidden: bool = False, logits_to_keep: int = 0,
                parents: list[int] | None = None, depths: list[int] | None = None):
        """ids [M] after `past` cached slots -> (logits [M or logits_to_keep, V], hidden states or None).

        parents/depths: a tree (node 0 the root); node i sits at position past + depths[i] and sees the
        cached prefix and its own ancestors."""
        kwargs = {}
        if parents is not None:
            dev = ids.device
            mask = torch.cat([torch.ones(len(parents), past, dtype=torch.bool, device=dev), tree_mask(parents, dev)], dim=1)
            kwargs = {"position_ids": (past + torch.tensor(depths, device=dev))[None],
                      "attention_mask": additive(mask, self.model.dtype)[None, None]}
        out = self.model(ids[None], past_key_values=self.cache, use_cache=True, output_hidden_states=hidden,
                         logits_to_keep=logits_to_keep, **kwargs)
        return out.logits[0], ([h[0] for h in out.hidden_states] if hidden else None)

    def crop(self, n: int) -> None:
        crop_cache(self.cache, n)

    def keep_path(self, start: int, slots: list[int]) -> None:
        """Move the KV entries at `slots` (ascending, >= start) to start, start+1, ... and crop after them."""
        idx = torch.tensor(slots, device=self.device)
        for layer in self.cache.layers:
            if type(layer).__name__ != "DynamicLayer":
                raise SpecdistillError(f"tree decoding: cache layer {type(layer).__name__} (sliding window?) is "
                                       "not supported; use chain decoding for this target")
            for name in ("keys", "values"):
                t = getattr(layer, name)
                t[:, :, start:start + len(slots)] = t.index_select(2, idx)  # index_select copies first
        crop_cache(self.cache, start + len(slots))


class StaticRuntime:
    """Our forward for Llama-style targets over a preallocated KV cache indexed by slot (gpt-fast style).

    Slot s of the cache holds the keys/values of the token at slot s; for a chain slot == position, for
    a tree the nodes take the slots after the committed prefix while their rotary positions are
    past + depth. Every attention reads all `capacity` slots through a mask, so its shape, and the
    order of every reduction in it, is the same for 1 token and for K+1 (see the module docstring).
    """

    def __init__(self, model, name: str, compiled: bool = False, pack: bool = True, fuse: bool = True):
        """pack=False keeps nn.Linear's products in fp32 too, fuse=False packs each product apart: the baselines
        `make bench ARGS=runtime` measures."""
        self.model, self.name = model, name
        inner = model.model
        self.embed, self.layers, self.norm, self.lm_head = inner.embed_tokens, inner.layers, inner.norm, model.lm_head
        # fp32 on the CPU multiplies through weights packed once (specdistill/decoding/linear.py); not under
        # torch.compile, whose graphs capture the modules' own products
        self.linear = plain
        if pack and not compiled and packs(self.dtype, self.device):
            self.linear = PackedLinears([m for m in model.modules() if isinstance(m, torch.nn.Linear)],
                                        [group for layer in self.layers for group in fused_groups(layer)], fuse)
        # every product then gives a row the same result for any M >= 2 (the module docstring)
        self.two_rows = self.dtype != torch.float32 or self.linear is not plain
        self.cache = SlotCache(len(self.layers), self.layers[0].self_attn, inner.rotary_emb, self.dtype,
                               static_addresses=compiled, linear=self.linear)
        self.compiled = None
        if compiled:  # CUDA graphs where they apply; the CPU has none, inductor's default mode there
            mode = "reduce-overhead" if self.device.type == "cuda" else "default"
            self.compiled = torch.compile(self._layers, mode=mode)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def reset(self, capacity: int) -> None:
        self.cache.reset(capacity)

    def crop(self, n: int) -> None:
        pass  # slots past the committed length are masked until overwritten: rollback is free

    def keep_path(self, start: int, slots: list[int]) -> None:
        self.cache.keep_path(start, slots)

    def forward(self, ids: torch.Tensor, past: int, hidden: bool = False, logits_to_keep: int = 0,
                parents: list[int] | None = None, depths: list[int] | None = None):
        if ids.numel() == 1 and self.two_rows:
            # A single row goes through other kernels (bf16: oneDNN's matrix-vector product; fp32: the attention's
            # matmuls) that split reductions differently, so a 1-token forward is run as 2 rows: the token and a
            # copy of it in the next slot, which nothing committed can see (masked, overwritten later).
            twice = (lambda x: None if x is None else list(x) * 2)
            logits, states = self.forward(ids.repeat(2), past, hidden, 0, twice(parents), twice(depths))
            return logits[:1], ([s[:1] for s in states] if hidden else None)
        m, cache = ids.numel(), self.cache
        cache.check(past + m)
        dev = ids.device
        slots = torch.arange(past, past + m, device=dev)
        if parents is None:
            positions, mask = slots, chain_mask(slots, cache.capacity)
        else:
            positions = past + torch.tensor(depths, device=dev)
            mask = (torch.arange(cache.capacity, device=dev)[None, :] < past).repeat(m, 1)
            mask[:, past:past + m] = tree_mask(parents, dev)
            mask = mask[None, None, None]
        if self.compiled is None or logits_to_keep or m > COMPILE_MAX_TOKENS:  # a prefill: eager
            return self._layers(ids, slots, positions, mask, hidden, logits_to_keep)
        # One graph for every M and capacity (marked dynamic), so plain decoding and verification run the same
        # kernels; hidden states always computed (they are anyway), dropped when not asked for.
        for t, dims in ((ids, (0,)), (slots, (0,)), (positions, (0,)), (mask, (3, 4))):
            for d in dims:
                if t.shape[d] > 1:  # torch.compile specialises size 1 (a 1-token fp32 forward: its own graph)
                    torch._dynamo.mark_dynamic(t, d)
        if self.device.type == "cuda":  # CUDA graphs replay into the same output memory: copy out
            torch.compiler.cudagraph_mark_step_begin()
        logits, states = self.compiled(ids, slots, positions, mask, True, 0)
        if self.device.type == "cuda":
            logits, states = logits.clone(), [s.clone() for s in states]
        return logits, (states if hidden else None)

    def _layers(self, ids, slots, positions, mask, hidden: bool, logits_to_keep: int):
        """The forward proper, shapes fixed by (M, capacity): what torch.compile captures."""
        cache, linear = self.cache, self.linear
        rope = cache.rope(positions)
        x = self.embed(ids[None])
        states = [x] if hidden else None
        for i, layer in enumerate(self.layers):
            x = x + cache.attention(i, layer.self_attn, rms_norm(x, layer.input_layernorm), slots, rope, mask)
            h = rms_norm(x, layer.post_attention_layernorm)
            mlp = layer.mlp
            gate, up = linear.many((mlp.gate_proj, mlp.up_proj), h)
            x = x + linear(mlp.down_proj, mlp.act_fn(gate) * up)
            if hidden and i + 1 < len(self.layers):
                states.append(x)
        x = rms_norm(x, self.norm)
        if hidden:
            states.append(x)  # transformers' convention: the last hidden state is after the final norm
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        logits = linear(self.lm_head, x)
        return logits[0], ([s[0] for s in states] if hidden else None)


def forward_costs(runtime, ids: torch.Tensor, sizes, repeats: int = 7) -> dict[str, float]:
    """Median ms of one forward over M new tokens after the first len(ids) - max(sizes) tokens are cached,
    for each M in `sizes` (the cost curve behind v(M) = ms(M) / ms(1)); one untimed forward first."""
    past = ids.numel() - max(sizes)
    now = devices.clock(ids.device)  # waits for the device: on a GPU, else it times kernel launches
    runtime.reset(ids.numel() + 8)
    with torch.inference_mode():
        runtime.forward(ids[:past], 0, logits_to_keep=1)
        costs = {}
        for m in sizes:
            times = []
            for i in range(repeats + 1):
                t0 = now()
                runtime.forward(ids[past:past + m], past)
                times.append(now() - t0)
                runtime.crop(past)
            costs[str(m)] = 1000 * statistics.median(times[1:])
    return costs


def verify_costs(target_cfg, device, k: int, repeats: int = 9) -> dict[str, dict[str, float]]:
    """Per static candidate: median ms of a 1-token forward (plain decoding's step) and of a K+1-token verify
    (speculative decoding's), after a 128-token prefix. Which tokens does not change the cost."""
    out = {}
    for name in STATIC_CANDIDATES:
        target, runtime = load_runtime(target_cfg, name, device)
        ids = torch.arange(128 + k + 1, device=runtime.device) * 7 % target.config.vocab_size
        out[name] = forward_costs(runtime, ids, [1, k + 1], repeats)
        del target, runtime
    return out


def fastest_verify(costs: dict[str, dict[str, float]], k: int) -> str:
    """The candidate that verifies K+1 tokens fastest: a speculative step's cost is its verify plus K draft steps
    (a few percent of it), and tau does not depend on the dtype, so this runtime decodes speculatively fastest.
    static-bf16 (`auto`'s default) unless fp32's verify is cheaper by the margin."""
    bf16, fp32 = (costs[name][str(k + 1)] for name in STATIC_CANDIDATES)
    return STATIC_CANDIDATES[1] if fp32 <= VERIFY_MARGIN * bf16 else STATIC_CANDIDATES[0]
