"""Tree drafting for heads whose kind drafts trees (`DRAFTS_TREES`: the EAGLE heads): greedy verification of a whole
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
from dataclasses import dataclass

import torch
from pydantic import TypeAdapter, ValidationError

from specdistill import contracts, kinds
from specdistill.decoding.hybrid import HybridDrafter
from specdistill.decoding.lookup import PromptLookup
from specdistill.decoding.tree_drafter import DraftTree, TreeShape
from specdistill.errors import SpecdistillError
from specdistill.eval.engine import DecodeResult, SpeculativeDecoder, Target, Verified, as_runtime, decode_loop
from specdistill.eval.runtime import StaticRuntime
from specdistill.recipe import DynamicTree, TreeConfig
from specdistill.target import vocab_size_of


@dataclass
class TreeDecodeResult(DecodeResult):
    tree_fallback: bool = False  # True: T > 0, decoded by the exact chain engine with K = tree depth

    @property
    def tree_nodes(self) -> int:
        """Drafted nodes the target verified, all steps together."""
        return self.nodes


# ----------------------------------------------------------------------------- tree shapes

TREE_SCHEMA = TypeAdapter(TreeConfig)


def parse_tree(tree) -> TreeShape:
    """The recipe's `eval.tree` (a dict or an already validated StaticTree / DynamicTree) as a shape."""
    try:
        tree = TREE_SCHEMA.validate_python(tree)
    except ValidationError as e:
        raise SpecdistillError("eval.tree: " + "; ".join(err["msg"] for err in e.errors())) from None
    if isinstance(tree, DynamicTree):
        return TreeShape(tree.kind, tree.depth, tree.top_k, tree.total_tokens)
    if tree.paths is not None:
        paths = sorted({tuple(p) for p in tree.paths}, key=lambda p: (len(p), p))
        return TreeShape(tree.kind, max(len(p) for p in paths), paths=tuple(paths))
    paths = [p for d in range(1, tree.depth + 1) for p in itertools.product(range(tree.top_k), repeat=d)]
    return TreeShape(tree.kind, tree.depth, tree.top_k, paths=tuple(paths))


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

def graft(tree: DraftTree, chain: list[int]) -> int:
    """Add `chain` (prompt lookup's draft) to `tree` as a path from the root: follow a child that already holds the
    chain's next token, add a node where none does. Returns the index of the first added node (len before)."""
    first, node = len(tree.tokens), -1
    for token in chain:
        nxt = next((i for i in range(len(tree.tokens)) if tree.parents[i] == node and tree.tokens[i] == token), None)
        if nxt is None:
            tree.tokens.append(token)
            tree.parents.append(node)
            tree.depths.append(tree.depths[node] + 1 if node >= 0 else 1)
            tree.scores.append(0.0)  # read by nothing: the rerank ran before the graft
            nxt = len(tree.tokens) - 1
        node = nxt
    return first


def _select(tree: DraftTree, keep: list[int]) -> DraftTree:
    """The sub-tree of nodes `keep` (each one's parent kept too), in parent-first order."""
    keep = sorted(keep)
    new_index = {old: new for new, old in enumerate(keep)}
    parents = [new_index[tree.parents[i]] if tree.parents[i] >= 0 else -1 for i in keep]  # KeyError: not a tree
    return DraftTree([tree.tokens[i] for i in keep], parents,
                     [tree.depths[i] for i in keep], [tree.scores[i] for i in keep], tree.forwards)


# ----------------------------------------------------------------------------- the stepper

class TreeStepper:
    """One step of the decode loop (eval/engine.py `decode_loop`): draft a tree, verify it in one target
    forward with a tree mask, walk the greedy path.

    With `lookup` (the hybrid tree), prompt lookup's draft is grafted onto the head's tree as one more branch
    (after the rerank, so the head keeps its total_tokens): the target verifies both in the same forward, and the
    greedy walk takes whichever the target agrees with. `steps` counts, per decode, the steps whose accepted path
    ran through a node only lookup drafted ("lookup") and the others ("head")."""

    def __init__(self, drafter: contracts.TreeDrafting, shape: TreeShape, lookup: PromptLookup | None = None):
        # the drafter of a kind that drafts trees brings its tree drafter (EAGLE heads: TreeDrafter above;
        # Medusa: top-k per head)
        self.drafter: contracts.TreeDrafter = drafter.tree_drafter()
        self.shape, self.lookup = shape, lookup
        self.grafted = 0  # this step's first lookup-only node
        self.steps = {"lookup": 0, "head": 0}

    def reset(self, capacity: int) -> None:
        self.drafter.reset()
        self.steps = {"lookup": 0, "head": 0}

    def draft(self, seq, n, new_features, depth, temperature, generator) -> DraftTree:
        tree = self.drafter.draft(seq, n, new_features, self.shape, depth)
        if self.shape.total_tokens:  # dynamic: rerank, the best total_tokens nodes overall
            order = sorted(range(len(tree.tokens)), key=lambda i: (-tree.scores[i], i))
            tree = _select(tree, order[:self.shape.total_tokens])
        if self.lookup is not None:
            self.grafted = graft(tree, self.lookup.match(seq, n, depth).tolist())
        return tree

    def verify(self, target, seq, n, tree: DraftTree, temperature, generator) -> Verified:
        tokens = [int(seq[n - 1])] + tree.tokens  # node 0 = the pending token, the root
        parents = [-1] + [p + 1 for p in tree.parents]
        depths = [0] + tree.depths
        logits, features = target.forward(torch.tensor(tokens, device=seq.device), n - 1, parents=parents, depths=depths)
        best = logits.argmax(-1).tolist()
        path = greedy_walk(best, tokens, parents)
        a = len(path) - 1
        judged = path[a] in set(parents[1:])  # the walk's last node had children the target rejected
        if self.lookup is not None:  # node i of the walk is the tree's node i - 1
            self.steps["lookup" if any(i - 1 >= self.grafted for i in path[1:]) else "head"] += 1
        return Verified([tokens[i] for i in path[1:]] + [best[path[-1]]], path, features,
                        drafted=max(tree.depths, default=0), tested=a + judged, accepted=a,
                        draft_forwards=tree.forwards, nodes=len(tree.tokens))


class TreeDecoder:
    """Greedy tree speculative decoding of `target` with an EAGLE / EAGLE-3 head, or with the head and prompt
    lookup as branches of one tree (`lookup=True`, the hybrid tree)."""

    def __init__(self, target, head, tree, eos_ids=(), lookup: bool = False):
        """target: a runtime (eval/runtime.py) or a transformers model (run eagerly in its own dtype); head: a
        kinds.LoadedDraft (or a bare module); tree: the recipe's `eval.tree`; lookup: graft prompt lookup's draft
        onto every step's tree (at T > 0 the fallback chain is the chain hybrid, decoding/hybrid.py)."""
        draft = kinds.loaded(head)
        kind, head = draft.kind, draft.module
        if not kind.DRAFTS_TREES:
            trees = [k.NAME for k in kinds.all_kinds() if k.DRAFTS_TREES]
            raise SpecdistillError(f"tree decoding needs a draft of a kind that drafts trees ({', '.join(trees)}), "
                                   f"got {type(head).__name__}")
        self.shape = parse_tree(tree)
        ids = kind.draft_vocabulary(head)
        draft_vocab = ids.numel() if ids is not None else vocab_size_of(head)
        widest = max((p[-1] + 1 for p in self.shape.paths), default=self.shape.top_k)
        if widest > draft_vocab:
            raise SpecdistillError(f"eval.tree: {widest} children per node exceed the head's vocabulary ({draft_vocab})")
        self.runtime = as_runtime(target)
        head.to(device=self.runtime.device, dtype=self.runtime.dtype)
        self.chain_drafter: contracts.TreeDrafting = kind.drafter(  # checks the vocabulary; also the T > 0 fallback
            head, self.runtime.model, static=isinstance(self.runtime, StaticRuntime))
        self.target = Target(self.runtime, self.chain_drafter.features)
        self.lookup = PromptLookup(vocab_size_of(self.runtime.model)) if lookup else None
        self.stepper = TreeStepper(self.chain_drafter, self.shape, self.lookup)
        self.eos_ids = set(eos_ids)

    @torch.inference_mode()
    def decode(self, prompt_ids, max_new_tokens: int, temperature: float = 0.0,
               generator: torch.Generator | None = None) -> TreeDecodeResult:
        if temperature > 0:  # trees are greedy only: the exact chain, same head, K = tree depth
            drafter = self.chain_drafter if self.lookup is None else HybridDrafter(self.chain_drafter, self.lookup)
            chain = SpeculativeDecoder(self.runtime, drafter, k=self.shape.depth, eos_ids=self.eos_ids)
            res = chain.decode(prompt_ids, max_new_tokens, temperature, generator)
            return TreeDecodeResult(**vars(res), tree_fallback=True)
        return decode_loop(self.target, self.stepper, prompt_ids, max_new_tokens, self.shape.depth, self.eos_ids,
                           result=TreeDecodeResult(tokens=[]))
