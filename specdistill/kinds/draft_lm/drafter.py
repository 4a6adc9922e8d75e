"""Drafting with a draft LM: its own KV cache, K tokens autoregressively."""
from __future__ import annotations

import torch

from specdistill.decoding.kv import crop_cache, new_cache
from specdistill.decoding.sampling import pick, stack_draws
from specdistill.target import check_same_vocab


class DraftLMDrafter:
    """A small causal LM with the target's vocabulary and its own KV cache."""
    needs_features = False

    def __init__(self, model):
        self.model = model.eval().requires_grad_(False)
        self.cache = None

    def features(self, hidden_states):
        return None  # it reads no target states, only tokens (the engine never asks: needs_features is False)

    def reset(self, capacity: int = 0) -> None:
        self.cache = new_cache(self.model.config)

    def propose(self, seq, n, new_features, k, temperature, generator):
        crop_cache(self.cache, n - 1)  # drop rejected drafts; accepted ones are committed tokens now
        cached = self.cache.get_seq_length()
        feed = seq[cached:n]  # committed tokens it has not seen yet, the pending one last
        tokens, qs = [], []
        for i in range(k):
            logits = self.model(feed[None], past_key_values=self.cache, use_cache=True).logits[0, -1]
            tok, q = pick(logits, temperature, generator)
            tokens.append(tok)
            qs.append(q)
            feed = tok.view(1)
        return stack_draws(tokens, qs, seq.device)


def drafter(model, target_model=None, static: bool = False) -> DraftLMDrafter:
    if target_model is not None:
        check_same_vocab(target_model, model)
    return DraftLMDrafter(model)


def prompt_logits(model, target_model, seq: torch.Tensor):
    """(p, q) logits [T, V] over `seq`: both read the same tokens."""
    return target_model(seq).logits[0], model(seq).logits[0]
