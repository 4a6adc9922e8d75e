"""The hybrid of prompt lookup and a trained draft, as one drafter (specdistill/contracts.py `Drafter`).

Rule: where the sequence's last n-gram recurs earlier (decoding/lookup.py), draft its continuation; else let
the draft draft. Either way the target verifies exactly as for any drafter, so the hybrid is as lossless as
the engine (token-identical at T = 0, the target's distribution at T > 0: tests/test_hybrid.py).

The head behind it never misses a target state: the features of the steps lookup drafted are kept and handed
over at the head's next turn, when it runs them in one forward (its cache then holds what it would hold had it
drafted every step). A draft LM re-reads the committed tokens itself; Medusa reads only the last state.
"""
from __future__ import annotations

import torch

from specdistill.contracts import Drafter
from specdistill.decoding.lookup import PromptLookup


class HybridDrafter:
    """Lookup when the last n-gram recurs, else `head`. `steps` counts which source drafted, per decode. The
    engine asks for up to k tokens a step; lookup drafts that many, the head at most head_k (None: k)."""

    def __init__(self, head: Drafter, lookup: PromptLookup, head_k: int | None = None):
        self.head, self.lookup, self.head_k = head, lookup, head_k
        self.needs_features = head.needs_features
        self.pending: torch.Tensor | None = None  # features the head has not read yet
        self.steps = {"lookup": 0, "head": 0}

    def features(self, hidden_states):
        return self.head.features(hidden_states)

    def reset(self, capacity: int = 0) -> None:
        self.head.reset(capacity)
        self.lookup.reset(capacity)
        self.pending = None
        self.steps = {"lookup": 0, "head": 0}

    def propose(self, seq, n, new_features, k, temperature, generator):
        if new_features is not None:
            self.pending = new_features if self.pending is None else torch.cat([self.pending, new_features])
        tokens, q = self.lookup.propose(seq, n, None, k, temperature, generator)
        if tokens.numel():
            self.steps["lookup"] += 1
            return tokens, q
        self.steps["head"] += 1
        features, self.pending = self.pending, None
        head_k = k if self.head_k is None else min(k, self.head_k)
        return self.head.propose(seq, n, features, head_k, temperature, generator)
