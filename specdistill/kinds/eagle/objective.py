"""EAGLE-1's training objective: input (x[t+1], f[t]) -> f_hat[t+1]; Smooth-L1 on features + w * the
distribution loss of lm_head(f_hat) against lm_head(f) (full vocabulary), with EAGLE's uniform feature
noise; offline metrics: the first draft's, and acceptance per draft depth with the head fed its own features.
"""
from __future__ import annotations

import torch

from specdistill.errors import SpecdistillError
from specdistill.decoding.kv import new_cache
from specdistill.kinds.common.heads import ttt_mask
from specdistill.kinds.eagle.model import EagleHead
from specdistill.metrics import acceptance, top1_match
from specdistill.target import target_logits_from_hidden
from specdistill.objective import losses
from specdistill.objective.base import BaseObjective, counted
from specdistill.objective.offline_metrics import DepthSums

EAGLE_DEPTHS = 3  # drafting unrolled this deep on the held-out split (EAGLE-3 unrolls its ttt_steps)


def teacher_forced(head: EagleHead, ids: torch.Tensor, features: torch.Tensor, attention_mask=None) -> torch.Tensor:
    """EAGLE's alignment: head row t reads (token t+1, the target's feature at t) and predicts the feature
    at t+1. ids [B, T], features [B, T-1, H] (rows 0..T-2) -> [B, T-1, H]."""
    B, T = ids.shape
    positions = torch.arange(T - 1, device=ids.device).expand(B, -1)
    return head(ids[:, 1:], features, positions, None, None if attention_mask is None else attention_mask[:, 1:])


def feature_std(data) -> float:
    """Std of the cached features of the first 8 sequences (deterministic): EAGLE's noise scale."""
    return torch.cat([data[i]["hidden_last"].float().flatten(1) for i in range(min(8, len(data)))]).std().item()


class Objective(BaseObjective):
    def __init__(self, head, parts, loss_cfg, data=None):
        super().__init__(head, parts, loss_cfg)
        self.feature_std = feature_std(data) if data is not None else 1.0

    def recorded(self) -> dict:
        return {"feature_std": self.feature_std}  # the noise scale, so a reader knows what the head was trained with

    def forward(self, batch: dict, generator: torch.Generator | None = None) -> dict:
        """q/p logits at the counted positions, plus f_hat and f [M, H] for the feature regression."""
        if "hidden_last" not in batch:
            raise SpecdistillError("draft.kind eagle needs hidden_last in the cache (cache.store)")
        parts, noise = self.parts, self.loss_cfg.feature_noise if generator is not None else 0.0
        ids, h = batch["input_ids"], batch["hidden_last"].to(parts.lm_head.weight.dtype)
        B, T = ids.shape
        feats = h[:, :-1]
        if noise > 0:  # EAGLE's uniform noise on the input features, half-width noise * feature std
            u = torch.rand(feats.shape, generator=generator, dtype=torch.float32, device=generator.device)
            u = u.to(feats.device, feats.dtype)  # drawn on the generator's device: the rank's, in training
            feats = feats + (2 * u - 1) * (noise * self.feature_std)
        f_hat = teacher_forced(self.head, ids, feats, batch["attention_mask"])
        # output t predicts f[t+1]; its token t+2 must be trained
        kept = torch.zeros(B, T - 1, dtype=torch.bool, device=ids.device)
        kept[:, :-1] = counted(batch)[:, 2:]
        f_hat, f = f_hat[kept], h[:, 1:][kept]
        # The full-vocabulary projection dominates the cost of a step (49k x H per position, forward and
        # backward): `loss.distribution_sample` < 1 spends it on a random share of the positions only.
        keep = slice(None)
        share = self.loss_cfg.distribution_sample
        if share < 1.0 and generator is not None and f.shape[0] > 1:
            keep = torch.randperm(f.shape[0], generator=generator, device=generator.device)
            keep = keep[:max(1, round(f.shape[0] * share))].to(f.device)
        with torch.no_grad():
            p_logits = target_logits_from_hidden(parts.config, parts.lm_head, f[keep])
        return {"q_logits": target_logits_from_hidden(parts.config, parts.lm_head, f_hat[keep]),
                "p_logits": p_logits, "f_hat": f_hat, "f": f}

    def loss(self, pred: dict):
        dist, components = super().loss(pred)
        feature = losses.smooth_l1_features(pred["f_hat"], pred["f"])
        components = {**components, "feature_smooth_l1": feature.detach(), "distribution": dist.detach()}
        return self.loss_cfg.feature_weight * feature + self.loss_cfg.distribution_weight * dist, components

    @torch.no_grad()
    def offline_metrics(self, batches) -> dict:
        """First-draft metrics, and (with hidden_last) acceptance per drafting depth and the simulated tau."""
        out = super().offline_metrics(batches)
        if not out["positions"]:
            return out
        depths = DepthSums()
        for batch in batches:
            if "hidden_last" in batch:
                for depth, counts in enumerate(zip(*self.unrolled_acceptance(batch))):
                    depths.add(depth, *counts)
        out.update(depths.result("drafting depths unrolled on the head's own features (T=0: top1_at, T=1: alpha_at)"))
        return out

    @torch.no_grad()
    def unrolled_acceptance(self, batch, depths: int = EAGLE_DEPTHS) -> tuple[list, list, list]:
        """EAGLE-1 drafting simulated on a held-out batch: depth s at start t reads token x[t+1+s] and, from
        depth 2 on, its own predicted feature of depth s-1 (EAGLE's drafting), attending to the real-feature
        positions <= t and its own earlier depths of the same chain (ttt_mask, the pattern the
        engine's cache produces). It predicts token x[t+2+s], counted where trained, against the target's p
        at that position. Returns per depth (top-1 hits, sum of min(p, q), positions)."""
        head, parts = self.head, self.parts
        ids, att = batch["input_ids"], batch["attention_mask"]
        B, T = ids.shape
        L = T - 1  # head position t reads (x[t+1], f[t])
        h = batch["hidden_last"].to(parts.lm_head.weight.dtype)
        trained = counted(batch)
        cache = new_cache(head.config)
        state, base = h[:, :-1], torch.arange(L, device=ids.device).expand(B, -1)
        hits, overlap, n = [], [], []
        for s in range(min(depths, L - 1)):
            inp = torch.zeros(B, L, dtype=ids.dtype, device=ids.device)
            inp[:, :L - s] = ids[:, 1 + s:]
            state = head(inp, state, base + s, cache, ttt_mask(L, s, att[:, 1:]))
            c = torch.zeros(B, L, dtype=torch.bool, device=ids.device)
            c[:, :L - 1 - s] = trained[:, 2 + s:]
            p = torch.softmax(target_logits_from_hidden(parts.config, parts.lm_head, h[:, 1 + s:][c[:, :L - s]]).float(), -1)
            q = torch.softmax(head.logits(state[c]).float(), -1)
            hits.append(top1_match(p, q).sum().item())
            overlap.append(acceptance(p, q).sum().item())
            n.append(int(c.sum()))
        return hits, overlap, n
