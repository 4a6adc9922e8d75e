"""Medusa's training objective on the cache that exists (`hidden_last`, the target's final-norm states).

Head k at position t reads f[t] and predicts token t+2+k; its target distribution is the target's own
next-token distribution at position t+1+k, p = softmax(lm_head(f[t+1+k])) through `target_logits_from_hidden`
(the distribution the target samples that token from when decoding). Position t counts for head k where token
t+2+k is trained (loss mask) and real; positions running off the sequence do not. The loss is the recipe's
distribution loss per head, weighted head_decay**k (Medusa's 0.8**k) and normalised by the weights.
"""
from __future__ import annotations

import torch

from specdistill.errors import SpecdistillError
from specdistill.metrics import acceptance, top1_match
from specdistill.target import target_logits_from_hidden
from specdistill.objective import losses
from specdistill.objective.base import BaseObjective, counted
from specdistill.objective.offline_metrics import DepthSums


def head_positions(batch: dict, num_heads: int) -> list[torch.Tensor]:
    """Per head k, bool [B, T]: position t where token t+2+k is trained (so every token up to it is real)."""
    trained = counted(batch)
    B, T = trained.shape
    out = []
    for k in range(num_heads):
        c = torch.zeros(B, T, dtype=torch.bool, device=trained.device)
        if T - 2 - k > 0:
            c[:, :T - 2 - k] = trained[:, 2 + k:]
        out.append(c)
    return out


class Objective(BaseObjective):
    def forward(self, batch: dict, generator: torch.Generator | None = None) -> dict:
        """Per head k, q and the target's p logits at its counted positions (`steps`; head 0's also at the top
        level, the first drafted token the first-draft metrics measure)."""
        if "hidden_last" not in batch:
            raise SpecdistillError("draft.kind medusa needs hidden_last in the cache (cache.store)")
        parts = self.parts
        f = batch["hidden_last"].to(parts.lm_head.weight.dtype)
        B, T = f.shape[:2]
        heads = head_positions(batch, self.head.config.num_heads)
        # The target's distribution of token t+2+k is its LM head over f[t+1+k]: the heads share those rows, so
        # the (full-vocabulary) target logits are computed once per needed row and indexed per head.
        needed = torch.zeros(B, T, dtype=torch.bool, device=f.device)
        for k, c in enumerate(heads):
            needed[:, 1 + k:] |= c[:, :T - 1 - k]
        row = torch.full((B, T), -1, dtype=torch.long, device=f.device)
        row[needed] = torch.arange(int(needed.sum()), device=f.device)
        with torch.no_grad():
            p_rows = target_logits_from_hidden(parts.config, parts.lm_head, f[needed])
        steps = []
        for k, c in enumerate(heads):
            steps.append({"q_logits": self.head.head_logits(f[c], k),
                          "p_logits": p_rows[row[:, 1 + k:][c[:, :T - 1 - k]]]})
        return {**steps[0], "steps": steps}

    def loss(self, pred: dict):
        cfg, decay = self.loss_cfg, self.head.config.head_decay
        total, weights, components = 0.0, 0.0, {}
        for k, step in enumerate(pred["steps"]):
            log_p, log_q = losses.distribution_logprobs(step, cfg.temperature)
            dist, _ = self.distribution_loss(log_p, log_q)
            total = total + decay ** k * dist
            weights += decay ** k
            components[f"head{k}"] = dist.detach()
        return total / weights, components

    @torch.no_grad()
    def offline_metrics(self, batches) -> dict:
        """First-draft metrics (head 0, `first_draft_metrics`), and per head k = draft depth k+1: `top1_at[k]`
        (T=0 acceptance: argmax q = argmax p) and `alpha_at[k]` = sum min(p, q) (T=1 acceptance), every head reading
        the real state f[t] exactly as when drafting; `simulated_tau` = 1 + sum_k prod_(i<=k) of each."""
        out = super().offline_metrics(batches)
        if not out["positions"]:
            return out
        depths = DepthSums()
        for batch in batches:
            for k, step in enumerate(self(batch)["steps"]):
                if not step["q_logits"].shape[0]:
                    continue
                log_p, log_q = losses.distribution_logprobs(step, 1.0)
                depths.add(k, top1_match(log_p, log_q), acceptance(log_p.exp(), log_q.exp()), log_p.shape[0])
        out.update(depths.result("heads, each reading the target's real state (T=0: top1_at, T=1: alpha_at); held-out"))
        return out
