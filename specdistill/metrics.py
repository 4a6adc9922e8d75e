"""The metrics every stage computes the same way (definitions: docs/METRICS.md).

Divergences between the target's p and the draft's q in log space (fkl = KL(p||q), rkl = KL(q||p),
jsd = beta KL(p||m) + (1-beta) KL(q||m) with m = beta p + (1-beta) q, tvd = 1/2 sum |p - q|
(= 1 - sum min(p, q), one minus the acceptance rate at T=1)) and argmax_ce = -log q(argmax p) (a hard label
on the target's greedy choice: the acceptance event at T=0), per position;
the offline keys every checkpoint reports; Leviathan's tau for i.i.d. acceptance and the tau simulated
from acceptance per draft depth.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the divergences take tensors and use their methods: this module loads without torch
    import torch

DIVERGENCES = ("fkl", "rkl", "jsd", "tvd")  # zero exactly where q = p
NAMES = DIVERGENCES + ("argmax_ce",)  # every loss term a recipe may weight
# The first-draft offline numbers (held out and on the eval prompts) the eval and the report read ...
OFFLINE_KEYS = ("fkl", "tvd", "predicted_alpha", "top1")
# ... and what else they read from the held-out metrics: distribution labels and per-depth acceptance.
HELDOUT_EXTRA_KEYS = ("positions", "distribution", "labels", "vocab_coverage", "top1_at", "alpha_at", "positions_at",
                      "simulated_tau", "simulated_tau_note",
                      # the T=0 chain replayed as decoding drafts it (eval/chain_tau.py)
                      "chain_tau", "chain_accepted_at", "chain_k", "chain_positions", "chain_tau_note")


def kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """sum_x a (log a - log b) over the last axis; outcomes with a = 0 contribute 0 (no inf - inf)."""
    a = log_a.exp()
    terms = a * (log_a - log_b)
    return terms.where(a > 0, terms.new_zeros(())).sum(-1)


def total_variation(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """tvd = 1/2 sum_x |p - q| of two distributions (probabilities) over the last axis."""
    return 0.5 * (p - q).abs().sum(-1)


def total_variation_outside(p: torch.Tensor, p_in: torch.Tensor, q_in: torch.Tensor) -> torch.Tensor:
    """tvd of p against a q that is zero outside a reduced vocabulary (EAGLE-3's draft vocabulary), without q
    over the full vocabulary: p_in = p over the reduced vocabulary, q_in = q there. Outside it |p - q| = p."""
    return 0.5 * ((p.sum(-1) - p_in.sum(-1)) + (p_in - q_in).abs().sum(-1))


def tvd(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    return total_variation(log_p.exp(), log_q.exp())


def acceptance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """sum_x min(p, q) = 1 - tvd: the probability that a token drafted from q is accepted against p (T=1)."""
    return p.minimum(q).sum(-1)


def top1_match(p: torch.Tensor, q: torch.Tensor, q_ids: torch.Tensor | None = None) -> torch.Tensor:
    """argmax q = argmax p, the acceptance event at T=0 (p, q: probabilities or logits); `q_ids` maps q's
    index to p's (a reduced draft vocabulary: draft id -> target id)."""
    q_top = q.argmax(-1)
    return (q_top if q_ids is None else q_ids[q_top]) == p.argmax(-1)


def predicted_alpha(mean_tvd: float) -> float:
    """The first draft's expected acceptance at T=1 predicted offline: 1 - E[tvd] (docs/METRICS.md)."""
    return 1.0 - mean_tvd


def divergences(log_p: torch.Tensor, log_q: torch.Tensor, names=DIVERGENCES, beta: float = 0.5) -> dict:
    """Per-position loss terms [N] (default: the divergences) between two normalised log-distributions [N, V]."""
    out = {}
    for name in names:
        if name == "fkl":
            out[name] = kl(log_p, log_q)
        elif name == "rkl":
            out[name] = kl(log_q, log_p)
        elif name == "jsd":
            if beta in (0.0, 1.0):  # m = q (or p): both KL terms vanish
                out[name] = log_p.new_zeros(log_p.shape[:-1])
                continue
            log_m = (log_p + math.log(beta)).logaddexp(log_q + math.log(1 - beta))
            log_m = log_p.where(log_p == log_q, log_m)  # m = p exactly where q = p (no rounding)
            out[name] = beta * kl(log_p, log_m) + (1 - beta) * kl(log_q, log_m)
        elif name == "tvd":
            out[name] = tvd(log_p, log_q)
        elif name == "argmax_ce":
            out[name] = -log_q.gather(-1, log_p.argmax(-1, keepdim=True)).squeeze(-1)
        else:
            raise ValueError(f"unknown loss term {name!r}; known: {', '.join(NAMES)}")
    return out


def leviathan_tau(alpha: float, k: int) -> float:
    """Expected tokens per step for i.i.d. acceptance alpha and a chain of K drafted tokens."""
    if alpha >= 1.0:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def simulated_tau(alpha_at: list[float], k: int | None = None) -> float:
    """1 + sum_{j=1..K} prod_{i<=j} alpha_i (docs/METRICS.md); depths past the measured ones repeat the last one.
    Fed with rates taken unconditionally along teacher-forced text it is optimistic; the chain replayed as
    decoding drafts it is eval/chain_tau.py."""
    k = len(alpha_at) if k is None else k
    total, run = 1.0, 1.0
    for j in range(k):
        run *= alpha_at[min(j, len(alpha_at) - 1)] if alpha_at else 0.0
        total += run
    return total
