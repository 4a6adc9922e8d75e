"""Distribution losses between the target's p and the draft's q, in log space.

Definitions follow /work/shared/docs/metrics.md: fkl = KL(p||q), rkl = KL(q||p),
jsd = beta KL(p||m) + (1-beta) KL(q||m) with m = beta p + (1-beta) q, tvd = 1/2 sum |p - q|
(= 1 - sum min(p, q), one minus the acceptance rate at T=1), argmax_ce = -log q(argmax p) (a hard
label on the target's greedy choice: the acceptance event at T=0).

Two ways to get p:
  * full vocabulary: p = softmax(lm_head(hidden_last) / T) from the target's frozen head;
  * a cached top-k: the k stored log-probabilities plus one "other" bucket holding the tail mass.
    q is put on the same k+1 outcomes: its probabilities of the k ids, and its remaining mass as
    the bucket. Numbers computed this way are on the truncated distribution (labelled as such).
Each divergence is computed per position; the loss is the mean over masked positions.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

DIVERGENCES = ("fkl", "rkl", "jsd", "tvd")  # zero exactly where q = p
NAMES = DIVERGENCES + ("argmax_ce",)  # every loss term a recipe may weight


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """sum_x a (log a - log b) over the last axis; outcomes with a = 0 contribute 0 (no inf - inf)."""
    a = log_a.exp()
    terms = a * (log_a - log_b)
    return torch.where(a > 0, terms, torch.zeros_like(terms)).sum(-1)


def divergences(log_p: torch.Tensor, log_q: torch.Tensor, names=DIVERGENCES, beta: float = 0.5) -> dict:
    """Per-position loss terms [N] (default: the divergences) between two normalised log-distributions [N, V]."""
    out = {}
    for name in names:
        if name == "fkl":
            out[name] = _kl(log_p, log_q)
        elif name == "rkl":
            out[name] = _kl(log_q, log_p)
        elif name == "jsd":
            if beta == 0.0:
                out[name] = torch.zeros(log_p.shape[:-1], dtype=log_p.dtype, device=log_p.device)
                continue  # m = q: beta KL(p||m) and KL(q||q) both vanish
            if beta == 1.0:
                out[name] = torch.zeros(log_p.shape[:-1], dtype=log_p.dtype, device=log_p.device)
                continue
            log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log(1 - beta))
            log_m = torch.where(log_p == log_q, log_p, log_m)  # m = p exactly where q = p (no rounding)
            out[name] = beta * _kl(log_p, log_m) + (1 - beta) * _kl(log_q, log_m)
        elif name == "tvd":
            out[name] = 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)
        elif name == "argmax_ce":
            out[name] = -log_q.gather(-1, log_p.argmax(-1, keepdim=True)).squeeze(-1)
        else:
            raise ValueError(f"unknown loss term {name!r}; known: {', '.join(NAMES)}")
    return out


def full_vocab_logprobs(p_logits: torch.Tensor, q_logits: torch.Tensor, temperature: float = 1.0):
    """log p, log q over the whole vocabulary at temperature T (float32 for a stable softmax)."""
    log_p = F.log_softmax(p_logits.float() / temperature, dim=-1)
    log_q = F.log_softmax(q_logits.float() / temperature, dim=-1)
    return log_p, log_q


def topk_logprobs(topk_logprobs_t1: torch.Tensor, topk_ids: torch.Tensor, tail_mass: torch.Tensor,
                  q_logits: torch.Tensor, temperature: float = 1.0):
    """log p, log q over k+1 outcomes: the cached top-k ids, then one bucket for everything else.

    The cache holds log-softmax at T=1. At T != 1 the tail is treated as one token of probability
    tail_mass (its inner spread is unknown), so p_T over the k+1 outcomes is softmax(log p / T).
    """
    tail = tail_mass.float().clamp(min=0.0).log().unsqueeze(-1)  # -inf when the top-k holds everything
    log_p = torch.cat([topk_logprobs_t1.float(), tail], dim=-1)
    if temperature != 1.0:
        log_p = F.log_softmax(log_p / temperature, dim=-1)
    log_q_full = F.log_softmax(q_logits.float() / temperature, dim=-1)
    ids = topk_ids.long()
    log_q_top = log_q_full.gather(-1, ids)
    # q's mass outside the k ids: logsumexp over the vocabulary with the k ids masked out (exact, stable)
    outside = log_q_full.scatter(-1, ids, float("-inf"))
    log_q = torch.cat([log_q_top, outside.logsumexp(-1, keepdim=True)], dim=-1)
    return log_p, log_q


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def mixed_loss(log_p: torch.Tensor, log_q: torch.Tensor, terms: dict[str, float], beta: float = 0.5,
               mask: torch.Tensor | None = None):
    """sum_i w_i * mean_masked(div_i): returns (loss, {name: detached mean}) for logging."""
    per_position = divergences(log_p, log_q, tuple(terms), beta)
    if mask is None:
        mask = torch.ones(log_p.shape[:-1], device=log_p.device)
    parts = {name: masked_mean(v, mask) for name, v in per_position.items()}
    loss = sum(terms[name] * parts[name] for name in terms)
    return loss, {name: v.detach() for name, v in parts.items()}


def smooth_l1_features(f_hat: torch.Tensor, f: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """EAGLE's feature regression: Smooth-L1 averaged over the hidden axis, then over masked positions."""
    per_position = F.smooth_l1_loss(f_hat.float(), f.float(), reduction="none").mean(-1)
    return masked_mean(per_position, torch.ones_like(per_position) if mask is None else mask)
