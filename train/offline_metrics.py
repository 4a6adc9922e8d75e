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
    if kind == "eagle3":
        return eagle3_metrics(model, batches, parts)
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


@torch.no_grad()
def eagle3_metrics(model, batches, parts) -> dict:
    """EAGLE-3's first drafted token against the target's FULL distribution (q is zero outside the draft
    vocabulary), so predicted_alpha is the real expected acceptance; fkl is over the draft vocabulary
    (p restricted and renormalised, positions whose token is outside it left out, as training does);
    `vocab_coverage` is the target mass inside the draft vocabulary; `top1_at` per unroll step."""
    sums = {"tvd": 0.0, "top1": 0.0, "vocab_coverage": 0.0}
    fkl_sum, fkl_n, positions = 0.0, 0, 0
    step_hits, step_n = [], []
    for batch in batches:
        pred = drafts.predict("eagle3", model, batch, parts)
        ids = pred["draft_ids"]
        if pred["metric_q_logits"].shape[0]:
            p = torch.softmax(parts.lm_head(pred["metric_f"]).float(), -1)
            q_d = torch.softmax(pred["metric_q_logits"].float(), -1)
            q = torch.zeros_like(p)
            q[:, ids] = q_d
            sums["tvd"] += (0.5 * (p - q).abs().sum(-1)).sum().item()
            sums["top1"] += (ids[q_d.argmax(-1)] == p.argmax(-1)).sum().item()
            sums["vocab_coverage"] += p[:, ids].sum(-1).sum().item()
            positions += p.shape[0]
        for s, step in enumerate(pred["steps"]):
            if s == len(step_hits):
                step_hits.append(0)
                step_n.append(0)
            if step["q_logits"].shape[0] == 0:
                continue
            step_hits[s] += (step["q_logits"].argmax(-1) == step["p_logits"].argmax(-1)).sum().item()
            step_n[s] += step["q_logits"].shape[0]
            if s == 0:
                log_p, log_q = drafts.distribution_logprobs(step, 1.0)
                fkl_sum += losses.divergences(log_p, log_q, ("fkl",))["fkl"].sum().item()
                fkl_n += step["q_logits"].shape[0]
    label = "full vocabulary (q zero outside the draft vocabulary); fkl over the draft vocabulary"
    if positions == 0:
        return {"positions": 0, "temperature": 1.0, "distribution": label}
    out = {k: v / positions for k, v in sums.items()}
    out["predicted_alpha"] = 1.0 - out["tvd"]
    out["fkl"] = fkl_sum / fkl_n if fkl_n else float("nan")
    out["top1_at"] = [h / n if n else 0.0 for h, n in zip(step_hits, step_n)]
    return {**out, "positions": positions, "temperature": 1.0, "distribution": label}
