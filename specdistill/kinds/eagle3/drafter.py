"""EAGLE-3 drafting: the target's aux states fused by the head's fc in, draft-vocabulary tokens out (mapped
to target ids), the head's own output state feeding the next drafted position. `StaticEagle3Head` is the
drafting forward over a slot cache, what runs when the target runs in the static runtime (eval/runtime.py).
"""
from __future__ import annotations

import torch

from specdistill.errors import SpecdistillError
from specdistill.decoding.kv import SlotCache, chain_mask, fused_groups, rms_norm
from specdistill.decoding.linear import PackedLinears, packs, plain
from specdistill.decoding.sampling import probs_from_logits, sample
from specdistill.kinds.common.heads import HeadDrafter
from specdistill.kinds.eagle3.model import Eagle3Head
from specdistill.target import vocab_size_of


class StaticEagle3Head:
    """An EAGLE-3 head's drafting forward over a SlotCache: the same computation as `Eagle3Head.forward`
    for a chain (causal over the head's own cache), without transformers' per-call cache and mask work;
    what the engine runs when the target runs in the static runtime."""

    def __init__(self, head):
        self.head = head
        layer = head.layers[0]
        self.layer = layer
        # fp32 on the CPU: every product through weights packed once, as the target's (decoding/linear.py); a
        # draft step through nn.Linear cost 5-8% of a target forward on the AVX2 EPYC (runtime-bench-avx2's d)
        weight = head.fc.weight
        self.linear = plain
        if packs(weight.dtype, weight.device):
            self.linear = PackedLinears([m for m in head.modules() if isinstance(m, torch.nn.Linear)],
                                        fused_groups(layer))
        self.cache = SlotCache(1, layer.self_attn, head.rotary_emb, weight.dtype, linear=self.linear)

    def reset(self, capacity: int) -> None:
        self.cache.reset(capacity)

    def forward(self, ids: torch.Tensor, state: torch.Tensor, past: int) -> torch.Tensor:
        """ids [M] (token t+1 of each position), state [1, M, H] -> the head's output states [1, M, H]."""
        layer, cache = self.layer, self.cache
        m = ids.numel()
        cache.check(past + m)
        slots = torch.arange(past, past + m, device=ids.device)
        emb = self.head.embed_tokens(ids[None]).to(state.dtype)
        x = torch.cat([rms_norm(emb, layer.input_layernorm), rms_norm(state, layer.hidden_norm)], dim=-1)
        h = state + cache.attention(0, layer.self_attn, x, slots, cache.rope(slots), chain_mask(slots, cache.capacity))
        mlp, linear = layer.mlp, self.linear
        g = rms_norm(h, layer.post_attention_layernorm)
        gate, up = linear.many((mlp.gate_proj, mlp.up_proj), g)
        return h + linear(mlp.down_proj, mlp.act_fn(gate) * up)


class Eagle3Drafter(HeadDrafter):
    """EAGLE-3 head: reads the target's aux-layer states (fused by its fc), drafts over a reduced
    vocabulary mapped back to target ids; its own output state feeds the next drafted position.
    Same cache discipline as EAGLE-1's (HeadDrafter). At T>0, q is the draft-vocabulary distribution placed on
    the target ids (zero elsewhere), which keeps the accept/residual rule exact."""
    additive_tree_mask = False  # the head's attention takes the boolean mask itself

    def __init__(self, head, static: bool = False):
        super().__init__(head)
        self.draft_ids = head.draft_ids
        self.vocab = head.config.vocab_size
        self.static = StaticEagle3Head(head) if static else None  # the static runtime's lean drafting forward
        self.linear = self.static.linear if static else plain  # fc and lm_head multiply as the static forward does

    def reset(self, capacity: int = 0) -> None:
        if self.static is None:
            return super().reset(capacity)
        self.static.reset(capacity)

    def run(self, ids, state, start):
        if self.static is None:
            return super().run(ids, state, start)
        return self.static.forward(ids, state, start)  # slots past `start` are masked: no crop needed

    def features(self, hidden_states):
        return self.head.target_features(hidden_states, self.head.aux_layers)

    def project(self, features):
        return self.head.project(features, self.linear)

    def to_target(self, ids):
        return self.draft_ids[ids]

    def pick(self, h, temperature, generator):
        logits = self.head.logits(h, self.linear)
        if temperature == 0:
            return self.to_target(logits.argmax(-1)), None
        qd = probs_from_logits(logits, temperature)
        q = torch.zeros(self.vocab, dtype=qd.dtype, device=qd.device).index_copy_(0, self.draft_ids, qd)
        return self.to_target(sample(qd, generator)), q


def drafter(head: Eagle3Head, target_model=None, static: bool = False) -> Eagle3Drafter:
    """static: the target runs in the static runtime, and the head drafts over a slot cache too."""
    if target_model is not None and head.config.vocab_size != vocab_size_of(target_model):
        raise SpecdistillError(f"draft: EAGLE-3 head built for vocabulary size {head.config.vocab_size}, "
                               f"the target's is {vocab_size_of(target_model)}")
    return Eagle3Drafter(head, static)


def prompt_logits(head: Eagle3Head, target_model, seq: torch.Tensor):
    """(p, q) logits [T, V] over `seq`, teacher-forced (head row t predicts target row t+1; row 0 has none);
    q is -inf outside the draft vocabulary."""
    out = target_model(seq, output_hidden_states=True)
    p_logits = out.logits[0]
    t = seq.shape[1]
    state = head.project(head.target_features(out.hidden_states, head.aux_layers)[:, :-1])
    qd = head.logits(head(seq[:, 1:], state, torch.arange(t - 1, device=seq.device)[None])[0])
    q = torch.full((t - 1, p_logits.shape[-1]), float("-inf"), dtype=qd.dtype, device=qd.device)
    q = q.index_copy_(1, head.draft_ids, qd)
    return p_logits, torch.cat([torch.zeros_like(p_logits[:1]), q.to(p_logits.dtype)])
