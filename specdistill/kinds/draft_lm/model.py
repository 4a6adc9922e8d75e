"""The draft LM: the target's architecture and vocabulary, fewer or smaller layers, built from the target's
embedding (and its first layers when `copy_target_layers` and the shapes fit) or from `init_from` (an
existing small model with the same vocabulary); optional LoRA.
"""
from __future__ import annotations

import copy

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from specdistill.errors import SpecdistillError
from specdistill.kinds.draft_lm.config import Config
from specdistill.target import read_target_tensors

def draft_lm_config(target_config, draft_cfg: Config):
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


def _config(draft_cfg: Config, target_config):
    if not draft_cfg.init_from:
        return draft_lm_config(target_config, draft_cfg)
    where = draft_cfg.init_from
    try:
        cfg = AutoConfig.from_pretrained(where)
    except OSError as e:
        raise SpecdistillError(f"draft.init_from {where}: cannot load its config ({str(e).splitlines()[0]})") from None
    if cfg.vocab_size != target_config.vocab_size:
        raise SpecdistillError(f"draft.init_from {where}: vocabulary {cfg.vocab_size} differs from the "
                               f"target's {target_config.vocab_size}; a drafter must share the tokenizer")
    return cfg


def shapes(recipe, target_config):
    """The draft's shapes only, on the meta device (dry runs, memory estimates)."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(_config(recipe.draft, target_config))


def build_model(draft_cfg: Config, target_config, target_dir):
    """The draft LM from its section, the target's config and (for copied weights) the target's files."""
    if draft_cfg.init_from:
        _config(draft_cfg, target_config)  # refuses another vocabulary before loading weights
        model = AutoModelForCausalLM.from_pretrained(draft_cfg.init_from, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(draft_lm_config(target_config, draft_cfg), dtype=torch.float32)
        names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
        if draft_cfg.copy_target_layers:
            names += [n for n in model.state_dict() if n.startswith("model.layers.")]
        source = read_target_tensors(target_dir, names)
        if "lm_head.weight" not in source and "model.embed_tokens.weight" in source:
            source["lm_head.weight"] = source["model.embed_tokens.weight"]  # tied embeddings
        _copy_matching(model, source)
        model.tie_weights()
    if draft_cfg.lora is not None:
        from peft import LoraConfig as PeftLoraConfig  # deferred: slow to import, and only LoRA runs need it
        from peft import get_peft_model

        lora = draft_cfg.lora
        model = get_peft_model(model, PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                     target_modules=list(lora.target_modules), task_type="CAUSAL_LM"))
    return model


def build(recipe, parts, data=None):
    return build_model(recipe.draft, parts.config, parts.where)


def owns(module) -> bool:
    return True  # any other module is a causal LM (this kind is the last one asked)


def plain_model(model):
    """The underlying transformers model (under a peft wrapper, if any)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def draft_vocabulary(head) -> torch.Tensor | None:
    """The target ids the draft can propose, where that is fewer than the target's vocabulary."""
    return None  # the target's whole vocabulary


def tiny_draft(target_model, k: int = 3):
    """The kind's case in the per-kind tests: a randomly initialised one-layer model of a (tiny) loaded target's
    config, seeded."""
    config = copy.deepcopy(target_model.config)
    config.num_hidden_layers = 1
    torch.manual_seed(4)
    return type(target_model)(config).eval().requires_grad_(False)
