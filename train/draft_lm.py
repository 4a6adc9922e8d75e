"""A small causal LM drafter: the target's architecture and vocabulary, fewer/smaller layers.

Initialised from the target's embeddings (and its first layers when `draft.copy_target_layers` and
the shapes fit), or from `draft.init_from` (an existing small model with the same vocabulary).
Optional LoRA via peft. Trained on the cached top-k distributions, so its hidden size is free.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from specdistill.errors import SpecdistillError


def target_weight_files(target_dir: str | Path) -> list[Path]:
    d = Path(target_dir)
    if not d.is_dir():  # a hub id: fetch only config and weights (never the whole repo)
        from huggingface_hub import snapshot_download

        d = Path(snapshot_download(str(target_dir), allow_patterns=["*.json", "*.safetensors"]))
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise SpecdistillError(f"target {target_dir}: no .safetensors weight files")
    return files


def read_target_tensors(target_dir: str | Path, wanted) -> dict[str, torch.Tensor]:
    """Read only the named tensors from the target's safetensors (no full model load)."""
    from safetensors import safe_open

    wanted = set(wanted)
    found = {}
    for f in target_weight_files(target_dir):
        with safe_open(str(f), framework="pt") as fh:
            for name in wanted & set(fh.keys()):
                found[name] = fh.get_tensor(name)
    return found


def draft_lm_config(target_config, draft_cfg):
    """The target's config with the draft's sizes (head_dim follows hidden/heads when they change)."""
    cfg = copy.deepcopy(target_config)
    cfg.num_hidden_layers = draft_cfg.num_layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types[:draft_cfg.num_layers])
    resized = False
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads"):
        value = getattr(draft_cfg, key)
        if value is not None and value != getattr(cfg, key):
            setattr(cfg, key, value)
            resized = resized or key in ("hidden_size", "num_attention_heads")
    if resized and hasattr(cfg, "head_dim"):
        if cfg.hidden_size % cfg.num_attention_heads:
            raise SpecdistillError(f"draft.hidden_size {cfg.hidden_size} is not a multiple of "
                                   f"draft.num_attention_heads {cfg.num_attention_heads}")
        cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
    cfg.use_cache = True
    return cfg


def _copy_matching(model, source: dict[str, torch.Tensor]) -> list[str]:
    """Copy every source tensor whose name and shape match the draft's; return the copied names."""
    own = model.state_dict()
    copied = []
    with torch.no_grad():
        for name, tensor in source.items():
            if name in own and own[name].shape == tensor.shape:
                own[name].copy_(tensor.to(own[name].dtype))
                copied.append(name)
    return copied


def build_draft_lm(draft_cfg, target_config, target_dir: str | None, weights: bool = True):
    """The draft LM; with weights=False only its shapes (on the meta device, for dry runs)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if draft_cfg.init_from:
        where = draft_cfg.init_from
        try:
            cfg = AutoConfig.from_pretrained(where)
        except OSError as e:
            raise SpecdistillError(f"draft.init_from {where}: cannot load its config ({str(e).splitlines()[0]})") from None
        if cfg.vocab_size != target_config.vocab_size:
            raise SpecdistillError(f"draft.init_from {where}: vocabulary {cfg.vocab_size} differs from the "
                                   f"target's {target_config.vocab_size}; a drafter must share the tokenizer")
        if not weights:
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(cfg)
        model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32)
    else:
        cfg = draft_lm_config(target_config, draft_cfg)
        if not weights:
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(cfg)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
        if draft_cfg.copy_target_layers:
            names += [n for n in model.state_dict() if n.startswith("model.layers.")]
        source = read_target_tensors(target_dir, names)
        if "lm_head.weight" not in source and "model.embed_tokens.weight" in source:
            source["lm_head.weight"] = source["model.embed_tokens.weight"]  # tied embeddings
        _copy_matching(model, source)
        model.tie_weights()
    if draft_cfg.lora is not None:
        model = add_lora(model, draft_cfg.lora)
    return model


def add_lora(model, lora_cfg):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=lora_cfg.r, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                                            target_modules=list(lora_cfg.target_modules), task_type="CAUSAL_LM"))


def plain_model(model):
    """The underlying transformers model (under a peft wrapper, if any)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def own_state_dict(model) -> dict[str, torch.Tensor]:
    """HF names of a plain causal LM (LoRA merged in); a tied lm_head is left out (it is the embedding)."""
    lora = hasattr(model, "merge_adapter")
    if lora:
        model.merge_adapter()
    try:
        base = plain_model(model)
        state = {}
        for name, tensor in base.state_dict().items():
            if "lora_" in name:
                continue
            state[name.replace(".base_layer.", ".")] = tensor.detach().clone().contiguous()
    finally:
        if lora:
            model.unmerge_adapter()
    if getattr(plain_model(model).config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return state


def load_draft_lm(config_dict: dict, state: dict[str, torch.Tensor], device="cpu", dtype=torch.float32):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(config_dict)
    cfg = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise SpecdistillError(f"draft weights do not match its config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.tie_weights()
    return model.to(device).eval()


def config_dict(model) -> dict:
    return json.loads(plain_model(model).config.to_json_string())
