"""What an EAGLE head drafts a tree with, each step (eval/tree.py's TreeStepper verifies it): a tree's shape, the
drafted tree, and the EAGLE heads' tree drafter over the head's own KV cache. Medusa drafts its trees itself
(kinds/medusa/drafter.py) into the same DraftTree.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdistill.decoding.kv import additive, crop_cache, new_cache


@dataclass
class TreeShape:
    kind: str  # "static" or "dynamic"
    depth: int
    top_k: int = 1
    total_tokens: int = 0  # dynamic only: how many of the drafted nodes are verified
    paths: tuple[tuple[int, ...], ...] = ()  # static only

    @property
    def verified_tokens(self) -> int:
        """Tokens one verification forward runs: the root and the verified nodes."""
        return (self.total_tokens or len(self.paths)) + 1


@dataclass
class DraftTree:
    """Drafted nodes in parent-first order; parents[i] = -1 for children of the root."""
    tokens: list[int]
    parents: list[int]
    depths: list[int]
    scores: list[float]  # cumulative draft log-prob
    forwards: int = 0  # head forwards


class TreeDrafter:
    """The head, its own KV cache, and the tree built from it each step: the EAGLE heads' tree drafter
    (kinds/common/heads.py HeadDrafter.tree_drafter), a specdistill/contracts.py TreeDrafter."""

    def __init__(self, drafter):
        """drafter: an EAGLE kind's chain drafter (its head, feature projection and id mapping)."""
        self.chain = drafter
        self.head = drafter.head
        self.float_mask = drafter.additive_tree_mask
        self.dtype = next(self.head.parameters()).dtype
        self.cache = None

    def reset(self) -> None:
        self.cache = new_cache(self.head.config)

    def _step(self, ids, state, pos, mask):
        if mask is not None and self.float_mask:
            mask = additive(mask, self.dtype)
        return self.head(ids, state, position_ids=pos, past_key_values=self.cache, attention_mask=mask)

    def _log_probs(self, h):
        return torch.log_softmax(self.head.logits(h).float(), dim=-1)

    def draft(self, seq, n: int, new_features, shape: TreeShape, depth: int) -> DraftTree:
        """Draft a tree of at most `depth` levels after seq[:n] (see the module docstring)."""
        tree = DraftTree([], [], [], [])
        m = 0 if new_features is None else new_features.shape[0]
        real = n - 1 - m  # positions [0, real) already hold real-feature entries
        crop_cache(self.cache, real)
        if m == 0 or depth == 0:
            return tree
        state = self.chain.project(new_features[None])
        dev = seq.device
        h = self._step(seq[real + 1:n][None], state, torch.arange(real, n - 1, device=dev)[None], None)
        tree.forwards = 1
        states = {-1: h[0, -1]}  # output state of each expanded node; -1 = the root
        slots: dict[int, list[int]] = {-1: []}  # head-cache slots of a node's expanded ancestors and itself

        def add_children(parents: list[int], log_probs: torch.Tensor, ranks: list[list[int]]) -> list[int]:
            """Children of each parent at the given ranks of its draft distribution, in rank order."""
            top = log_probs.topk(max(max(r) for r in ranks) + 1, dim=-1)
            tokens = self.chain.to_target(top.indices).tolist()
            added = []
            for row, p in enumerate(parents):
                base = tree.scores[p] if p >= 0 else 0.0
                for r in ranks[row]:
                    tree.tokens.append(tokens[row][r])
                    tree.parents.append(p)
                    tree.depths.append(tree.depths[p] + 1 if p >= 0 else 1)
                    tree.scores.append(base + float(top.values[row, r]))
                    added.append(len(tree.tokens) - 1)
            return added

        def expand(nodes: list[int]) -> torch.Tensor:
            """One head forward over same-depth nodes -> their children's log-probs [len(nodes), Vd]."""
            cached = self.cache.get_seq_length()
            mask = torch.zeros(len(nodes), cached + len(nodes), dtype=torch.bool, device=dev)
            mask[:, :n - 1] = True
            for row, i in enumerate(nodes):
                mask[row, slots[tree.parents[i]]] = True
                mask[row, cached + row] = True
            ids = torch.tensor([tree.tokens[i] for i in nodes], device=dev)[None]
            state = torch.stack([states[tree.parents[i]] for i in nodes])[None]
            pos = torch.tensor([n - 2 + tree.depths[i] for i in nodes], device=dev)[None]
            out = self._step(ids, state, pos, mask[None, None])[0]
            for row, i in enumerate(nodes):
                states[i] = out[row]
                slots[i] = slots[tree.parents[i]] + [cached + row]
            tree.forwards += 1
            return self._log_probs(out)

        root_lp = self._log_probs(states[-1])[None]
        if shape.total_tokens:
            self._dynamic(shape, depth, tree, root_lp, add_children, expand)
        else:
            self._static(shape, depth, root_lp, add_children, expand)
        crop_cache(self.cache, n - 1)  # drafted entries are never reused: next step runs real features
        return tree

    @staticmethod
    def _static(shape, depth, root_lp, add_children, expand):
        node_of = {(): -1}
        for d in range(1, depth + 1):
            level = [p for p in shape.paths if len(p) == d]
            if not level:
                break
            prefixes = sorted({p[:-1] for p in level})
            nodes = [node_of[p] for p in prefixes]
            ranks = [sorted(p[-1] for p in level if p[:-1] == q) for q in prefixes]
            added = iter(add_children(nodes, root_lp if d == 1 else expand(nodes), ranks))
            for q, rs in zip(prefixes, ranks):
                for r in rs:
                    node_of[q + (r,)] = next(added)

    @staticmethod
    def _dynamic(shape, depth, tree, root_lp, add_children, expand):
        k = min(shape.top_k, root_lp.shape[-1])
        frontier = add_children([-1], root_lp, [list(range(k))])
        for _ in range(2, depth + 1):
            candidates = add_children(frontier, expand(frontier), [list(range(k))] * len(frontier))
            frontier = sorted(candidates, key=lambda i: (-tree.scores[i], i))[:k]
