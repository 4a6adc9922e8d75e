"""Draft kinds behind one dispatch: build, predict (what the losses compare), save, reload.

  eagle     train/eagle.py: input (x[t+1], f[t]) -> f_hat[t+1]; p from lm_head(f[t+1]) (full vocabulary)
  draft_lm  train/draft_lm.py: a small causal LM; p from the cached top-k (or lm_head(hidden_last))
  eagle3    reserved (another issue): add a branch to each function below.

Training never loads the whole target: `load_target_parts` reads only its embedding and LM head
from the safetensors files.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specdistill.errors import SpecdistillError
from specdistill.train import draft_lm
from specdistill.train.eagle import EagleHead

KINDS = ("eagle", "draft_lm")


@dataclass
class TargetParts:
    config: object
    embed: nn.Embedding
    lm_head: nn.Linear
    where: str  # local dir or hub id


class ScaledEmbedding(nn.Embedding):
    """Gemma multiplies its embeddings by sqrt(hidden) inside the embedding module; match it."""

    def forward(self, ids):
        return super().forward(ids) * torch.tensor(self.embedding_dim ** 0.5, dtype=self.weight.dtype)


def _require_kind(kind: str) -> None:
    if kind not in KINDS:
        raise SpecdistillError(f"draft.kind {kind!r} is not implemented yet; implemented: {', '.join(KINDS)}")


def load_target_parts(target_cfg, device="cpu", dtype=torch.float32) -> TargetParts:
    """The target's config plus its frozen embedding and LM head, read straight from safetensors."""
    from specdistill.target import load_target_config, resolve_target

    config = load_target_config(target_cfg)
    where = resolve_target(target_cfg)
    tensors = draft_lm.read_target_tensors(where, ["model.embed_tokens.weight", "lm_head.weight"])
    if "model.embed_tokens.weight" not in tensors:
        raise SpecdistillError(f"target.path {target_cfg.path}: no model.embed_tokens.weight in its safetensors")
    embed_w = tensors["model.embed_tokens.weight"]
    head_w = tensors.get("lm_head.weight", embed_w)  # tied embeddings: the head is the embedding
    cls = ScaledEmbedding if config.model_type.startswith("gemma") else nn.Embedding
    embed = cls(*embed_w.shape, _weight=embed_w.to(dtype), _freeze=True)
    lm_head = nn.Linear(head_w.shape[1], head_w.shape[0], bias=False)
    lm_head.weight = nn.Parameter(head_w.to(dtype), requires_grad=False)
    return TargetParts(config, embed.to(device).requires_grad_(False), lm_head.to(device).requires_grad_(False), where)


def build_draft(recipe, target_config, target_embed, target_lm_head, target_dir: str | None = None,
                weights: bool = True):
    """A fresh draft for recipe.draft.kind. weights=False builds shapes only, on the meta device."""
    kind = recipe.draft.kind
    _require_kind(kind)
    if kind == "eagle":
        if not weights:
            with torch.device("meta"):
                return EagleHead(target_config)
        return EagleHead(target_config).bind_target(target_embed, target_lm_head)
    if weights and target_dir is None:
        from specdistill.target import resolve_target

        target_dir = resolve_target(recipe.target)
    return draft_lm.build_draft_lm(recipe.draft, target_config, target_dir, weights=weights)


def own_state_dict(kind: str, draft) -> dict[str, torch.Tensor]:
    """What draft.safetensors holds: eagle -> EagleHead.own_state_dict(); draft_lm -> plain HF names."""
    _require_kind(kind)
    if kind == "eagle":
        return draft.own_state_dict()
    return draft_lm.own_state_dict(draft)


def draft_config_dict(kind: str, draft) -> dict:
    if kind == "eagle":
        return json.loads(draft.config.to_json_string())
    return draft_lm.config_dict(draft)


def draft_kind(step_dir: str | Path) -> str:
    path = Path(step_dir) / "draft_config.json"
    if not path.is_file():
        raise SpecdistillError(f"{step_dir}: no draft_config.json (not a checkpoint)")
    return json.loads(path.read_text())["kind"]


def load_draft(step_dir: str | Path, target_model):
    """Rebuild a checkpoint's draft bound to the loaded target's frozen embedding / LM head, in eval mode.

    eagle -> EagleHead; draft_lm -> a plain transformers causal LM. Device and dtype follow the target.
    """
    from safetensors.torch import load_file
    from transformers import AutoConfig

    step_dir = Path(step_dir)
    if not (step_dir / "COMPLETE").exists():
        raise SpecdistillError(f"{step_dir}: checkpoint is incomplete (no COMPLETE marker)")
    meta = json.loads((step_dir / "draft_config.json").read_text())
    kind = meta["kind"]
    _require_kind(kind)
    state = load_file(str(step_dir / "draft.safetensors"))
    ref = target_model.get_input_embeddings().weight
    if kind == "eagle":
        cfg = dict(meta["config"])
        head = EagleHead(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
        head.load_own_state_dict(state)
        head.bind_target(target_model.get_input_embeddings(), target_model.get_output_embeddings())
        return head.to(device=ref.device, dtype=ref.dtype).eval().requires_grad_(False)
    return draft_lm.load_draft_lm(meta["config"], state, device=ref.device, dtype=ref.dtype).requires_grad_(False)


# ---- what the losses compare -------------------------------------------------------------------

def _valid(batch, key: str) -> torch.Tensor:
    return batch[key].bool() & batch["attention_mask"].bool()


def predict(kind: str, model, batch: dict, parts: TargetParts, noise: float = 0.0, feature_std: float = 1.0,
            generator: torch.Generator | None = None) -> dict:
    """Draft and target predictions at the counted positions only (rows [M]).

    Returns q_logits [M, V] and either p_logits [M, V] (full vocabulary) or topk_logprobs/topk_ids/
    tail_mass (cached top-k); eagle adds f_hat, f [M, H] for the feature regression.
    `model` is the draft or its DeepSpeed engine (same call signature).
    """
    _require_kind(kind)
    if kind == "eagle":
        return _predict_eagle(model, batch, parts, noise, feature_std, generator)
    return _predict_draft_lm(model, batch, parts)


def _predict_eagle(model, batch, parts, noise, feature_std, generator):
    if "hidden_last" not in batch:
        raise SpecdistillError("draft.kind eagle needs hidden_last in the cache (cache.store)")
    ids, h = batch["input_ids"], batch["hidden_last"].to(parts.lm_head.weight.dtype)
    B, T = ids.shape
    feats = h[:, :-1]
    if noise > 0:  # EAGLE's uniform noise on the input features, half-width noise * feature std
        u = torch.rand(feats.shape, generator=generator, dtype=torch.float32).to(feats.device, feats.dtype)
        feats = feats + (2 * u - 1) * (noise * feature_std)
    positions = torch.arange(T - 1, device=ids.device).expand(B, -1)
    f_hat = model(ids[:, 1:], feats, positions, None, batch["attention_mask"][:, 1:])
    # output t predicts f[t+1]; its token t+2 must be trained
    counted = torch.zeros(B, T - 1, dtype=torch.bool, device=ids.device)
    counted[:, :-1] = _valid(batch, "loss_mask")[:, 2:]
    f_hat, f = f_hat[counted], h[:, 1:][counted]
    with torch.no_grad():
        p_logits = parts.lm_head(f)
    return {"q_logits": parts.lm_head(f_hat), "p_logits": p_logits, "f_hat": f_hat, "f": f}


def _predict_draft_lm(model, batch, parts):
    ids = batch["input_ids"]
    logits = model(input_ids=ids, attention_mask=batch["attention_mask"]).logits
    counted = torch.zeros_like(ids, dtype=torch.bool)
    counted[:, :-1] = _valid(batch, "loss_mask")[:, 1:]  # logits at j predict token j+1
    out = {"q_logits": logits[counted]}
    if "topk_logprobs" in batch:
        for key in ("topk_logprobs", "topk_ids", "tail_mass"):
            out[key] = batch[key][counted]
    elif "hidden_last" in batch:
        with torch.no_grad():
            out["p_logits"] = parts.lm_head(batch["hidden_last"][counted].to(parts.lm_head.weight.dtype))
    else:
        raise SpecdistillError("draft.kind draft_lm needs topk (or hidden_last) in the cache (cache.store)")
    return out


def distribution_logprobs(pred: dict, temperature: float):
    """(log p, log q) for the losses: full vocabulary, or top-k + tail bucket."""
    from specdistill.train import losses

    if "topk_ids" in pred:
        return losses.topk_logprobs(pred["topk_logprobs"], pred["topk_ids"], pred["tail_mass"],
                                    pred["q_logits"], temperature)
    return losses.full_vocab_logprobs(pred["p_logits"], pred["q_logits"], temperature)


def training_loss(kind: str, pred: dict, loss_cfg):
    """(loss, {component: value}) for one micro batch."""
    from specdistill.train import losses

    log_p, log_q = distribution_logprobs(pred, loss_cfg.temperature)
    dist, parts = losses.mixed_loss(log_p, log_q, dict(loss_cfg.terms), loss_cfg.jsd_beta)
    if kind != "eagle":
        return dist, parts
    feature = losses.smooth_l1_features(pred["f_hat"], pred["f"])
    parts = {**parts, "feature_smooth_l1": feature.detach(), "distribution": dist.detach()}
    return loss_cfg.feature_weight * feature + loss_cfg.distribution_weight * dist, parts
