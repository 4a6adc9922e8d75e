"""Offline metrics on the held-out cache split (definitions: /work/shared/docs/metrics.md), at T=1.

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

from specdistill.target import target_logits_from_hidden
from specdistill.train import drafts, losses


def simulated_tau(alpha_at: list[float], k: int | None = None) -> float:
    """1 + sum_{j=1..K} prod_{i<=j} alpha_i (metrics.md); depths past the measured ones repeat the last one."""
    k = len(alpha_at) if k is None else k
    total, run = 1.0, 1.0
    for j in range(k):
        run *= alpha_at[min(j, len(alpha_at) - 1)] if alpha_at else 0.0
        total += run
    return total


EAGLE_DEPTHS = 3  # EAGLE-1 drafting unrolled this deep on the held-out split (EAGLE-3: its ttt_steps)


@torch.no_grad()
def eagle_unrolled_acceptance(model, batch, parts, depths: int = EAGLE_DEPTHS) -> tuple[list, list, list]:
    """EAGLE-1 drafting simulated on a held-out batch: depth s at start t reads token x[t+1+s] and, from depth 2
    on, its own predicted feature of depth s-1 (EAGLE's drafting), attending to the real-feature positions <= t
    and its own earlier depths of the same chain (eagle3.ttt_mask, the pattern the engine's cache produces).
    It predicts token x[t+2+s], counted where trained, against the target's p at that position.
    `model` is the head or its DeepSpeed engine (same call signature). Returns per depth (top-1 hits, sum of
    min(p, q), positions)."""
    from transformers import DynamicCache

    from specdistill.train.eagle3 import ttt_mask

    head = getattr(model, "module", model)
    ids, att = batch["input_ids"], batch["attention_mask"]
    B, T = ids.shape
    L = T - 1  # head position t reads (x[t+1], f[t])
    dtype = parts.lm_head.weight.dtype
    h = batch["hidden_last"].to(dtype)
    trained = batch["loss_mask"].bool() & att.bool()
    cache = DynamicCache(config=head.config)
    state, base = h[:, :-1], torch.arange(L, device=ids.device).expand(B, -1)
    hits, overlap, n = [], [], []
    for s in range(min(depths, L - 1)):
        inp = torch.zeros(B, L, dtype=ids.dtype, device=ids.device)
        inp[:, :L - s] = ids[:, 1 + s:]
        state = model(inp, state, base + s, cache, ttt_mask(L, s, att[:, 1:]))
        c = torch.zeros(B, L, dtype=torch.bool, device=ids.device)
        c[:, :L - 1 - s] = trained[:, 2 + s:]
        p = torch.softmax(target_logits_from_hidden(parts.config, parts.lm_head, h[:, 1 + s:][c[:, :L - s]]).float(), -1)
        q = torch.softmax(head.logits(state[c]).float(), -1)
        hits.append((p.argmax(-1) == q.argmax(-1)).sum().item())
        overlap.append(torch.minimum(p, q).sum(-1).sum().item())
        n.append(int(c.sum()))
    return hits, overlap, n


@torch.no_grad()
def offline_metrics(kind: str, model, batches, parts) -> dict:
    if kind == "eagle3":
        return eagle3_metrics(model, batches, parts)
    sums = {"fkl": 0.0, "tvd": 0.0, "top1": 0.0}
    positions, label, labels = 0, "full vocabulary", {}
    depth_hits, depth_overlap, depth_n = [0] * EAGLE_DEPTHS, [0.0] * EAGLE_DEPTHS, [0] * EAGLE_DEPTHS
    for batch in batches:
        if kind == "eagle" and "hidden_last" in batch:
            for i, (a, b, c) in enumerate(zip(*eagle_unrolled_acceptance(model, batch, parts))):
                depth_hits[i] += a
                depth_overlap[i] += b
                depth_n[i] += c
        pred = drafts.predict(kind, model, batch, parts)
        if pred["q_logits"].shape[0] == 0:
            continue
        log_p, log_q = drafts.distribution_logprobs(pred, 1.0)
        per = losses.divergences(log_p, log_q, ("fkl", "tvd"))
        sums["fkl"] += per["fkl"].sum().item()
        sums["tvd"] += per["tvd"].sum().item()
        if "topk_ids" in pred:
            p_top = pred["topk_ids"][:, 0]
            k = pred["topk_ids"].shape[1]
            label = f"top-{k} truncated, tail mass kept as one 'other' bucket"
            labels = {"fkl": f"top-{k}+tail", "tvd": f"top-{k}+tail",
                      "predicted_alpha": f"top-{k}+tail, upper bound", "top1": "full vocabulary"}
        else:
            p_top = pred["p_logits"].argmax(-1)
        sums["top1"] += (pred["q_logits"].argmax(-1) == p_top).sum().item()
        positions += pred["q_logits"].shape[0]
    labels = labels or dict.fromkeys(("fkl", "tvd", "predicted_alpha", "top1"), "full vocabulary")
    if positions == 0:
        return {"positions": 0, "temperature": 1.0, "distribution": label, "labels": labels}
    out = {k: v / positions for k, v in sums.items()}
    out["predicted_alpha"] = 1.0 - out["tvd"]
    if kind == "eagle" and any(depth_n):
        depth_n = [c for c in depth_n if c]
        out["top1_at"] = [a / c for a, c in zip(depth_hits, depth_n)]
        out["alpha_at"] = [b / c for b, c in zip(depth_overlap, depth_n)]
        out["positions_at"] = depth_n
        out["simulated_tau"] = {"0": simulated_tau(out["top1_at"]), "1": simulated_tau(out["alpha_at"])}
        out["simulated_tau_note"] = (f"1 + sum_k prod_(i<=k) acceptance at depth i over {len(depth_n)} drafting "
                                     "depths unrolled on the head's own features (T=0: top1_at, T=1: alpha_at)")
    return {**out, "positions": positions, "temperature": 1.0, "distribution": label, "labels": labels}


def _full_p_at_step(batch, head, parts, s: int, n: int):
    """The target's FULL-vocabulary p at the positions unroll step s counts (drafts._predict_eagle3's rule:
    step s at position t predicts token t+2+s, counted where it is trained and in the draft vocabulary);
    None if the count disagrees with the step's n rows (then the caller keeps the restricted p)."""
    ids = batch["input_ids"]
    B, T = ids.shape
    if "hidden_last" not in batch or T - 2 - s <= 0:
        return None
    trained = batch["loss_mask"].bool() & batch["attention_mask"].bool()
    c = torch.zeros(B, T, dtype=torch.bool, device=ids.device)
    c[:, :T - 2 - s] = (trained & head.t2d[ids])[:, 2 + s:]
    f = batch["hidden_last"].to(parts.lm_head.weight.dtype)[:, 1 + s:][c[:, :T - 1 - s]]
    if f.shape[0] != n:
        return None
    return torch.softmax(target_logits_from_hidden(parts.config, parts.lm_head, f).float(), -1)


@torch.no_grad()
def eagle3_metrics(model, batches, parts) -> dict:
    """EAGLE-3's first drafted token against the target's FULL distribution (q is zero outside the draft
    vocabulary), so predicted_alpha is the real expected acceptance; fkl is over the draft vocabulary
    (p restricted and renormalised, positions whose token is outside it left out, as training does);
    `vocab_coverage` is the target mass inside the draft vocabulary.

    Per unrolled draft depth s (the head fed its own states from depth 2 on, as when drafting):
    `top1_at[s]` (T=0 acceptance) and `alpha_at[s]` = E[sum_x min(p, q)] (T=1 acceptance, p over the full
    vocabulary); depth 1 counts every trained position, depths >= 2 the positions whose token is in the
    draft vocabulary (training's rule), which favours them slightly. `simulated_tau` = 1 + sum_k prod_{i<=k}
    of each, over the unrolled depths: the held-out prediction of the measured tau (T=0 and T=1)."""
    head = getattr(model, "module", model)
    sums = {"tvd": 0.0, "top1": 0.0, "vocab_coverage": 0.0}
    fkl_sum, fkl_n, positions = 0.0, 0, 0
    step_hits, step_acc, step_n = [], [], []
    for batch in batches:
        pred = drafts.predict("eagle3", model, batch, parts)
        ids = pred["draft_ids"]
        if pred["metric_q_logits"].shape[0]:
            p = torch.softmax(target_logits_from_hidden(parts.config, parts.lm_head, pred["metric_f"]).float(), -1)
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
                step_acc.append(0.0)
                step_n.append(0)
            if s == 0 and pred["metric_q_logits"].shape[0]:  # depth 1: every trained position, full p
                step_hits[0] += (ids[q_d.argmax(-1)] == p.argmax(-1)).sum().item()
                step_acc[0] += torch.minimum(p, q).sum(-1).sum().item()
                step_n[0] += p.shape[0]
            n = step["q_logits"].shape[0]
            if n and s > 0:
                qs = torch.softmax(step["q_logits"].float(), -1)
                full = _full_p_at_step(batch, head, parts, s, n)
                if full is not None:
                    step_hits[s] += (ids[qs.argmax(-1)] == full.argmax(-1)).sum().item()
                    step_acc[s] += torch.minimum(full[:, ids], qs).sum(-1).sum().item()
                else:  # over the draft vocabulary (p renormalised): an upper bound
                    ps = torch.softmax(step["p_logits"].float(), -1)
                    step_hits[s] += (qs.argmax(-1) == ps.argmax(-1)).sum().item()
                    step_acc[s] += torch.minimum(ps, qs).sum(-1).sum().item()
                step_n[s] += n
            if s == 0 and n:
                log_p, log_q = drafts.distribution_logprobs(step, 1.0)
                fkl_sum += losses.divergences(log_p, log_q, ("fkl",))["fkl"].sum().item()
                fkl_n += n
    label = "full vocabulary (q zero outside the draft vocabulary); fkl over the draft vocabulary"
    labels = {"fkl": "draft vocab", "tvd": "full vocabulary", "predicted_alpha": "full vocabulary",
              "top1": "full vocabulary"}
    if positions == 0:
        return {"positions": 0, "temperature": 1.0, "distribution": label, "labels": labels}
    out = {k: v / positions for k, v in sums.items()}
    out["predicted_alpha"] = 1.0 - out["tvd"]
    out["fkl"] = fkl_sum / fkl_n if fkl_n else float("nan")
    out["top1_at"] = [h / n if n else 0.0 for h, n in zip(step_hits, step_n)]
    out["alpha_at"] = [a / n if n else 0.0 for a, n in zip(step_acc, step_n)]
    out["positions_at"] = list(step_n)
    out["simulated_tau"] = {"0": simulated_tau(out["top1_at"]), "1": simulated_tau(out["alpha_at"])}
    out["simulated_tau_note"] = (f"1 + sum_k prod_(i<=k) acceptance at depth i over the {len(step_n)} unrolled "
                                 "depths (T=0: top1_at, T=1: alpha_at); held-out, teacher-forced tokens")
    return {**out, "positions": positions, "temperature": 1.0, "distribution": label, "labels": labels}
