"""`draft.kind: eagle` — an EAGLE-1 head (train/eagle.py `EagleHead`), everything about it in one place.

  cache      hidden_last (the final-norm state the target's LM head reads)
  objective  input (x[t+1], f[t]) -> f_hat[t+1]; Smooth-L1 on features + w * the distribution loss of
             lm_head(f_hat) against lm_head(f) (full vocabulary), with EAGLE's uniform feature noise
  metrics    first-draft offline metrics + acceptance per draft depth with the head fed its own features
  drafter    position t reads (token t+1, f[t]); drafts on its own predicted features
  export     vllm-eagle (vLLM's EagleLlamaForCausalLM)
"""
from __future__ import annotations

import json
from typing import Literal

import torch
from pydantic import Field
from transformers import AutoConfig

from specdistill.errors import SpecdistillError
from specdistill.eval.runtime import crop_cache, new_cache
from specdistill.eval.sampling import pick, stack_draws
from specdistill.metrics import simulated_tau
from specdistill.section import Section
from specdistill.target import check_same_vocab, target_logits_from_hidden
from specdistill.train import losses, objective
from specdistill.train.eagle import EagleHead, init_layer_from_target
from specdistill.train.eagle3 import ttt_mask
from specdistill.train.objective import counted
from specdistill.train.warm_start import warm_eagle

NAME = "eagle"
LABEL = "EAGLE-1"  # in messages and reports
STORE = ["hidden_last"]
EXPORT_FORMATS = ("vllm-eagle",)
DRAFTS_TREES = True
PROMPTS_FKL_NOTE = None  # the head drafts over the target's whole vocabulary: fkl on the prompts is defined
EAGLE_DEPTHS = 3  # drafting unrolled this deep on the held-out split (EAGLE-3 unrolls its ttt_steps)


class Config(Section):
    kind: Literal["eagle"]
    init_from: str | None = Field(None, description="a released head to continue training (a vllm-eagle, "
                                  "vllm-eagle3 or speculators dir; train/warm_start.py)")
    init_layer_from_target: bool = Field(True, description="start the head's (Llama-style) decoder layer from "
                                         "the target's last layer where shapes fit (o_proj, MLP, norms)")


# ---- build, checkpoint ------------------------------------------------------------------------------

def shapes(recipe, target_config) -> EagleHead:
    """The head's shapes only, on the meta device (dry runs, memory estimates)."""
    with torch.device("meta"):
        return EagleHead(target_config)


def build(recipe, parts, data=None) -> EagleHead:
    """A fresh head bound to the target's frozen embedding and LM head; warm-started from draft.init_from."""
    head = EagleHead(parts.config)
    if recipe.draft.init_from:
        warm_eagle(recipe.draft.init_from, head, parts.config)
    elif recipe.draft.init_layer_from_target and parts.where is not None:
        init_layer_from_target(head.body.layers[0], parts.where, parts.config)
    return head.bind_target(parts.embed, parts.lm_head)


def owns(module) -> bool:
    return isinstance(module, EagleHead)


def checkpoint_config(head) -> dict:
    """The head's config as draft_config.json keeps it (EAGLE-3 heads are stored alike)."""
    return json.loads(head.config.to_json_string())


def own_state_dict(head) -> dict[str, torch.Tensor]:
    """The head's own tensors under vLLM's names (EAGLE-3 heads are stored alike)."""
    return head.own_state_dict()


def load(config: dict, state: dict[str, torch.Tensor], target_model) -> EagleHead:
    cfg = dict(config)
    head = EagleHead(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    head.load_own_state_dict(state)
    return head.bind_target(target_model.get_input_embeddings(), target_model.get_output_embeddings())


def draft_vocabulary(head) -> torch.Tensor | None:
    """The target ids the draft can propose, where that is fewer than the target's vocabulary."""
    return None  # the target's whole vocabulary

# ---- training objective -----------------------------------------------------------------------------

def teacher_forced(head: EagleHead, ids: torch.Tensor, features: torch.Tensor, attention_mask=None) -> torch.Tensor:
    """EAGLE's alignment: head row t reads (token t+1, the target's feature at t) and predicts the feature
    at t+1. ids [B, T], features [B, T-1, H] (rows 0..T-2) -> [B, T-1, H]."""
    B, T = ids.shape
    positions = torch.arange(T - 1, device=ids.device).expand(B, -1)
    return head(ids[:, 1:], features, positions, None, None if attention_mask is None else attention_mask[:, 1:])


def feature_std(data) -> float:
    """Std of the cached features of the first 8 sequences (deterministic): EAGLE's noise scale."""
    return torch.cat([data[i]["hidden_last"].float().flatten(1) for i in range(min(8, len(data)))]).std().item()


class Objective(objective.Objective):
    def __init__(self, head, parts, loss_cfg, data=None):
        super().__init__(head, parts, loss_cfg)
        self.feature_std = feature_std(data) if data is not None else 1.0

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
        hits, overlap, n = [0] * EAGLE_DEPTHS, [0.0] * EAGLE_DEPTHS, [0] * EAGLE_DEPTHS
        for batch in batches:
            if "hidden_last" in batch:
                for i, (a, b, c) in enumerate(zip(*self.unrolled_acceptance(batch))):
                    hits[i], overlap[i], n[i] = hits[i] + a, overlap[i] + b, n[i] + c
        if any(n):
            n = [c for c in n if c]
            out["top1_at"] = [a / c for a, c in zip(hits, n)]
            out["alpha_at"] = [b / c for b, c in zip(overlap, n)]
            out["positions_at"] = n
            out["simulated_tau"] = {"0": simulated_tau(out["top1_at"]), "1": simulated_tau(out["alpha_at"])}
            out["simulated_tau_note"] = (f"1 + sum_k prod_(i<=k) acceptance at depth i over {len(n)} drafting "
                                         "depths unrolled on the head's own features (T=0: top1_at, T=1: alpha_at)")
        return out

    @torch.no_grad()
    def unrolled_acceptance(self, batch, depths: int = EAGLE_DEPTHS) -> tuple[list, list, list]:
        """EAGLE-1 drafting simulated on a held-out batch: depth s at start t reads token x[t+1+s] and, from
        depth 2 on, its own predicted feature of depth s-1 (EAGLE's drafting), attending to the real-feature
        positions <= t and its own earlier depths of the same chain (eagle3.ttt_mask, the pattern the
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
            hits.append((p.argmax(-1) == q.argmax(-1)).sum().item())
            overlap.append(torch.minimum(p, q).sum(-1).sum().item())
            n.append(int(c.sum()))
        return hits, overlap, n


# ---- decoding -----------------------------------------------------------------------------------------

class EagleDrafter:
    """EAGLE-1 head: position t reads (token t+1, target feature f[t]) and predicts f[t+1].

    Its cache keeps only positions computed from the target's real features; after each verify the
    newly verified positions are run in one forward on their real features, then K tokens are drafted
    autoregressively on the head's own predicted features (EAGLE's scheme).
    """
    needs_features = True
    additive_tree_mask = True  # the head's body is a transformers model: a float mask (eval/tree.py)

    def __init__(self, head):
        self.head = head.eval().requires_grad_(False)
        self.cache = None

    def features(self, hidden_states):
        return hidden_states[-1]  # post final norm: the state the target's LM head reads

    def project(self, features):
        return features  # EAGLE-1 reads the feature itself

    def to_target(self, ids):
        return ids  # EAGLE-1 drafts over the target's own vocabulary

    def pick(self, h, temperature, generator):
        return pick(self.head.logits(h), temperature, generator)

    def reset(self, capacity: int = 0) -> None:
        self.cache = new_cache(self.head.config)

    def run(self, ids: torch.Tensor, state: torch.Tensor, start: int) -> torch.Tensor:
        """The head over ids [M] and states [1, M, H] at positions start.. (its cache cut to `start` first)."""
        crop_cache(self.cache, start)
        positions = torch.arange(start, start + ids.numel(), device=ids.device)[None]
        return self.head(ids[None], state, positions, past_key_values=self.cache)

    def propose(self, seq, n, new_features, k, temperature, generator):
        m = 0 if new_features is None else new_features.shape[0]
        real = n - 1 - m  # positions [0, real) already hold real-feature entries
        if m == 0 or k == 0:
            return stack_draws([], [], seq.device)
        h = self.run(seq[real + 1:n], self.project(new_features[None]), real)[:, -1:]
        tokens, qs = [], []
        for i in range(k):
            tok, q = self.pick(h[0, -1], temperature, generator)
            tokens.append(tok)
            qs.append(q)
            if i + 1 < k:
                h = self.run(tok.view(1), h, n - 1 + i)
        return stack_draws(tokens, qs, seq.device)


def drafter(head: EagleHead, target_model=None, static: bool = False) -> EagleDrafter:
    if target_model is not None:
        check_same_vocab(target_model, head)
    return EagleDrafter(head)


def prompt_logits(head: EagleHead, target_model, seq: torch.Tensor):
    """(p, q) logits [T, V] over `seq`, teacher-forced: head row t reads (token t+1, f[t]) and predicts token
    t+2 = target row t+1; row 0 has no draft prediction (zeros)."""
    out = target_model(seq, output_hidden_states=True)
    p_logits = out.logits[0]
    q = head.logits(teacher_forced(head, seq, out.hidden_states[-1][:, :-1])[0])
    return p_logits, torch.cat([torch.zeros_like(p_logits[:1]), q.to(p_logits.dtype)])
