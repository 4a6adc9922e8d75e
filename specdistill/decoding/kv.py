"""The KV caches and masks a drafter and the target's runtimes share: transformers' DynamicCache made rollable,
the static slot-indexed cache (gpt-fast's design; eval/runtime.py StaticRuntime and the EAGLE-3 static head run
over it), the masks a chain or a tree attends with, and the Llama pieces that cache's attention needs.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache

from specdistill.decoding.linear import plain
from specdistill.errors import SpecdistillError


def tree_mask(parents: list[int], device) -> torch.Tensor:
    """parents[i] < i (root: -1) -> bool [N, N] on `device`, [i, j] = j is i or an ancestor of i."""
    n = len(parents)
    anc = torch.eye(n, dtype=torch.bool, device=device)
    for i, p in enumerate(parents):
        if p >= 0:
            anc[i] |= anc[p]
    return anc


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True = attend) as the float mask transformers adds to attention scores."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)


def new_cache(config) -> DynamicCache:
    """A KV cache that can be rolled back; sliding-window layers keep what a rollback needs."""
    cache = DynamicCache(config=config)
    cache.activate_past_recording()
    return cache


def crop_cache(cache, n: int) -> None:
    """Roll a KV cache back to its first n positions (a negative crop: the positive form is deprecated)."""
    extra = cache.get_seq_length() - n
    if extra > 0:
        cache.crop(-extra)


def rms_norm(x: torch.Tensor, norm) -> torch.Tensor:
    """transformers' Llama RMSNorm, op for op (float32 statistics, weight applied in the input dtype)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(x.dtype)


def fused_groups(layer) -> list[tuple]:
    """A Llama-style decoder layer's products that read the same input (packed as one: decoding/linear.py)."""
    attn, mlp = layer.self_attn, layer.mlp
    return [(attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)]


class SlotCache:
    """Keys and values of some attention layers, preallocated for `capacity` slots and indexed by slot,
    with the rope table of every position: what the static runtime and the static draft head share."""

    def __init__(self, num_layers: int, attn, rotary, dtype: torch.dtype, static_addresses: bool = False,
                 linear=plain):
        """static_addresses: the tensors are inputs of a compiled forward, kept at fixed addresses (CUDA graphs
        replay on the same memory; transformers' StaticCache does the same). linear(module, x): how the attention's
        projections multiply (specdistill/decoding/linear.py)."""
        self.num_layers, self.rotary, self.dtype, self.linear = num_layers, rotary, dtype, linear
        self.static_addresses = static_addresses
        self.device = attn.q_proj.weight.device  # the cache lives beside the layers that write it
        self.head_dim = attn.head_dim
        self.half = attn.head_dim // 2  # rope's rotation: rotate_half(x) * sin == x.roll(half) * signed_sin
        self.heads = attn.q_proj.out_features // self.head_dim
        self.kv_heads = attn.k_proj.out_features // self.head_dim
        self.scaling = attn.scaling
        self.capacity = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.cos = self.sin = None

    def reset(self, capacity: int) -> None:
        """Capacity is rounded up so that nearby lengths share one shape (and one attention shape)."""
        capacity = -(-capacity // 256) * 256
        if capacity != self.capacity:
            shape = (1, self.kv_heads, capacity, self.head_dim)
            dev = self.device
            self.keys = [torch.zeros(shape, dtype=self.dtype, device=dev) for _ in range(self.num_layers)]
            self.values = [torch.zeros(shape, dtype=self.dtype, device=dev) for _ in range(self.num_layers)]
            probe = torch.zeros(1, 1, self.head_dim, dtype=self.dtype, device=dev)
            cos, sin = self.rotary(probe, torch.arange(capacity, device=dev)[None])  # the model's own rope, scaling included
            # the sin signed once, so that a rotation is one roll, not rotate_half's four ops (a sign flip is exact)
            half = self.half
            self.cos, self.sin = cos[0], torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)
            self.capacity = capacity
            if self.static_addresses:
                for t in (*self.keys, *self.values):
                    torch._dynamo.mark_static_address(t)
                    torch._dynamo.mark_dynamic(t, 2)  # capacity: one compiled graph for every prompt length
                for t in (self.cos, self.sin):
                    torch._dynamo.mark_static_address(t)
                    torch._dynamo.mark_dynamic(t, 0)

    def check(self, end: int) -> None:
        if end > self.capacity:
            raise SpecdistillError(f"static runtime: {end} slots needed, the cache holds {self.capacity}")

    def keep_path(self, start: int, slots: list[int]) -> None:
        """Move the entries at `slots` (ascending, >= start) to start, start+1, ..."""
        idx = torch.tensor(slots, device=self.device)
        for cache in (*self.keys, *self.values):
            cache[:, :, start:start + len(slots)] = cache.index_select(2, idx)

    def rope(self, positions: torch.Tensor):
        """(cos, signed sin) at `positions`, as `attention` takes them."""
        return self.cos[positions][None, None], self.sin[positions][None, None]

    def attention(self, i: int, attn, x, slots, rope, mask):
        """transformers' Llama/Qwen attention of layer i for x [1, M, D_in], writing its keys/values at
        `slots`; mask [1, 1, 1, M, capacity] (True = attend)."""
        cos, sin = rope
        shape = (1, x.shape[1], -1, self.head_dim)
        linear = self.linear
        q, k, v = linear.many((attn.q_proj, attn.k_proj, attn.v_proj), x)
        q, k, v = q.view(shape), k.view(shape), v.view(shape).transpose(1, 2)
        if hasattr(attn, "q_norm"):  # Qwen3: per-head norms before rope
            q, k = rms_norm(q, attn.q_norm), rms_norm(k, attn.k_norm)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q = q * cos + q.roll(self.half, -1) * sin
        k = k * cos + k.roll(self.half, -1) * sin
        self.keys[i].index_copy_(2, slots, k)
        self.values[i].index_copy_(2, slots, v)
        out = self._attend(q, self.keys[i], self.values[i], mask)
        return linear(attn.o_proj, out.transpose(1, 2).reshape(1, x.shape[1], -1))

    def _attend(self, q, k, v, mask):
        """Attention of q [1, H, M, D] over every slot, with the query heads that share a KV head stacked
        as rows of one matmul (no repeated KV). Not torch's fused SDPA: on this CPU its bf16 kernel gives
        a row a different result when 5 or more rows share the call; two matmuls with a float32 softmax
        between them (transformers' eager attention) do not."""
        m = q.shape[2]
        groups = self.heads // self.kv_heads
        scores = torch.matmul(q.reshape(1, self.kv_heads, groups * m, self.head_dim), k.transpose(-1, -2))
        scores = scores.view(1, self.kv_heads, groups, m, -1) * self.scaling
        # scores is a fresh tensor (the product by scaling): filled in place, no copy
        probs = scores.float().masked_fill_(~mask, float("-inf")).softmax(-1).to(q.dtype)
        return torch.matmul(probs.view(1, self.kv_heads, groups * m, -1), v).view(1, self.heads, m, self.head_dim)


def chain_mask(slots: torch.Tensor, capacity: int) -> torch.Tensor:
    """Each new slot sees every slot up to itself: [1, 1, 1, M, capacity]."""
    return (torch.arange(capacity, device=slots.device)[None, :] <= slots[:, None])[None, None, None]
