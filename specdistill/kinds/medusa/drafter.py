"""Drafting with Medusa heads: every head reads the same real state, the target's final-norm hidden state
at the last committed position before the pending token (position n-2, the row the decode loop hands over
last in `new_features`, exactly as it does to EAGLE-1's drafter). Head k proposes token n+k (the pending
token n-1 is the target's own). No KV cache, nothing to roll back: a head is an MLP.

  chain  head k's top choice (T=0) or a sample of head k's q (T>0): K tokens from one state. Each q is a
         proposal distribution for its position whatever was drafted before it, so the engine's accept /
         residual rule keeps the output exactly the target's.
  tree   Medusa's tree of top-k per head: a node at depth d holds one of head d-1's best tokens, whatever its
         parent (eval/tree.py verifies it with the tree mask): static shapes (every path of child ranks,
         Medusa's "choices") or dynamic ones (EAGLE-2's frontier by cumulative draft log-prob).
"""
from __future__ import annotations

import torch

from specdistill.decoding.sampling import pick, stack_draws
from specdistill.decoding.tree_drafter import DraftTree
from specdistill.kinds.medusa.model import MedusaHeads
from specdistill.target import check_same_vocab


def drafter(head: MedusaHeads, target_model=None, static: bool = False) -> "MedusaDrafter":
    """static: the target's runtime; the heads keep no cache, so it changes nothing here."""
    if target_model is not None:
        check_same_vocab(target_model, head)
    return MedusaDrafter(head)


def prompt_logits(head: MedusaHeads, target_model, seq: torch.Tensor):
    """(p, q) logits [T, V] over `seq`, teacher-forced: head 0 at row t reads f[t] and predicts token t+2 =
    target row t+1; row 0 has no draft prediction (zeros)."""
    out = target_model(seq, output_hidden_states=True)
    p_logits = out.logits[0]
    q = head.head_logits(out.hidden_states[-1][0, :-1], 0)
    return p_logits, torch.cat([torch.zeros_like(p_logits[:1]), q.to(p_logits.dtype)])


class MedusaDrafter:
    needs_features = True

    def __init__(self, head):
        self.head = head.eval().requires_grad_(False)

    def features(self, hidden_states):
        return hidden_states[-1]  # post final norm: the state the target's LM head reads

    def reset(self, capacity: int = 0) -> None:
        pass  # no cache

    def state(self, new_features):
        """The state every head reads: the newest real one (None before the first verification)."""
        return None if new_features is None or new_features.shape[0] == 0 else new_features[-1]

    def propose(self, seq, n, new_features, k, temperature, generator):
        f = self.state(new_features)
        if f is None or k == 0:
            return stack_draws([], [], seq.device)
        tokens, qs = [], []
        for logits in self.head.logits(f, heads=k):  # min(k, num_heads) heads
            tok, q = pick(logits, temperature, generator)
            tokens.append(tok)
            qs.append(q)
        return stack_draws(tokens, qs, seq.device)

    def tree_drafter(self) -> "MedusaTreeDrafter":
        return MedusaTreeDrafter(self)


class MedusaTreeDrafter:
    """What eval/tree.py's TreeStepper drafts a tree with (`draft(seq, n, new_features, shape, depth)`)."""

    def __init__(self, chain: MedusaDrafter):
        self.chain = chain
        self.head = chain.head

    def reset(self) -> None:
        pass

    def draft(self, seq, n: int, new_features, shape, depth: int):
        tree = DraftTree([], [], [], [])
        f = self.chain.state(new_features)
        depth = min(depth, self.head.config.num_heads)
        if f is None or depth == 0:
            return tree
        log_probs = torch.log_softmax(self.head.logits(f, heads=depth).float(), dim=-1)  # [depth, V]
        tree.forwards = depth  # one head per depth, as the chain counts one draft step per token
        width = max([shape.top_k] + [p[-1] + 1 for p in shape.paths])
        top = log_probs.topk(min(width, log_probs.shape[-1]), dim=-1)
        tokens, values = top.indices.tolist(), top.values.tolist()

        def add(parent: int, d: int, rank: int) -> int:
            """A node at depth d (1-based) holding head d-1's rank-th token, under `parent` (-1: the root)."""
            tree.tokens.append(tokens[d - 1][rank])
            tree.parents.append(parent)
            tree.depths.append(d)
            tree.scores.append((tree.scores[parent] if parent >= 0 else 0.0) + values[d - 1][rank])
            return len(tree.tokens) - 1

        if shape.total_tokens:  # dynamic: per depth the top_k frontier nodes each get head d's top_k
            k = min(shape.top_k, len(tokens[0]))
            frontier = [add(-1, 1, r) for r in range(k)]
            for d in range(2, depth + 1):
                children = [add(p, d, r) for p in frontier for r in range(k)]
                frontier = sorted(children, key=lambda i: (-tree.scores[i], i))[:k]
        else:  # static: every path of child ranks (parse_tree sorts parents before children)
            node_of = {(): -1}
            for path in shape.paths:
                if len(path) <= depth:
                    node_of[path] = add(node_of[path[:-1]], len(path), path[-1])
        return tree
