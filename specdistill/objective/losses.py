"""Distribution losses between the target's p and the draft's q, in log space.

The loss terms (fkl, rkl, jsd, tvd and argmax_ce, a hard label on the target's greedy choice) are
specdistill/metrics.py's `divergences`: one definition for the losses and the metrics.

Two ways to get p:
  * full vocabulary: p = softmax(lm_head(hidden_last) / T) from the target's frozen head;
  * a cached top-k: the k stored log-probabilities plus one "other" bucket holding the tail mass.
    q is put on the same k+1 outcomes: its probabilities of the k ids, and its remaining mass as
    the bucket. Numbers computed this way are on the truncated distribution (labelled as such).
Each divergence is computed per position; the loss is the mean over masked positions.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specdistill.metrics import divergences


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


def distribution_logprobs(pred: dict, temperature: float):
    """(log p, log q) of a prediction (specdistill/objective/base.py): full vocabulary, or top-k + tail bucket."""
    if "topk_ids" in pred:
        return topk_logprobs(pred["topk_logprobs"], pred["topk_ids"], pred["tail_mass"], pred["q_logits"], temperature)
    return full_vocab_logprobs(pred["p_logits"], pred["q_logits"], temperature)


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


def acceptance_weight(weight: float, ramp: float, progress: float) -> float:
    """The hybrid objective's weight on tvd at `progress` (0..1 of training): 0 at the start, rising linearly to
    `weight` at `ramp`, then held (KL-like terms first, the acceptance objective once q is near p)."""
    return weight * min(1.0, progress / ramp)
