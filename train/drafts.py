"""Draft kinds behind one dispatch: build, predict (what the losses compare), save, reload.

  eagle     train/eagle.py: input (x[t+1], f[t]) -> f_hat[t+1]; p from lm_head(f[t+1]) (full vocabulary)
  draft_lm  train/draft_lm.py: a small causal LM; p from the cached top-k (or lm_head(hidden_last))
  eagle3    train/eagle3.py: fused aux states -> unrolled `ttt_steps` times on its own outputs; p is the
            target's distribution restricted to the draft vocabulary (full vocabulary for the metrics)

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
from specdistill.target import target_logits_from_hidden
from specdistill.train import draft_lm
from specdistill.train import eagle3
from specdistill.train.eagle import EagleHead
from specdistill.train.eagle3 import Eagle3Head

KINDS = ("eagle", "eagle3", "draft_lm")


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
    if kind == "eagle" and not weights:
        with torch.device("meta"):
            return EagleHead(target_config)
    if weights and target_dir is None:
        from specdistill.target import resolve_target

        target_dir = resolve_target(recipe.target)
    if kind == "eagle":
        head = EagleHead(target_config)
        if recipe.draft.init_from:  # warm start from a released / exported head (train/warm_start.py)
            from specdistill.train.warm_start import warm_eagle

            warm_eagle(recipe.draft.init_from, head, target_config)
        else:
            _init_layer(recipe, head.body.layers[0], target_dir, target_config)
        return head.bind_target(target_embed, target_lm_head)
    if kind == "eagle3":
        return _build_eagle3(recipe, target_config, target_embed, target_lm_head, target_dir, weights)
    return draft_lm.build_draft_lm(recipe.draft, target_config, target_dir, weights=weights)


def _build_eagle3(recipe, target_config, target_embed, target_lm_head, target_dir, weights: bool):
    vocab = target_config.vocab_size
    vd = min(recipe.draft.draft_vocab_size or 32000, vocab)
    aux = recipe.cache.aux_layers or eagle3.default_aux_layers(target_config.num_hidden_layers)
    if not weights:
        with torch.device("meta"):
            return Eagle3Head(target_config, vd, aux)
    if recipe.draft.init_from:  # warm start from a released / exported head (train/warm_start.py)
        from specdistill.train.warm_start import released_eagle3_shape, warm_eagle3

        vd, released_aux = released_eagle3_shape(recipe.draft.init_from, target_config)
        if released_aux is not None and list(released_aux) != list(aux):
            raise SpecdistillError(f"draft.init_from {recipe.draft.init_from}: the head reads target layers "
                                   f"{released_aux}, the cache holds {aux}; set cache.aux_layers: {released_aux}")
        head = Eagle3Head(target_config, vd, aux)
        head.config.ttt_steps = recipe.draft.ttt_steps
        warm_eagle3(recipe.draft.init_from, head, target_config)
        return head.bind_target(target_embed)
    head = Eagle3Head(target_config, vd, aux)
    head.config.ttt_steps = recipe.draft.ttt_steps
    _init_layer(recipe, head.layers[0], target_dir, target_config)
    counts = eagle3.trained_token_counts(recipe.run_dir, vocab)
    head.set_draft_vocab(eagle3.draft_vocab_from_counts(counts, vd))
    if target_lm_head is not None:
        norm = draft_lm.read_target_tensors(target_dir, ["model.norm.weight"]).get("model.norm.weight")
        head.init_readout(target_lm_head.weight, norm)
    return head.bind_target(target_embed)


def _init_layer(recipe, layer, target_dir, target_config) -> None:
    """draft.init_layer_from_target: start the head's Llama layer from the target's last layer where shapes fit."""
    if recipe.draft.init_layer_from_target and target_dir is not None:
        from specdistill.train.eagle import init_layer_from_target

        init_layer_from_target(layer, target_dir, target_config)


def own_state_dict(kind: str, draft) -> dict[str, torch.Tensor]:
    """What draft.safetensors holds: eagle -> EagleHead.own_state_dict(); draft_lm -> plain HF names."""
    _require_kind(kind)
    if kind in ("eagle", "eagle3"):
        return draft.own_state_dict()
    return draft_lm.own_state_dict(draft)


def draft_config_dict(kind: str, draft) -> dict:
    if kind in ("eagle", "eagle3"):
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
    if kind == "eagle3":
        cfg = dict(meta["config"])
        config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        head = Eagle3Head(config, config.draft_vocab_size, config.eagle_aux_hidden_state_layer_ids)
        head.load_own_state_dict(state)
        head.bind_target(target_model.get_input_embeddings())
        head = head.to(device=ref.device, dtype=ref.dtype)
        head.d2t.data, head.t2d.data = state["d2t"].to(ref.device), state["t2d"].to(ref.device)  # keep int/bool
        return head.eval().requires_grad_(False)
    return draft_lm.load_draft_lm(meta["config"], state, device=ref.device, dtype=ref.dtype).requires_grad_(False)


# ---- what the losses compare -------------------------------------------------------------------

def _valid(batch, key: str) -> torch.Tensor:
    return batch[key].bool() & batch["attention_mask"].bool()


def predict(kind: str, model, batch: dict, parts: TargetParts, noise: float = 0.0, feature_std: float = 1.0,
            generator: torch.Generator | None = None, distribution_sample: float = 1.0) -> dict:
    """Draft and target predictions at the counted positions only (rows [M]).

    Returns q_logits [M, V] and either p_logits [M, V] (full vocabulary) or topk_logprobs/topk_ids/
    tail_mass (cached top-k); eagle adds f_hat, f [M, H] for the feature regression.
    `model` is the draft or its DeepSpeed engine (same call signature).
    """
    _require_kind(kind)
    if kind == "eagle":
        return _predict_eagle(model, batch, parts, noise, feature_std, generator, distribution_sample)
    if kind == "eagle3":
        return _predict_eagle3(model, batch, parts, noise, generator)
    return _predict_draft_lm(model, batch, parts)


def _predict_eagle(model, batch, parts, noise, feature_std, generator, distribution_sample=1.0):
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
    # The full-vocabulary projection dominates the cost of a step (49k x H per position, forward and
    # backward): `loss.distribution_sample` < 1 spends it on a random share of the positions only.
    keep = slice(None)
    if distribution_sample < 1.0 and generator is not None and f.shape[0] > 1:
        keep = torch.randperm(f.shape[0], generator=generator)[:max(1, round(f.shape[0] * distribution_sample))]
    with torch.no_grad():
        p_logits = target_logits_from_hidden(parts.config, parts.lm_head, f[keep])
    return {"q_logits": target_logits_from_hidden(parts.config, parts.lm_head, f_hat[keep]), "p_logits": p_logits,
            "f_hat": f_hat, "f": f}


def _predict_eagle3(model, batch, parts, noise, generator):
    """Training-time test: step s at position t predicts token t+2+s; counted where that token is trained.

    The loss compares q with the target's distribution restricted to the draft vocabulary and
    renormalised; positions whose next token lies outside the draft vocabulary are not counted (the
    draft cannot propose it). Step 0 also keeps every trained position (`metric_*`) so the offline
    metrics measure the real acceptance, draft-vocabulary misses included.
    """
    if "hidden_aux" not in batch or "hidden_last" not in batch:
        raise SpecdistillError("draft.kind eagle3 needs hidden_aux and hidden_last in the cache (cache.store)")
    head = getattr(model, "module", model)
    ids, att = batch["input_ids"], batch["attention_mask"]
    B, T = ids.shape
    dtype = parts.lm_head.weight.dtype
    trained = _valid(batch, "loss_mask")
    in_vocab = head.t2d[ids]
    first = torch.zeros(B, T, dtype=torch.bool, device=ids.device)  # step 0, every trained position
    first[:, :T - 2] = trained[:, 2:]
    counted = []  # step s: trained and inside the draft vocabulary
    for s in range(min(head.config.ttt_steps, T - 2)):  # later steps would have no positions left
        c = torch.zeros(B, T, dtype=torch.bool, device=ids.device)
        c[:, :T - 2 - s] = (trained & in_vocab)[:, 2 + s:]
        counted.append(c)
    aux = batch["hidden_aux"].to(dtype).flatten(2)  # [B, T, A*H]
    logits = model(ids, None, None, None, att, ttt_aux=aux, ttt_steps=len(counted),
                   noise=noise, generator=generator, ttt_keep=[first] + counted[1:])
    draft_ids = head.draft_ids
    last = batch["hidden_last"].to(dtype)
    target_rows = parts.lm_head.weight[draft_ids]  # the target's LM head over the draft vocabulary
    steps = []
    for s, (c, q) in enumerate(zip(counted, logits)):
        if s == 0:
            q = q[c[first]]
        with torch.no_grad():  # target logits over the draft vocabulary, at the positions counted
            p = target_logits_from_hidden(parts.config, target_rows, last[:, 1 + s:][c[:, :T - 1 - s]])
        steps.append({"q_logits": q, "p_logits": p})
    return {**steps[0], "steps": steps, "draft_ids": draft_ids,
            "metric_q_logits": logits[0], "metric_f": last[:, 1:][first[:, :T - 1]]}


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
            out["p_logits"] = target_logits_from_hidden(
                parts.config, parts.lm_head, batch["hidden_last"][counted].to(parts.lm_head.weight.dtype))
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

    if kind == "eagle3":  # per unroll step, weighted ttt_decay**s (EAGLE-3 / SpecForge use 0.8)
        total, parts, weights = 0.0, {}, 0.0
        for s, step in enumerate(pred["steps"]):
            log_p, log_q = distribution_logprobs(step, loss_cfg.temperature)
            dist, _ = losses.mixed_loss(log_p, log_q, dict(loss_cfg.terms), loss_cfg.jsd_beta)
            total = total + loss_cfg.ttt_decay ** s * dist
            weights += loss_cfg.ttt_decay ** s
            parts[f"step{s}"] = dist.detach()
        return total / weights, parts
    log_p, log_q = distribution_logprobs(pred, loss_cfg.temperature)
    dist, parts = losses.mixed_loss(log_p, log_q, dict(loss_cfg.terms), loss_cfg.jsd_beta)
    if kind != "eagle":
        return dist, parts
    feature = losses.smooth_l1_features(pred["f_hat"], pred["f"])
    parts = {**parts, "feature_smooth_l1": feature.detach(), "distribution": dist.detach()}
    return loss_cfg.feature_weight * feature + loss_cfg.distribution_weight * dist, parts
