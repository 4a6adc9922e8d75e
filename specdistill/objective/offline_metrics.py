"""Offline metrics on the held-out cache split (definitions: docs/METRICS.md), at T=1.

fkl = KL(p||q), tvd, predicted_alpha = 1 - tvd, top1 = P(argmax q = argmax p), each averaged over
counted positions: first-draft, teacher-forced quantities (they predict alpha_at[0], not pooled alpha).
With a top-k cache p and q are the truncated k+1-outcome distributions (the tail kept as one "other"
bucket) and the result says so in `distribution` and, per number, in `labels` (fkl is then a lower
bound, tvd a lower bound and predicted_alpha an upper bound of the full-vocabulary values).
EAGLE heads also report acceptance per draft depth with the head fed its own states from depth 2 on
(`top1_at`, `alpha_at`) and `simulated_tau`, the held-out prediction of the measured tau. A draft LM has
none: teacher-forced, its depth-i drafts read the same tokens as its depth-1 ones.
"""
from __future__ import annotations

import torch

from specdistill.metrics import divergences, predicted_alpha, simulated_tau, top1_match
from specdistill.objective.losses import distribution_logprobs

FULL_VOCABULARY = "full vocabulary"


def _total(value) -> float:
    return value.sum().item() if torch.is_tensor(value) else value


class FirstDraftSums:
    """The first drafted token's numbers summed over counted positions (docs/METRICS.md): `add` one batch's
    per-position values (tensors, summed here, or sums already taken), `means` their averages and the
    predicted alpha = 1 - mean tvd. The one definition training's held-out pass, every kind's objective and
    the eval's on-prompt pass share."""

    def __init__(self, keys=("fkl", "tvd", "top1")):
        self.sums, self.positions = dict.fromkeys(keys, 0.0), 0

    def add(self, positions: int, **values) -> None:
        for key, value in values.items():
            self.sums[key] += _total(value)
        self.positions += positions

    def means(self) -> dict:
        out = {key: total / self.positions for key, total in self.sums.items()}
        if "tvd" in out:
            out["predicted_alpha"] = predicted_alpha(out["tvd"])
        return out


class DepthSums:
    """Acceptance per draft depth summed over positions: top-1 hits (T=0 acceptance) and sum of min(p, q)
    (T=1 acceptance). `result` gives top1_at, alpha_at and positions_at over the depths up to the first
    with no counted position, and simulated_tau = 1 + sum_k prod_(i<=k) of each (docs/METRICS.md)."""

    def __init__(self):
        self.hits, self.accepted, self.positions = [], [], []

    def add(self, depth: int, hits, accepted, positions: int) -> None:
        while len(self.positions) <= depth:
            self.hits.append(0)
            self.accepted.append(0.0)
            self.positions.append(0)
        self.hits[depth] += _total(hits)
        self.accepted[depth] += _total(accepted)
        self.positions[depth] += positions

    def result(self, note: str) -> dict:
        """{top1_at, alpha_at, positions_at, simulated_tau, simulated_tau_note}; {} when no depth counted."""
        depths = next((d for d, n in enumerate(self.positions) if not n), len(self.positions))
        if not depths:
            return {}
        n = self.positions[:depths]
        out = {"top1_at": [h / c for h, c in zip(self.hits, n)], "alpha_at": [a / c for a, c in zip(self.accepted, n)],
               "positions_at": list(n)}
        out["simulated_tau"] = {"0": simulated_tau(out["top1_at"]), "1": simulated_tau(out["alpha_at"])}
        out["simulated_tau_note"] = f"1 + sum_k prod_(i<=k) acceptance at depth i over {depths} depths: {note}"
        return out


@torch.no_grad()
def first_draft_metrics(objective, batches) -> dict:
    """fkl, tvd, predicted_alpha, top1 of the first drafted token, over the counted positions of `batches`
    (the objective's teacher-forced predictions: full vocabulary or a cached top-k + tail)."""
    sums, label, labels = FirstDraftSums(), FULL_VOCABULARY, {}
    for batch in batches:
        pred = objective(batch)
        if pred["q_logits"].shape[0] == 0:
            continue
        log_p, log_q = distribution_logprobs(pred, 1.0)
        per = divergences(log_p, log_q, ("fkl", "tvd"))
        if "topk_ids" in pred:  # the cached top-k is descending: its first id is argmax p
            hits = pred["q_logits"].argmax(-1) == pred["topk_ids"][:, 0]
            k = pred["topk_ids"].shape[1]
            label = f"top-{k} truncated, tail mass kept as one 'other' bucket"
            labels = {"fkl": f"top-{k}+tail", "tvd": f"top-{k}+tail",
                      "predicted_alpha": f"top-{k}+tail, upper bound", "top1": FULL_VOCABULARY}
        else:
            hits = top1_match(pred["p_logits"], pred["q_logits"])
        sums.add(pred["q_logits"].shape[0], fkl=per["fkl"], tvd=per["tvd"], top1=hits)
    labels = labels or dict.fromkeys(("fkl", "tvd", "predicted_alpha", "top1"), FULL_VOCABULARY)
    if sums.positions == 0:
        return {"positions": 0, "temperature": 1.0, "distribution": label, "labels": labels}
    return {**sums.means(), "positions": sums.positions, "temperature": 1.0, "distribution": label, "labels": labels}
