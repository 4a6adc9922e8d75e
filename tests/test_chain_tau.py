"""The simulated tau matches decoding: replayed along the target's own greedy continuations it equals the
tau the engine measures at T=0, for every kind that drafts chains (tiny fp32 models, small vocabulary so
that drafts are often accepted and the chain reaches every depth)."""
from __future__ import annotations

import pytest
import torch

from specdistill import kinds
from specdistill.eval import chain_tau
from specdistill.eval.engine import SpeculativeDecoder, merge_counts
from tests.test_engine import eagle3_for, eagle_for, llama

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 5
PROMPTS = [[1, 2, 3, 0], [3, 0, 1], [2] * 5, [3, 1, 2, 1, 0, 2, 0]]


def target_model():
    return llama(VOCAB, seed=3, init=0.1)  # p neither flat nor peaked: greedy acceptance well inside (0, 1)


@pytest.mark.parametrize("eos", [(), (0,)], ids=["length", "eos"])
@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("kind", kinds.KIND_NAMES)
def test_simulated_tau_on_continuations_equals_measured_tau(kind, k, eos):
    tgt = target_model()
    draft = kinds.kind(kind).tiny_draft(tgt, k=3)  # the kind's own (EAGLE-3's lacks token 2)
    baseline = SpeculativeDecoder(tgt, None, eos_ids=eos)
    chain = SpeculativeDecoder(tgt, draft, k=k, eos_ids=eos)
    continuations = [baseline.decode(p, 24).tokens for p in PROMPTS]
    runs = [chain.decode(p, 24) for p in PROMPTS]
    assert [r.tokens for r in runs] == continuations  # lossless: decoding commits exactly these texts
    assert any(r.stop == "eos" for r in runs) == bool(eos)
    measured = merge_counts(runs)
    assert 0 < measured["alpha_at"][-1] and measured["alpha"] < 1  # every depth reached, not all accepted
    simulated = chain_tau.on_continuations(chain, PROMPTS, continuations, k, 24)
    assert simulated["steps"] == measured["steps"] and simulated["tokens"] == measured["tokens"]
    assert abs(simulated["tau"] - measured["tau"]) <= 0.02  # exact here (fp32): the steps are decoding's


def test_heldout_chain_extremes():
    """Along held-out text: a draft that is the target accepts all K at every position (tau = K + 1), an
    EAGLE-3 head whose draft vocabulary lacks every greedy token accepts none (tau = 1)."""
    tgt, k = target_model(), 3
    ids = torch.tensor(PROMPTS[0] + SpeculativeDecoder(tgt, None).decode(PROMPTS[0], 20).tokens)
    with torch.no_grad():
        out = tgt(ids[None], output_hidden_states=True)
    greedy, trained = out.logits[0].argmax(-1), torch.ones(ids.numel(), dtype=torch.bool)
    trained[:len(PROMPTS[0])] = False  # the prompt is not the target's greedy text
    self_draft = kinds.kind("draft_lm").drafter(tgt)
    full = chain_tau.on_heldout(self_draft, [(ids, None, greedy, trained)], k, 1000)
    assert full["chain_tau"]["0"] == k + 1 and full["chain_positions"] == 20 - k + 1
    missing = [t for t in range(VOCAB) if t not in set(greedy.tolist())] or [0]
    head = eagle3_for(tgt, missing)
    features = head.target_features(out.hidden_states, head.aux_layers)[0]
    none = chain_tau.on_heldout(kinds.kind("eagle3").drafter(head), [(ids, features, greedy, trained)], k, 5)
    assert none["chain_tau"]["0"] == 1.0 and none["chain_positions"] == 5  # capped at max_positions


def test_heldout_chain_leaves_a_training_head_trainable():
    tgt = target_model()
    head = eagle_for(tgt).train()
    before = [p.requires_grad for p in head.parameters()]
    ids = torch.tensor(PROMPTS[3] + [1, 2, 3, 4])
    with torch.no_grad():
        h = tgt(ids[None], output_hidden_states=True).hidden_states[-1][0]
    batch = {"input_ids": ids[None], "attention_mask": torch.ones(1, ids.numel(), dtype=torch.long),
             "loss_mask": torch.ones(1, ids.numel(), dtype=torch.long), "hidden_last": h[None]}

    class Parts:
        config, lm_head = tgt.config, tgt.get_output_embeddings()
    got = chain_tau.heldout_chain_tau(kinds.kind("eagle"), head, Parts, [batch], 2, 100)
    assert 1.0 <= got["chain_tau"]["0"] <= 3.0 and got["chain_positions"] == ids.numel() - 1 - 2 + 1
    assert [p.requires_grad for p in head.parameters()] == before and any(before) and head.training
