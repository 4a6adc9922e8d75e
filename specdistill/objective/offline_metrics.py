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

from specdistill.metrics import divergences, predicted_alpha, top1_match
from specdistill.objective.losses import distribution_logprobs

FULL_VOCABULARY = "full vocabulary"


@torch.no_grad()
def first_draft_metrics(objective, batches) -> dict:
    """fkl, tvd, predicted_alpha, top1 of the first drafted token, over the counted positions of `batches`
    (the objective's teacher-forced predictions: full vocabulary or a cached top-k + tail)."""
    sums = {"fkl": 0.0, "tvd": 0.0, "top1": 0.0}
    positions, label, labels = 0, FULL_VOCABULARY, {}
    for batch in batches:
        pred = objective(batch)
        if pred["q_logits"].shape[0] == 0:
            continue
        log_p, log_q = distribution_logprobs(pred, 1.0)
        per = divergences(log_p, log_q, ("fkl", "tvd"))
        sums["fkl"] += per["fkl"].sum().item()
        sums["tvd"] += per["tvd"].sum().item()
        if "topk_ids" in pred:  # the cached top-k is descending: its first id is argmax p
            hits = pred["q_logits"].argmax(-1) == pred["topk_ids"][:, 0]
            k = pred["topk_ids"].shape[1]
            label = f"top-{k} truncated, tail mass kept as one 'other' bucket"
            labels = {"fkl": f"top-{k}+tail", "tvd": f"top-{k}+tail",
                      "predicted_alpha": f"top-{k}+tail, upper bound", "top1": FULL_VOCABULARY}
        else:
            hits = top1_match(pred["p_logits"], pred["q_logits"])
        sums["top1"] += hits.sum().item()
        positions += pred["q_logits"].shape[0]
    labels = labels or dict.fromkeys(("fkl", "tvd", "predicted_alpha", "top1"), FULL_VOCABULARY)
    if positions == 0:
        return {"positions": 0, "temperature": 1.0, "distribution": label, "labels": labels}
    out = {k: v / positions for k, v in sums.items()}
    out["predicted_alpha"] = predicted_alpha(out["tvd"])
    return {**out, "positions": positions, "temperature": 1.0, "distribution": label, "labels": labels}
