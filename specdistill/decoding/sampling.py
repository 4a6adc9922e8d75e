"""The speculative-sampling rule (Leviathan et al. 2023; Chen et al. 2023) as pure tensor functions.

A drafted token d ~ q is accepted with probability min(1, p(d)/q(d)); on rejection the replacement is
drawn from the residual norm(max(p - q, 0)). The emitted token is then distributed exactly as p.
Temperature 0 is the greedy special case: accept while the draft's token is the target's argmax.
"""
from __future__ import annotations

import torch


def probs_from_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / T) in float32. T must be > 0 (T = 0 is greedy and needs no probabilities)."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of `probs` [..., V] -> [...]."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)): where rejected tokens are resampled from. Falls back to p if p == q."""
    r = (p - q).clamp_min(0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp_min(1e-30), p)


def accept_mask(p_of_draft: torch.Tensor, q_of_draft: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """u < p/q, written without the division so q = 0 (never drafted) cannot produce NaN."""
    return uniforms * q_of_draft < p_of_draft


def verify_chain(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor,
                 generator: torch.Generator | None = None) -> tuple[int, int]:
    """A chain of K drafted tokens: p [K+1, V] (target), q [K, V] (draft), draft [K].

    Returns (accepted prefix length a, the target's own next token): the correction drawn from the
    residual at depth a if a < K, else the bonus token drawn from p[K].
    """
    k = draft.shape[0]
    if k:
        u = torch.rand(k, generator=generator, device=p.device)
        rows = torch.arange(k, device=p.device)
        ok = accept_mask(p[rows, draft], q[rows, draft], u)
        a = int(ok.cumprod(0).sum())
    else:
        a = 0
    dist = residual(p[a], q[a]) if a < k else p[k]
    return a, int(sample(dist, generator))


def verify_greedy(target_logits: torch.Tensor, draft: torch.Tensor) -> tuple[int, int]:
    """Temperature 0: target_logits [K+1, V], draft [K] -> (a, the target's argmax after the prefix)."""
    best = target_logits.argmax(-1)
    k = draft.shape[0]
    a = int((best[:k] == draft).cumprod(0).sum()) if k else 0
    return a, int(best[a])


def pick(logits: torch.Tensor, temperature: float, generator=None):
    """A drafter's next token: greedy at T=0 (no probabilities needed), else a sample and its distribution q."""
    if temperature == 0:
        return logits.argmax(-1), None
    q = probs_from_logits(logits, temperature)
    return sample(q, generator), q


def stack_draws(tokens: list[torch.Tensor], qs: list[torch.Tensor | None], device):
    """A drafter's proposal: tokens [k] and their distributions [k, V] (None at T=0), on `device` (no tokens:
    an empty proposal still names where it lives)."""
    ids = torch.stack(tokens) if tokens else torch.empty(0, dtype=torch.long, device=device)
    q = torch.stack(qs) if qs and qs[0] is not None else None
    return ids, q
