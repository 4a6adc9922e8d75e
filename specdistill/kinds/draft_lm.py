"""`draft.kind: draft_lm` — a small causal LM drafter: the target's architecture and vocabulary, fewer or
smaller layers; everything about it in one place.

  build      from the target's embedding (and its first layers when `copy_target_layers` and the shapes
             fit), or from `init_from` (an existing small model with the same vocabulary); optional LoRA
  cache      topk (the target's top-k log-probs), so the draft's hidden size is free
  objective  the distribution loss at every trained position (logits at j predict token j+1)
  drafter    its own KV cache, K tokens autoregressively
  export     hf (an ordinary transformers model directory, vLLM's `draft_model` method)
"""
from __future__ import annotations

import copy
import json
from typing import Literal

import torch
from pydantic import Field
from transformers import AutoConfig, AutoModelForCausalLM

from specdistill.errors import SpecdistillError
from specdistill.eval.runtime import crop_cache, new_cache
from specdistill.eval.sampling import pick, stack_draws
from specdistill.section import Section
from specdistill.target import check_same_vocab, read_target_tensors, target_logits_from_hidden
from specdistill.train import objective
from specdistill.train.objective import counted

NAME = "draft_lm"
LABEL = "draft LM"  # in messages and reports
STORE = ["topk"]
EXPORT_FORMATS = ("hf",)
DRAFTS_TREES = False
PROMPTS_FKL_NOTE = None


class LoraConfig(Section):
    r: int = Field(16, ge=1)
    alpha: int = Field(32, ge=1)
    dropout: float = 0.0
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


class Config(Section):
    kind: Literal["draft_lm"]
    init_from: str | None = Field(None, description="an existing small model (hub id or dir) with the target's vocabulary")
    num_layers: int = Field(2, ge=1)
    hidden_size: int | None = Field(None, description="default the target's")
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    copy_target_layers: bool = Field(True, description="initialise from the target's first layers when shapes fit")
    lora: LoraConfig | None = None


# ---- build, checkpoint ------------------------------------------------------------------------------

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


def checkpoint_config(model) -> dict:
    return json.loads(plain_model(model).config.to_json_string())


def own_state_dict(model) -> dict[str, torch.Tensor]:
    """HF names of a plain causal LM (LoRA merged in); a tied lm_head is left out (it is the embedding)."""
    lora = hasattr(model, "merge_adapter")
    if lora:
        model.merge_adapter()
    try:
        state = {}
        for name, tensor in plain_model(model).state_dict().items():
            if "lora_" in name:
                continue
            state[name.replace(".base_layer.", ".")] = tensor.detach().clone().contiguous()
    finally:
        if lora:
            model.unmerge_adapter()
    if getattr(plain_model(model).config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return state


def load(config: dict, state: dict[str, torch.Tensor], target_model):
    """A checkpoint's draft as a plain transformers causal LM. Parts it shares frozen with the target (the
    embedding, the LM head) and that are absent from its weights are taken from the target, shape permitting."""
    cfg = dict(config)
    model_type = cfg.pop("model_type", None)
    if model_type is None:
        raise SpecdistillError("draft_config.json: config has no model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    if any("lora_" in k for k in state):
        raise SpecdistillError("draft.safetensors holds LoRA adapter tensors; checkpoints store LoRA merged into "
                               "the base weights (specdistill/kinds/draft_lm.py own_state_dict), this one does not")
    model = AutoModelForCausalLM.from_config(config, dtype=next(iter(state.values())).dtype)
    own = model.state_dict()
    extra = sorted(set(state) - set(own))
    if extra:
        raise SpecdistillError(f"draft.safetensors: unexpected tensors for a {model_type} draft: {extra[:5]}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise SpecdistillError(f"draft.safetensors: tensor {name} has shape {list(tensor.shape)}, "
                                   f"the draft config needs {list(own[name].shape)}")
    model.load_state_dict(state, strict=False)
    module_name = {m: n for n, m in model.named_modules()}
    embed_name = module_name[model.get_input_embeddings()] + ".weight"
    head_name = module_name[model.get_output_embeddings()] + ".weight"
    for name in sorted(set(own) - set(state)):  # the frozen parts shared with the target
        if name == embed_name:
            source = target_model.get_input_embeddings().weight
        elif name == head_name and not config.tie_word_embeddings:
            source = target_model.get_output_embeddings().weight
        elif name == head_name:
            continue  # tied: filled with the embedding
        else:
            raise SpecdistillError(f"draft.safetensors: missing tensor {name}")
        param = model.get_parameter(name)
        if param.shape != source.shape:
            raise SpecdistillError(f"draft.safetensors: has no {name} and the target's {list(source.shape)} does "
                                   f"not fit the draft's {list(param.shape)}")
        param.data.copy_(source.data)
    model.tie_weights()
    return model.eval()


def draft_vocabulary(head) -> torch.Tensor | None:
    """The target ids the draft can propose, where that is fewer than the target's vocabulary."""
    return None  # the target's whole vocabulary

# ---- training objective -----------------------------------------------------------------------------

class Objective(objective.Objective):
    def forward(self, batch: dict, generator: torch.Generator | None = None) -> dict:
        """q at every trained position; p from the cached top-k, else from lm_head(hidden_last)."""
        ids, parts = batch["input_ids"], self.parts
        logits = self.head(input_ids=ids, attention_mask=batch["attention_mask"]).logits
        kept = torch.zeros_like(ids, dtype=torch.bool)
        kept[:, :-1] = counted(batch)[:, 1:]  # logits at j predict token j+1
        out = {"q_logits": logits[kept]}
        if "topk_logprobs" in batch:
            for key in ("topk_logprobs", "topk_ids", "tail_mass"):
                out[key] = batch[key][kept]
        elif "hidden_last" in batch:
            with torch.no_grad():
                out["p_logits"] = target_logits_from_hidden(
                    parts.config, parts.lm_head, batch["hidden_last"][kept].to(parts.lm_head.weight.dtype))
        else:
            raise SpecdistillError("draft.kind draft_lm needs topk (or hidden_last) in the cache (cache.store)")
        return out


# ---- decoding -----------------------------------------------------------------------------------------

class DraftLMDrafter:
    """A small causal LM with the target's vocabulary and its own KV cache."""
    needs_features = False

    def __init__(self, model):
        self.model = model.eval().requires_grad_(False)
        self.cache = None

    def reset(self, capacity: int = 0) -> None:
        self.cache = new_cache(self.model.config)

    def propose(self, seq, n, new_features, k, temperature, generator):
        crop_cache(self.cache, n - 1)  # drop rejected drafts; accepted ones are committed tokens now
        cached = self.cache.get_seq_length()
        feed = seq[cached:n]  # committed tokens it has not seen yet, the pending one last
        tokens, qs = [], []
        for i in range(k):
            logits = self.model(feed[None], past_key_values=self.cache, use_cache=True).logits[0, -1]
            tok, q = pick(logits, temperature, generator)
            tokens.append(tok)
            qs.append(q)
            feed = tok.view(1)
        return stack_draws(tokens, qs, seq.device)


def drafter(model, target_model=None, static: bool = False) -> DraftLMDrafter:
    if target_model is not None:
        check_same_vocab(target_model, model)
    return DraftLMDrafter(model)


def prompt_logits(model, target_model, seq: torch.Tensor):
    """(p, q) logits [T, V] over `seq`: both read the same tokens."""
    return target_model(seq).logits[0], model(seq).logits[0]
