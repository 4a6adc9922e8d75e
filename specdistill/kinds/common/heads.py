"""What EAGLE-style heads (EAGLE-1, EAGLE-3) share: how they are stored, the attention of a head unrolled
on its own states, and the chain drafter that feeds a head the target's features and then its own."""
from __future__ import annotations

import json

import torch

from specdistill.decoding.kv import crop_cache, new_cache
from specdistill.decoding.sampling import pick, stack_draws
from specdistill.decoding.tree_drafter import TreeDrafter


def checkpoint_config(head) -> dict:
    """The head's config as draft_config.json keeps it."""
    return json.loads(head.config.to_json_string())


def own_state_dict(head) -> dict[str, torch.Tensor]:
    """The head's own tensors under vLLM's names."""
    return head.own_state_dict()


def ttt_mask(length: int, step: int, key_padding: torch.Tensor) -> torch.Tensor:
    """Attention of unroll step `step` over the keys of steps 0..step, as the head sees them when drafting.

    Query t at step s stands for the token drafted s positions after t. When drafting, the head's cache
    holds real-feature entries for positions <= t (step 0, causal) and its own entries for depths 1..s of
    the same chain (steps 1..s, position t only: the diagonal).
    """
    t = torch.arange(length, device=key_padding.device)
    blocks = [t[None, :] <= t[:, None]] + [torch.eye(length, dtype=torch.bool, device=key_padding.device)] * step
    mask = torch.cat(blocks, dim=1)[None, None]  # [1, 1, T, (s+1)T]
    keys_ok = key_padding.bool().repeat(1, step + 1)[:, None, None, :]
    return mask & keys_ok


class HeadDrafter:
    """A head where position t reads (token t+1, the target's feature f[t]) and predicts the next state.

    Its cache keeps only positions computed from the target's real features; after each verify the
    newly verified positions are run in one forward on their real features, then K tokens are drafted
    autoregressively on the head's own predicted states (EAGLE's scheme). A kind says which features it
    reads (`features`), how it projects them (`project`), and which target ids its tokens are (`to_target`).
    A specdistill/contracts.py TreeDrafting drafter: the heads draft trees too (`tree_drafter`).
    """
    needs_features = True
    additive_tree_mask = True  # the head's body is a transformers model: a float mask (eval/tree.py)

    def __init__(self, head):
        self.head = head.eval().requires_grad_(False)
        self.cache = None

    def features(self, hidden_states):
        return hidden_states[-1]  # post final norm: the state the target's LM head reads

    def project(self, features):
        return features  # the head reads the feature itself

    def to_target(self, ids):
        return ids  # the head drafts over the target's own vocabulary

    def pick(self, h, temperature, generator):
        return pick(self.head.logits(h), temperature, generator)

    def tree_drafter(self) -> TreeDrafter:
        """Trees for eval/tree.py: the same head over a cache of its own, a tree mask per depth."""
        return TreeDrafter(self)

    def reset(self, capacity: int = 0) -> None:
        self.cache = new_cache(self.head.config)

    def run(self, ids: torch.Tensor, state: torch.Tensor, start: int) -> torch.Tensor:
        """The head over ids [M] and states [1, M, H] at positions start.. (its cache cut to `start` first)."""
        crop_cache(self.cache, start)
        positions = torch.arange(start, start + ids.numel(), device=ids.device)[None]
        return self.head(ids[None], state, positions, past_key_values=self.cache)

    def propose(self, seq, n, new_features, k, temperature, generator):
        m = 0 if new_features is None else new_features.shape[0]
        real = n - 1 - m  # positions [0, real) already hold real-feature entries
        if m == 0 or k == 0:
            return stack_draws([], [], seq.device)
        h = self.run(seq[real + 1:n], self.project(new_features[None]), real)[:, -1:]
        tokens, qs = [], []
        for i in range(k):
            tok, q = self.pick(h[0, -1], temperature, generator)
            tokens.append(tok)
            qs.append(q)
            if i + 1 < k:
                h = self.run(tok.view(1), h, n - 1 + i)
        return stack_draws(tokens, qs, seq.device)
