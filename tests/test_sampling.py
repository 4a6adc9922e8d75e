"""The accept/residual rule alone reproduces the target distribution p; wrong rules do not."""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from specdistill.decoding import sampling
from specdistill.decoding.sampling import residual, verify_chain, verify_greedy

V = 8
DRAWS = 10_000


def fixed_distributions():
    g = torch.Generator().manual_seed(1234)
    p = torch.softmax(2.0 * torch.randn(V, generator=g), -1)
    q = torch.softmax(2.0 * torch.randn(V, generator=g), -1)
    return p, q


def emitted_counts(draws: int = DRAWS) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's own verify_chain on a 1-token chain d ~ q, `draws` times: the emitted token's counts."""
    p, q = fixed_distributions()
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(V, dtype=torch.float64)
    for _ in range(draws):
        draft = torch.multinomial(q, 1, generator=g)
        a, nxt = sampling.verify_chain(torch.stack([p, p]), q[None], draft, g)
        counts[int(draft[0]) if a else nxt] += 1
    return counts, p.double()


def p_value(counts, p) -> float:
    return chisquare(counts.numpy(), (p / p.sum() * counts.sum()).numpy()).pvalue


def test_rule_reproduces_p():
    counts, p = emitted_counts()
    assert p_value(counts, p) > 1e-3


# Wrong rules, injected where verify_chain looks them up (the function the engine calls).
@pytest.mark.parametrize("name, wrong_rule", [
    ("residual", lambda p, q: p),                                          # resample from p, not the residual
    ("residual", lambda p, q: (q - p).clamp_min(0) / (q - p).clamp_min(0).sum(-1, keepdim=True)),  # sign flipped
    ("residual", lambda p, q: (p - q).abs() / (p - q).abs().sum(-1, keepdim=True)),  # |p - q|, not max(p - q, 0)
    ("accept_mask", lambda p_d, q_d, u: u < p_d),                          # accept with p(d), not min(1, p/q)
    ("accept_mask", lambda p_d, q_d, u: u * p_d < q_d),                    # q/p instead of p/q
], ids=["residual-p", "residual-sign", "residual-abs", "accept-p", "accept-inverted"])
def test_wrong_rules_fail_the_same_test(monkeypatch, name, wrong_rule):
    monkeypatch.setattr(sampling, name, wrong_rule)
    counts, p = emitted_counts()
    assert p_value(counts, p) < 1e-3


def test_residual_is_normalised_and_zero_where_q_covers_p():
    p, q = fixed_distributions()
    r = residual(p, q)
    assert torch.isclose(r.sum(), torch.tensor(1.0))
    assert torch.all(r[q >= p] == 0)
    assert torch.equal(residual(p, p), p)  # p == q: nothing to correct, fall back to p


def test_verify_chain_full_acceptance_samples_bonus_from_last_row():
    p = torch.zeros(3, V)
    p[0, 3] = p[1, 5] = p[2, 7] = 1.0
    q = torch.zeros(2, V)
    q[0, 3] = q[1, 5] = 1.0
    a, nxt = verify_chain(p, q, torch.tensor([3, 5]), torch.Generator().manual_seed(0))
    assert (a, nxt) == (2, 7)


def test_verify_chain_rejects_token_the_target_never_emits():
    p = torch.zeros(3, V)
    p[:, 1] = 1.0
    q = torch.full((2, V), 1.0 / V)
    a, nxt = verify_chain(p, q, torch.tensor([4, 1]), torch.Generator().manual_seed(0))
    assert (a, nxt) == (0, 1)


def test_verify_greedy():
    logits = torch.zeros(4, V)
    logits[0, 2] = logits[1, 6] = logits[2, 0] = logits[3, 5] = 1.0
    assert verify_greedy(logits, torch.tensor([2, 6, 0])) == (3, 5)
    assert verify_greedy(logits, torch.tensor([2, 1, 0])) == (1, 6)
    assert verify_greedy(logits[:1], torch.empty(0, dtype=torch.long)) == (0, 2)


def chain_depth_two_counts(rule, draws: int = 20_000):
    """verify_chain (the function the engine calls) on a 2-token chain with fixed rows: given the first drafted
    token was accepted, the token emitted at depth 2 (accepted draft, correction or nothing else) must be ~ p[1];
    and after two acceptances the bonus must be ~ p[2]."""
    g = torch.Generator().manual_seed(7)
    p = torch.softmax(2.0 * torch.randn(3, V, generator=g), -1)
    q = torch.softmax(2.0 * torch.randn(2, V, generator=g), -1)
    second, bonus = torch.zeros(V, dtype=torch.float64), torch.zeros(V, dtype=torch.float64)
    for _ in range(draws):
        draft = torch.multinomial(q, 1, generator=g).squeeze(-1)
        a, nxt = rule(p, q, draft, g)
        if a >= 1:
            second[int(draft[1]) if a == 2 else nxt] += 1
        if a == 2:
            bonus[nxt] += 1
    return second, bonus, p.double()


def test_verify_chain_depth_two_reproduces_p():
    second, bonus, p = chain_depth_two_counts(verify_chain)
    assert second.sum() > 1000 and bonus.sum() > 200
    assert p_value(second, p[1]) > 1e-3 and p_value(bonus, p[2]) > 1e-3


def test_verify_chain_depth_two_catches_wrong_rows():
    """The same test fails when depth 2 is judged with depth 1's rows (an indexing bug a 1-token test misses)."""
    def wrong(p, q, draft, g):  # p and q of the first position used at every depth
        return verify_chain(p[[0, 0, 0]], q[[0, 0]], draft, g)

    second, bonus, p = chain_depth_two_counts(wrong)
    assert p_value(second, p[1]) < 1e-3
