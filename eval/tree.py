"""Tree drafting for EAGLE heads (EAGLE-1 `eagle`, EAGLE-3 `eagle3`): greedy verification of a whole
tree of candidates in ONE target forward (EAGLE / EAGLE-2, Medusa-style tree attention).

Same conventions as eval/engine.py: `seq[0..n-1]` are committed, the target's cache holds seq[0..n-2],
the pending token seq[n-1] is the tree's root. A node at depth d holds a token for position n-1+d.

One step:
  1. the head runs the real features the target produced since the previous step (one forward, causal,
     its own cache) -> the root's state; then drafts the tree depth by depth, one head forward per
     depth over that depth's expanded nodes, with a tree mask (a node sees the real-feature prefix
     and its own ancestors) at head position n-2+d;
  2. the target runs [root, nodes...] in ONE forward with a 4D tree mask and position_ids n-1+depth;
  3. greedy walk from the root: follow the child whose token is the target's argmax; the target adds
     its own argmax after the last accepted node;
  4. the target's KV entries of the accepted path are gathered to positions n-1.. and the rest cropped;
     the head gets the accepted nodes' real features next step, its cache is cropped to the real prefix.

Tree shapes (recipe `eval.tree`; "kind" may be left out: `total_tokens` present means dynamic):
  {"kind": "static", "depth": D, "top_k": k}   every node expands its k best children down to depth D
                                               (k + k^2 + ... + k^D nodes);
  {"kind": "static", "paths": [[0], [1], [0, 0], ...]}   EAGLE/Medusa "choices": a path lists child ranks
                                               from the root ([0, 1] = 2nd best child of the best first
                                               token); every prefix of a path must be a path too;
  {"kind": "dynamic", "depth": D, "top_k": k, "total_tokens": N}   EAGLE-2: per depth, the k frontier
                                               nodes with the highest cumulative draft log-prob each get
                                               their k best children; of all drafted nodes the N best
                                               by cumulative log-prob are verified (an ancestor always
                                               scores >= its descendants, ties go to the older node, so
                                               the kept set is a tree).

Temperature > 0: trees are greedy only here; decoding falls back to the exact chain engine
(`SpeculativeDecoder`, same head, K = tree depth) and the result says so (`tree_fallback=True`).

Counters (`DecodeResult`): index i = tree depth i+1. drafted[i]: steps whose tree reached depth i+1;
tested[i]: steps where the walk reached depth i and that node had children; accepted[i]: steps where the
walk went on to depth i+1. draft_forwards counts head forwards (one per depth, like the chain engine);
`tree_nodes` counts verified drafted nodes.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from specdistill.errors import SpecdistillError
from specdistill.eval.engine import SLACK, DecodeResult, SpeculativeDecoder, Target, as_runtime, cut_at_eos, make_draft
from specdistill.eval.runtime import StaticRuntime, additive, crop_cache


@dataclass
class TreeDecodeResult(DecodeResult):
    tree_fallback: bool = False  # True: T > 0, decoded by the exact chain engine with K = tree depth
    tree_nodes: int = 0  # drafted nodes the target verified, all steps together


# ----------------------------------------------------------------------------- tree shapes

@dataclass
class TreeShape:
    kind: str  # "static" or "dynamic"
    depth: int
    top_k: int = 1
    total_tokens: int = 0  # dynamic only
    paths: tuple[tuple[int, ...], ...] = ()  # static only


def parse_tree(tree: dict) -> TreeShape:
    """Validate the recipe's `eval.tree` dict (see the module docstring)."""
    if not isinstance(tree, dict):
        raise SpecdistillError(f"eval.tree: expected a mapping, got {tree!r}")
    kind = tree.get("kind", "dynamic" if "total_tokens" in tree else "static")
    allowed = {"static": {"kind", "depth", "top_k", "paths"}, "dynamic": {"kind", "depth", "top_k", "total_tokens"}}
    if kind not in allowed:
        raise SpecdistillError(f"eval.tree.kind: {kind!r} is not 'static' or 'dynamic'")
    unknown = sorted(set(tree) - allowed[kind])
    if unknown:
        raise SpecdistillError(f"eval.tree: unknown key(s) {unknown} for a {kind} tree")

    def positive(key):
        value = tree.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SpecdistillError(f"eval.tree.{key}: expected an integer >= 1, got {value!r}")
        return value

    if kind == "dynamic":
        return TreeShape("dynamic", positive("depth"), positive("top_k"), positive("total_tokens"))
    if "paths" in tree:
        if "depth" in tree or "top_k" in tree:
            raise SpecdistillError("eval.tree: give either paths or depth/top_k for a static tree, not both")
        paths = tree["paths"]
        ok = isinstance(paths, (list, tuple)) and paths and all(
            isinstance(p, (list, tuple)) and p and all(isinstance(r, int) and r >= 0 for r in p) for p in paths)
        if not ok:
            raise SpecdistillError("eval.tree.paths: expected a non-empty list of non-empty lists of ranks >= 0")
        paths = sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p))
        have = set(paths)
        for p in paths:
            if len(p) > 1 and p[:-1] not in have:
                raise SpecdistillError(f"eval.tree.paths: {list(p)} has no parent path {list(p[:-1])}")
        return TreeShape("static", max(len(p) for p in paths), paths=tuple(paths))
    depth, k = positive("depth"), positive("top_k")
    paths = [p for d in range(1, depth + 1) for p in itertools.product(range(k), repeat=d)]
    return TreeShape("static", depth, k, paths=tuple(paths))


# ----------------------------------------------------------------------------- verification

def greedy_walk(best: list[int], tokens: list[int], parents: list[int]) -> list[int]:
    """Node indices of the longest path from the root (0) whose every token is the target's argmax."""
    children: dict[int, list[int]] = {}
    for i in range(1, len(parents)):
        children.setdefault(parents[i], []).append(i)
    path = [0]
    while True:
        want = best[path[-1]]
        nxt = next((c for c in children.get(path[-1], ()) if tokens[c] == want), None)
        if nxt is None:
            return path
        path.append(nxt)


# ----------------------------------------------------------------------------- drafting

@dataclass
class DraftTree:
    """Drafted nodes in parent-first order; parents[i] = -1 for children of the root."""
    tokens: list[int]
    parents: list[int]
    depths: list[int]
    scores: list[float]  # cumulative draft log-prob
    forwards: int = 0  # head forwards


class TreeDrafter:
    """The head, its own KV cache, and the tree built from it each step."""

    def __init__(self, draft):
        """draft: the engine's EagleDraft / Eagle3Draft (its head, feature projection and id mapping)."""
        self.chain = draft
        self.head = draft.head
        self.float_mask = self.head.kind == "eagle"  # EAGLE-1's body is a transformers model; EAGLE-3 takes bool
        self.dtype = next(self.head.parameters()).dtype
        self.cache = None

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.head.config)

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
        h = self._step(seq[real + 1:n][None], state, torch.arange(real, n - 1)[None], None)
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
            mask = torch.zeros(len(nodes), cached + len(nodes), dtype=torch.bool)
            mask[:, :n - 1] = True
            for row, i in enumerate(nodes):
                mask[row, slots[tree.parents[i]]] = True
                mask[row, cached + row] = True
            ids = torch.tensor([tree.tokens[i] for i in nodes])[None]
            state = torch.stack([states[tree.parents[i]] for i in nodes])[None]
            pos = torch.tensor([n - 2 + tree.depths[i] for i in nodes])[None]
            out = self._step(ids, state, pos, mask[None, None])[0]
            for row, i in enumerate(nodes):
                states[i] = out[row]
                slots[i] = slots[tree.parents[i]] + [cached + row]
            tree.forwards += 1
            return self._log_probs(out)

        root_lp = self._log_probs(states[-1])[None]
        if shape.kind == "static":
            self._static(shape, depth, root_lp, add_children, expand)
        else:
            self._dynamic(shape, depth, tree, root_lp, add_children, expand)
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


def _select(tree: DraftTree, keep: list[int]) -> DraftTree:
    """The sub-tree of nodes `keep` (each one's parent kept too), in parent-first order."""
    keep = sorted(keep)
    new_index = {old: new for new, old in enumerate(keep)}
    parents = [new_index[tree.parents[i]] if tree.parents[i] >= 0 else -1 for i in keep]  # KeyError: not a tree
    return DraftTree([tree.tokens[i] for i in keep], parents,
                     [tree.depths[i] for i in keep], [tree.scores[i] for i in keep], tree.forwards)


# ----------------------------------------------------------------------------- the loop

class TreeDecoder:
    """Greedy tree speculative decoding of `target_model` with an EAGLE / EAGLE-3 head."""

    def __init__(self, target, head, tree: dict, eos_ids=()):
        """target: a runtime (eval/runtime.py) or a transformers model (run eagerly in its own dtype)."""
        if getattr(head, "kind", None) not in ("eagle", "eagle3"):
            raise SpecdistillError(f"tree decoding needs an EAGLE head (kind 'eagle' or 'eagle3'), got "
                                   f"{type(head).__name__}")
        self.shape = parse_tree(tree)
        draft_vocab = head.lm_head.weight.shape[0]
        widest = max((p[-1] + 1 for p in self.shape.paths), default=self.shape.top_k)
        if widest > draft_vocab:
            raise SpecdistillError(f"eval.tree: {widest} children per node exceed the head's vocabulary ({draft_vocab})")
        self.runtime = as_runtime(target)
        head.to(self.runtime.dtype)
        self.chain_draft = make_draft(head, self.runtime.model,  # checks the vocabulary; also the T > 0 fallback
                                      static=isinstance(self.runtime, StaticRuntime))
        self.target = Target(self.runtime, self.chain_draft.features)
        self.drafter = TreeDrafter(self.chain_draft)
        self.eos_ids = set(eos_ids)

    def draft_tree(self, seq, n, new_features, depth) -> DraftTree:
        tree = self.drafter.draft(seq, n, new_features, self.shape, depth)
        if self.shape.kind == "dynamic":  # rerank: the best total_tokens nodes overall
            order = sorted(range(len(tree.tokens)), key=lambda i: (-tree.scores[i], i))
            tree = _select(tree, order[:self.shape.total_tokens])
        return tree

    @torch.inference_mode()
    def decode(self, prompt_ids, max_new_tokens: int, temperature: float = 0.0,
               generator: torch.Generator | None = None) -> TreeDecodeResult:
        if temperature > 0:  # trees are greedy only: the exact chain, same head, K = tree depth
            chain = SpeculativeDecoder(self.runtime, self.chain_draft, k=self.shape.depth, eos_ids=self.eos_ids)
            res = chain.decode(prompt_ids, max_new_tokens, temperature, generator)
            return TreeDecodeResult(**vars(res), tree_fallback=True)
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()
        p_len = prompt.numel()
        if p_len == 0:
            raise SpecdistillError("decode: empty prompt")
        depth = self.shape.depth
        seq = torch.empty(p_len + max_new_tokens + depth + 1, dtype=torch.long)
        seq[:p_len] = prompt
        n = p_len
        res = TreeDecodeResult(tokens=[], drafted=[0] * depth, tested=[0] * depth, accepted=[0] * depth)
        target = self.target

        start = time.perf_counter()
        target.reset(p_len + max_new_tokens + SLACK)
        self.drafter.reset()
        new_features = None
        if p_len > 1:
            _, new_features = target.forward(seq[:p_len - 1], 0, logits_to_keep=1)
        res.prefill_s = time.perf_counter() - start

        while n - p_len < max_new_tokens:
            room = max_new_tokens - (n - p_len) - 1  # the target adds one token itself
            t0 = time.perf_counter()
            tree = self.draft_tree(seq, n, new_features, min(depth, room))
            t1 = time.perf_counter()
            tokens = [int(seq[n - 1])] + tree.tokens  # node 0 = the pending token, the root
            parents = [-1] + [p + 1 for p in tree.parents]
            depths = [0] + tree.depths
            logits, features = target.forward(torch.tensor(tokens), n - 1, parents=parents, depths=depths)
            best = logits.argmax(-1).tolist()
            t2 = time.perf_counter()
            path = greedy_walk(best, tokens, parents)
            a = len(path) - 1

            new, hit_eos = cut_at_eos([tokens[i] for i in path[1:]] + [best[path[-1]]], self.eos_ids)
            seq[n:n + len(new)] = torch.tensor(new)
            target.runtime.keep_path(n - 1, [n - 1 + i for i in path[:len(new)]])
            n += len(new)
            new_features = features[path]

            res.steps += 1
            res.draft_forwards += tree.forwards
            res.tree_nodes += len(tree.tokens)
            res.draft_s += t1 - t0
            res.verify_s += t2 - t1
            has_children = {p for p in parents[1:]}
            for d in set(tree.depths):
                res.drafted[d - 1] += 1
            for d in range(a + 1):
                if d < depth and path[d] in has_children:
                    res.tested[d] += 1
            for d in range(a):
                res.accepted[d] += 1
            if hit_eos:
                res.stop = "eos"
                break
        res.total_s = time.perf_counter() - start
        res.tokens = seq[p_len:n].tolist()
        return res
