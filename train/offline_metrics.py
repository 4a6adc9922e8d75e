"""Offline metrics on the held-out cache split (definitions: /work/shared/docs/metrics.md), at T=1.

fkl = KL(p||q), tvd, predicted_alpha = 1 - tvd, top1 = P(argmax q = argmax p), each averaged over
counted positions. With a top-k cache p and q are the truncated k+1-outcome distributions (the tail
kept as one "other" bucket) and the result says so in `distribution`.
"""
from __future__ import annotations

import torch

from specdistill.train import drafts, losses


@torch.no_grad()
def offline_metrics(kind: str, model, batches, parts) -> dict:
    sums = {"fkl": 0.0, "tvd": 0.0, "top1": 0.0}
    positions, label = 0, "full vocabulary"
    for batch in batches:
        pred = drafts.predict(kind, model, batch, parts)
        if pred["q_logits"].shape[0] == 0:
            continue
        log_p, log_q = drafts.distribution_logprobs(pred, 1.0)
        per = losses.divergences(log_p, log_q, ("fkl", "tvd"))
        sums["fkl"] += per["fkl"].sum().item()
        sums["tvd"] += per["tvd"].sum().item()
        if "topk_ids" in pred:
            p_top = pred["topk_ids"][:, 0]
            label = f"top-{pred['topk_ids'].shape[1]} truncated, tail mass kept as one 'other' bucket"
        else:
            p_top = pred["p_logits"].argmax(-1)
        sums["top1"] += (pred["q_logits"].argmax(-1) == p_top).sum().item()
        positions += pred["q_logits"].shape[0]
    if positions == 0:
        return {"positions": 0, "temperature": 1.0, "distribution": label}
    out = {k: v / positions for k, v in sums.items()}
    out["predicted_alpha"] = 1.0 - out["tvd"]
    return {**out, "positions": positions, "temperature": 1.0, "distribution": label}
