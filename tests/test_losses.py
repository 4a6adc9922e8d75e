"""Losses against hand-computed values on tiny distributions; zero at q = p; gradients only to the draft."""
import math

import pytest
import torch

from specdistill import metrics
from specdistill.objective import losses

P = [0.5, 0.3, 0.2]
Q = [0.25, 0.25, 0.5]


def logs(*rows):
    return torch.tensor(rows, dtype=torch.float64).log()


def test_each_divergence_matches_hand_computation():
    d = metrics.divergences(logs(P), logs(Q), metrics.NAMES, beta=0.5)
    fkl = sum(p * math.log(p / q) for p, q in zip(P, Q))
    rkl = sum(q * math.log(q / p) for p, q in zip(P, Q))
    M = [(p + q) / 2 for p, q in zip(P, Q)]
    jsd = 0.5 * sum(p * math.log(p / m) for p, m in zip(P, M)) + 0.5 * sum(q * math.log(q / m) for q, m in zip(Q, M))
    tvd = 0.5 * sum(abs(p - q) for p, q in zip(P, Q))
    assert d["fkl"].item() == pytest.approx(fkl, abs=1e-12)
    assert d["rkl"].item() == pytest.approx(rkl, abs=1e-12)
    assert d["jsd"].item() == pytest.approx(jsd, abs=1e-12)
    assert d["tvd"].item() == pytest.approx(tvd, abs=1e-12)  # 0.3
    assert d["argmax_ce"].item() == pytest.approx(-math.log(0.25), abs=1e-12)  # argmax p is outcome 0
    assert 1 - d["tvd"].item() == pytest.approx(sum(min(p, q) for p, q in zip(P, Q)), abs=1e-12)


def test_argmax_ce_follows_the_target_argmax_per_position():
    d = metrics.divergences(logs(P, [0.1, 0.2, 0.7]), logs(Q, Q), names=("argmax_ce",))
    assert d["argmax_ce"].tolist() == pytest.approx([-math.log(0.25), -math.log(0.5)], abs=1e-12)


def test_jsd_beta_weights_the_mixture():
    beta = 0.2
    d = metrics.divergences(logs(P), logs(Q), ("jsd",), beta=beta)
    M = [beta * p + (1 - beta) * q for p, q in zip(P, Q)]
    want = beta * sum(p * math.log(p / m) for p, m in zip(P, M)) + (1 - beta) * sum(q * math.log(q / m) for q, m in zip(Q, M))
    assert d["jsd"].item() == pytest.approx(want, abs=1e-12)


def test_zero_when_q_equals_p_even_with_zero_probabilities():
    lp = torch.tensor([[0.0, -math.inf, -math.inf], [-0.5, -1.2, -2.0]]).log_softmax(-1)
    for name, v in metrics.divergences(lp, lp.clone()).items():
        assert torch.all(v == 0), name


def test_weighted_mix_and_masked_mean():
    log_p = logs(P, P)
    log_q = logs(Q, P)  # second position: q = p, zero loss
    mask = torch.tensor([1, 0])
    loss, parts = losses.mixed_loss(log_p, log_q, {"fkl": 1.0, "tvd": 0.5}, mask=mask)
    fkl = sum(p * math.log(p / q) for p, q in zip(P, Q))
    assert loss.item() == pytest.approx(fkl + 0.5 * 0.3, abs=1e-12)  # only the masked-in position counts
    loss_all, _ = losses.mixed_loss(log_p, log_q, {"fkl": 1.0, "tvd": 0.5}, mask=torch.tensor([1, 1]))
    assert loss_all.item() == pytest.approx((fkl + 0.15) / 2, abs=1e-12)


def test_temperature_scales_logits():
    p_logits = torch.tensor([[2.0, 1.0, 0.0]])
    q_logits = torch.tensor([[0.0, 1.0, 2.0]])
    log_p, log_q = losses.full_vocab_logprobs(p_logits, q_logits, temperature=2.0)
    assert torch.allclose(log_p.exp(), torch.softmax(p_logits / 2, -1))
    assert torch.allclose(log_q.exp(), torch.softmax(q_logits / 2, -1))


def test_topk_with_tail_bucket_by_hand():
    # vocabulary of 5; p's top-2 ids are 3 and 0 with probabilities 0.6, 0.3; tail 0.1
    topk_lp = torch.tensor([[math.log(0.6), math.log(0.3)]])
    topk_ids = torch.tensor([[3, 0]])
    tail = torch.tensor([0.1])
    q = torch.tensor([[0.1, 0.2, 0.1, 0.4, 0.2]])
    log_p, log_q = losses.topk_logprobs(topk_lp, topk_ids, tail, q.log())
    assert torch.allclose(log_p.exp(), torch.tensor([[0.6, 0.3, 0.1]]), atol=1e-6)
    assert torch.allclose(log_q.exp(), torch.tensor([[0.4, 0.1, 0.5]]), atol=1e-6)
    d = metrics.divergences(log_p, log_q)
    want = 0.6 * math.log(0.6 / 0.4) + 0.3 * math.log(0.3 / 0.1) + 0.1 * math.log(0.1 / 0.5)
    assert d["fkl"].item() == pytest.approx(want, abs=1e-5)
    assert d["tvd"].item() == pytest.approx(0.5 * (0.2 + 0.2 + 0.4), abs=1e-6)


def test_topk_zero_when_draft_matches_and_tail_empty():
    logits = torch.tensor([[3.0, 1.0, -2.0, 0.5]])
    lp = logits.log_softmax(-1)
    top = lp.topk(4)
    log_p, log_q = losses.topk_logprobs(top.values, top.indices, torch.tensor([0.0]), logits)
    d = metrics.divergences(log_p, log_q)
    assert all(v.abs().item() < 1e-6 for v in d.values())
    top2 = lp.topk(2)  # with a non-empty tail bucket too
    tail = 1 - top2.values.exp().sum(-1)
    d2 = metrics.divergences(*losses.topk_logprobs(top2.values, top2.indices, tail, logits))
    assert all(v.abs().item() < 1e-6 for v in d2.values())


def test_large_logits_stay_finite():
    p = torch.tensor([[1000.0, -1000.0, 0.0]])
    q = torch.tensor([[-1000.0, 1000.0, 0.0]])
    d = metrics.divergences(*losses.full_vocab_logprobs(p, q))
    assert all(torch.isfinite(v).all() for v in d.values())
    assert d["tvd"].item() == pytest.approx(1.0)


def test_gradients_reach_only_the_draft(tiny_target_dir):
    from transformers import AutoModelForCausalLM

    from specdistill.kinds.eagle.model import EagleHead

    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval().requires_grad_(False)
    head = EagleHead(target.config).bind_target(target.get_input_embeddings(), target.get_output_embeddings())
    ids = torch.randint(0, 100, (1, 6))
    feats = torch.randn(1, 6, target.config.hidden_size)
    f_hat = head(ids, feats, torch.arange(6)[None])
    log_p, log_q = losses.full_vocab_logprobs(target.lm_head(feats), head.logits(f_hat))
    loss, _ = losses.mixed_loss(log_p, log_q, {"fkl": 1.0, "jsd": 1.0, "tvd": 1.0, "rkl": 1.0})
    (loss + losses.smooth_l1_features(f_hat, feats)).backward()
    assert target.get_input_embeddings().weight.grad is None
    assert target.lm_head.weight.grad is None
    assert all(p.grad is not None for p in head.parameters()), "every head parameter gets a gradient"
    assert head.fc.weight.grad.abs().sum() > 0


def test_acceptance_weight_ramps_then_holds():
    assert [losses.acceptance_weight(0.5, 0.5, t) for t in (0.0, 0.25, 0.5, 1.0)] == [0.0, 0.25, 0.5, 0.5]


def test_hybrid_objective_moves_from_the_terms_to_tvd():
    from specdistill.kinds.common.config import LossConfig
    from specdistill.objective.base import BaseObjective as Objective

    torch.manual_seed(0)
    pred = {"p_logits": torch.randn(6, 5), "q_logits": torch.randn(6, 5)}
    log_p, log_q = losses.full_vocab_logprobs(pred["p_logits"], pred["q_logits"])
    per = metrics.divergences(log_p, log_q, ("fkl", "tvd"))
    fkl, tvd = per["fkl"].mean().item(), per["tvd"].mean().item()
    objective = Objective(torch.nn.Linear(1, 1), None, LossConfig(terms={"fkl": 1.0}, acceptance_weight=1.0,
                                                                  acceptance_ramp=0.5))
    for progress, want in ((0.0, fkl), (0.25, 0.5 * fkl + 0.5 * tvd), (0.9, tvd)):
        objective.progress = progress
        loss, parts = objective.loss(pred)
        assert loss.item() == pytest.approx(want, rel=1e-5) and parts["acceptance_weight"] == min(1, progress / 0.5)
    plain = Objective(torch.nn.Linear(1, 1), None, LossConfig(terms={"fkl": 1.0}))
    plain.progress = 0.9
    assert plain.loss(pred)[0].item() == pytest.approx(fkl, rel=1e-6)  # default: off


def test_griffin_weighting_drops_steps_whose_input_was_already_wrong():
    """eagle3, loss.ttt_wrong_weight 0: step 1 at a start position whose step 0 missed counts for nothing."""
    from specdistill.kinds import kind

    eagle3 = kind("eagle3")

    at = torch.tensor([[True, True, True]])  # three start positions, counted at both unroll steps
    right, wrong = [4.0, 0.0, 0.0], [0.0, 4.0, 0.0]  # p's argmax is 0; q picks 0 (right) or 1 (wrong)
    step0 = {"p_logits": torch.tensor([right, right, right]), "q_logits": torch.tensor([right, wrong, right])}
    step1 = {"p_logits": torch.tensor([right] * 3), "q_logits": torch.tensor([[0.0, 1.0, 2.0], [9.0, 0.0, 0.0],
                                                                              [1.0, 1.0, 1.0]])}
    pred = {"steps": [step0, step1], "counted_at": [at, at]}
    fkl1 = metrics.divergences(*losses.full_vocab_logprobs(step1["p_logits"], step1["q_logits"]), ("fkl",))["fkl"]
    for weight, want in ((1.0, fkl1.mean()), (0.0, fkl1[[0, 2]].mean())):
        objective = eagle3.Objective(torch.nn.Linear(1, 1), None, eagle3.Loss(terms={"fkl": 1.0}, ttt_decay=1.0,
                                                                             ttt_wrong_weight=weight))
        _, parts = objective.loss(pred)
        assert parts["step1"].item() == pytest.approx(want.item(), rel=1e-6), weight


def test_offline_accumulators_sum_per_position_and_stop_at_the_first_empty_depth():
    """The one accumulator of the offline numbers (FirstDraftSums, DepthSums), against sums by hand."""
    from specdistill.objective.offline_metrics import DepthSums, FirstDraftSums

    first = FirstDraftSums()
    first.add(2, fkl=torch.tensor([0.5, 1.5]), tvd=torch.tensor([0.25, 0.75]), top1=torch.tensor([True, False]))
    first.add(1, fkl=3.0, tvd=0.2, top1=1)  # sums already taken
    assert first.means() == pytest.approx({"fkl": 5.0 / 3, "tvd": 0.4, "top1": 2 / 3, "predicted_alpha": 0.6})
    assert first.positions == 3
    depths = DepthSums()
    depths.add(0, torch.tensor([True, True, False, True]), torch.tensor([0.9, 0.8, 0.3, 0.6]), 4)
    depths.add(1, 1, 0.5, 2)
    depths.add(3, 1, 1.0, 1)  # after a depth with no position: not counted
    got = depths.result("by hand")
    assert got["positions_at"] == [4, 2] and got["top1_at"] == [0.75, 0.5]
    assert got["alpha_at"] == pytest.approx([0.65, 0.25])
    assert got["simulated_tau"] == pytest.approx({"0": 1 + 0.75 + 0.75 * 0.5, "1": 1 + 0.65 + 0.65 * 0.25})
    assert DepthSums().result("none") == {}
