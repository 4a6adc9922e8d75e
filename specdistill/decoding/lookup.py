"""Prompt lookup as a drafter (specdistill/contracts.py `Drafter`): no model, the sequence drafts itself.

The last `n` committed tokens (n from `max_ngram` down to `min_ngram`) are searched for earlier in the
sequence, prompt and output alike; the tokens that followed their most recent earlier occurrence are the draft
(Saxena 2023, "prompt lookup decoding"; transformers' `prompt_lookup_num_tokens`, vLLM's `ngram` method). The
most recent occurrence rather than the first: an answer that copies a passage is copying the nearest one.

Its drafts are deterministic, so at T > 0 its q is one-hot on each drafted token: the accept/residual rule then
accepts d with probability p(d) and resamples from p with d taken out, which is exact (decoding/sampling.py).
"""
from __future__ import annotations

import torch


class PromptLookup:
    """Drafts up to k tokens copied from the sequence's own past; reads no target states."""
    needs_features = False

    def __init__(self, vocab_size: int, min_ngram: int = 2, max_ngram: int = 4):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"prompt lookup: need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.vocab_size = vocab_size
        self.min_ngram, self.max_ngram = min_ngram, max_ngram

    def features(self, hidden_states):
        return None  # it reads nothing (the engine never asks: needs_features is False)

    def reset(self, capacity: int = 0) -> None:
        pass

    def match(self, seq: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """The continuation [k'] (k' <= k, empty when no n-gram recurs) of the longest recurring suffix of seq[:n]."""
        if k <= 0:
            return seq[:0]
        for g in range(min(self.max_ngram, n - 1), self.min_ngram - 1, -1):
            windows = seq[:n - 1].unfold(0, g, 1)  # every g-gram that has a successor inside seq[:n]
            hits = (windows == seq[n - g:n]).all(dim=1).nonzero()
            if hits.numel():
                start = int(hits[-1]) + g  # after the most recent earlier occurrence
                return seq[start:min(start + k, n)]
        return seq[:0]

    def propose(self, seq, n, new_features, k, temperature, generator):
        tokens = self.match(seq, n, k).clone()
        if temperature == 0 or tokens.numel() == 0:
            return tokens, None
        q = torch.zeros(tokens.numel(), self.vocab_size, device=seq.device)
        return tokens, q.scatter_(1, tokens[:, None], 1.0)
