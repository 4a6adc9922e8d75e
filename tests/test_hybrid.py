"""Prompt lookup and the lookup/head hybrids (specdistill/decoding/lookup.py, hybrid.py; the hybrid tree, eval/tree.py):
lossless like any drafter, and the head behind the hybrid drafts as if it had read every target state."""
from __future__ import annotations

import pytest
import torch

from specdistill import kinds
from specdistill.decoding.hybrid import HybridDrafter
from specdistill.decoding.lookup import PromptLookup
from specdistill.decoding.tree_drafter import DraftTree
from specdistill.eval.engine import SpeculativeDecoder, make_drafter
from specdistill.eval.tree import TreeDecoder, graft
from tests.test_engine import (JOINT_VOCAB, PROMPTS, RecordingEagleDrafter, assert_drafts_from_scratch,
                               drafts_for, eagle_for, joint_pvalue, llama)

pytestmark = pytest.mark.usefixtures("one_thread")

# prompts whose n-grams recur, so lookup drafts on some steps and the head on others
REPEATING = [[5, 6, 7, 8, 9, 5, 6, 7], [11, 12, 11, 12, 13, 11, 12], *PROMPTS]


@pytest.fixture(scope="module")
def target():
    return llama(512, seed=0)


@pytest.fixture(scope="module")
def copying():
    """A tiny Llama whose attention outputs are zero: its next token is a function of the current one, so its greedy
    text falls into a cycle, which prompt lookup drafts whole (the random target above rarely repeats itself)."""
    model = llama(512, seed=0)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    return model


def test_lookup_drafts_the_continuation_of_the_most_recent_occurrence():
    lookup = PromptLookup(vocab_size=32, min_ngram=2, max_ngram=3)
    seq = torch.tensor([5, 6, 1, 5, 6, 2, 3, 5, 6])
    assert lookup.match(seq, 9, 2).tolist() == [2, 3]  # [5, 6] recurs at 0 and 3: the continuation of 3's
    assert lookup.match(seq, 9, 9).tolist() == [2, 3, 5, 6]  # cut at the committed tokens
    assert lookup.match(torch.tensor([1, 2, 3, 4]), 4, 3).tolist() == []  # nothing recurs
    assert lookup.match(torch.tensor([1, 2, 9, 1, 2]), 5, 3).tolist() == [9, 1, 2]
    assert PromptLookup(32, 3, 3).match(torch.tensor([1, 2, 9, 1, 2]), 5, 3).tolist() == []  # a 2-gram is too short
    tokens, q = lookup.propose(seq, 9, None, 2, 1.0, None)
    assert q.shape == (2, 32) and q.sum(1).tolist() == [1.0, 1.0] and q[0, 2] == 1 and q[1, 3] == 1


@pytest.mark.parametrize("k", [2, 4])
def test_greedy_identical_to_baseline(target, k):
    baseline = SpeculativeDecoder(target, None)
    for name, draft in drafts_for(target).items():
        hybrid = HybridDrafter(make_drafter(draft, target), PromptLookup(512))
        engine = SpeculativeDecoder(target, hybrid, k=k)
        used = {"lookup": 0, "head": 0}
        for prompt in REPEATING:
            assert engine.decode(prompt, 24).tokens == baseline.decode(prompt, 24).tokens, (name, k, prompt)
            used = {s: used[s] + hybrid.steps[s] for s in used}
        assert used["lookup"] and used["head"], (name, used)  # both sources drafted
    lookup_alone = SpeculativeDecoder(target, PromptLookup(512), k=k)
    for prompt in REPEATING:
        assert lookup_alone.decode(prompt, 24).tokens == baseline.decode(prompt, 24).tokens, (k, prompt)


def test_lookup_drafts_past_the_heads_k_and_the_head_stays_within_it(copying):
    """eval.lookup_k: the engine asks for 5 tokens a step, the head drafts at most head_k=2 of them and lookup up to
    5; still token-identical to plain decoding, and on the copying target lookup's long drafts are accepted whole."""
    baseline = SpeculativeDecoder(copying, None)
    head = make_drafter(kinds.kind("eagle3").tiny_draft(copying), copying)
    lengths = {"head": [], "lookup": []}
    propose = head.propose

    def counted(seq, n, new_features, k, temperature, generator):
        tokens, q = propose(seq, n, new_features, k, temperature, generator)
        lengths["head"].append(tokens.numel())
        return tokens, q
    head.propose = counted
    hybrid = HybridDrafter(head, PromptLookup(512), head_k=2)
    engine = SpeculativeDecoder(copying, hybrid, k=5)
    deep = 0
    for prompt in REPEATING:
        got = engine.decode(prompt, 32)
        assert got.tokens == baseline.decode(prompt, 32).tokens, prompt
        deep += got.accepted[3]  # a 4th drafted token accepted: only lookup drafts that far
    assert lengths["head"] and max(lengths["head"]) == 2, lengths
    assert deep, "lookup's drafts past the head's K were never accepted"


def test_head_after_lookup_steps_drafts_as_a_from_scratch_head(target):
    """The steps lookup drafted still reach the head: each of its drafts equals the head run without any
    cache on the target's real features of everything committed."""
    head = eagle_for(target)
    drafter = RecordingEagleDrafter(head)
    hybrid = HybridDrafter(drafter, PromptLookup(512, min_ngram=1, max_ngram=2))
    SpeculativeDecoder(target, hybrid, k=3).decode(REPEATING[0], 24)
    assert hybrid.steps["lookup"] >= 2 and len(drafter.seen) >= 2, hybrid.steps
    assert_drafts_from_scratch(target, head, drafter.seen)


TREE_KINDS = [k.NAME for k in kinds.all_kinds() if k.DRAFTS_TREES]
DYNAMIC = {"kind": "dynamic", "depth": 4, "top_k": 3, "total_tokens": 10}


def test_graft_follows_the_tree_then_adds_lookups_branch():
    # root children 7 (node 0) and 8 (node 1); 7 -> 9 (node 2)
    tree = DraftTree([7, 8, 9], [-1, -1, 0], [1, 1, 2], [-0.1, -0.2, -0.3])
    assert graft(tree, [7, 9, 4, 5]) == 3  # 7 and 9 are the head's nodes; 4 and 5 hang below 9
    assert (tree.tokens, tree.parents, tree.depths) == ([7, 8, 9, 4, 5], [-1, -1, 0, 2, 3], [1, 1, 2, 3, 4])
    assert graft(tree, [6]) == 5 and (tree.parents[5], tree.depths[5]) == (-1, 1)  # a new root child
    assert graft(tree, []) == 6 and len(tree.tokens) == 6


@pytest.mark.parametrize("kind", TREE_KINDS)
@pytest.mark.parametrize("which", ["target", "copying"])
def test_hybrid_tree_greedy_identical_to_baseline(request, which, kind):
    """Lookup's branch grafted onto the head's tree: token-identical to plain decoding, and lookup's branch is the
    accepted path on some steps (the untrained head's on others), on the copying target whole paths of it. (Wrong
    rotary positions of lookup's nodes: tests/test_tree.py's real-target test.)"""
    target = request.getfixturevalue(which)
    baseline = SpeculativeDecoder(target, None)
    draft = kinds.kind(kind).tiny_draft(target)
    for shape in ({"kind": "static", "depth": 3, "top_k": 2}, DYNAMIC):
        decoder = TreeDecoder(target, draft, shape, lookup=True)
        used, deep = {"lookup": 0, "head": 0}, 0
        for prompt in REPEATING:
            got = decoder.decode(prompt, 24)
            assert got.tokens == baseline.decode(prompt, 24).tokens, (kind, shape, prompt)
            used = {s: used[s] + decoder.stepper.steps[s] for s in used}
            deep += got.accepted[1]
        assert used["lookup"] and used["head"], (kind, shape, used)
        assert deep or which == "target", (kind, shape)  # lookup's branch is a path: 2 of its tokens in one step


def test_hybrid_tree_falls_back_to_the_chain_hybrid_at_t1(target):
    """At T > 0 trees are greedy only: the hybrid tree decodes as the chain hybrid at K = the tree's depth."""
    draft = kinds.kind(TREE_KINDS[0]).tiny_draft(target)
    tree = TreeDecoder(target, draft, DYNAMIC, lookup=True)
    chain = SpeculativeDecoder(target, HybridDrafter(make_drafter(draft, target), PromptLookup(512)), k=DYNAMIC["depth"])
    for prompt in REPEATING[:2]:
        got = tree.decode(prompt, 16, 1.0, torch.Generator().manual_seed(3))
        want = chain.decode(prompt, 16, 1.0, torch.Generator().manual_seed(3))
        assert got.tree_fallback and (got.tokens, got.accepted) == (want.tokens, want.accepted), prompt


@pytest.mark.parametrize("draft_name", kinds.KIND_NAMES)
def test_hybrid_sampling_distribution_matches_target(draft_name):
    """T = 1: the first 3 tokens' joint against p(t1, t2, t3), lookup (any recurring token) or the head drafting."""
    def hybrid(tgt, draft):
        return SpeculativeDecoder(tgt, HybridDrafter(make_drafter(draft, tgt), PromptLookup(JOINT_VOCAB, 1, 1)), k=2)

    pvalue, accepted = joint_pvalue(draft_name, make_decoder=hybrid)
    assert 0 < accepted[0] and 0 < accepted[1], accepted
    assert pvalue > 1e-3, (draft_name, pvalue)


def test_lookup_sampling_distribution_matches_target():
    pvalue, accepted = joint_pvalue("draft_lm", make_decoder=lambda tgt, d: SpeculativeDecoder(
        tgt, PromptLookup(JOINT_VOCAB, 1, 1), k=2))
    assert 0 < accepted[0], accepted  # lookup drafts and is judged (within 3 tokens it rarely reaches depth 2)
    assert pvalue > 1e-3, pvalue
