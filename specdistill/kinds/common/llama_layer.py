"""The Llama-style decoder layer of EAGLE heads (EAGLE-1, EAGLE-3), for any target: its config, its start
from the target's last layer, and its config.json as vLLM reads it.

vLLM loads EAGLE heads as Eagle(3)LlamaForCausalLM beside any verifier, so the head's layer is a Llama
layer whatever the target: a Llama target's own config cut to one layer, any other target a LlamaConfig
with its sizes, rope and eps (`llama_layer_config`).
"""
from __future__ import annotations

import copy
import json

import torch
from torch import nn
from transformers import LlamaConfig, PretrainedConfig

from specdistill.target import read_target_tensors


def require_same_names(expected: set[str], state: dict, what: str) -> None:
    """A checkpoint must hold exactly the head's own tensors: a missing one would load as garbage."""
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ValueError(f"{what} weights do not match: missing {missing}, unexpected {extra}")


def one_layer_config(target_config, num_layers: int = 1):
    cfg = copy.deepcopy(target_config)
    cfg.num_hidden_layers = num_layers
    if getattr(cfg, "layer_types", None):  # Qwen/Gemma: per-layer attention kinds
        cfg.layer_types = list(cfg.layer_types[:num_layers])
    cfg.use_cache = True
    return cfg


# Target config keys a Llama draft layer takes over as they are.
LLAMA_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "head_dim", "max_position_embeddings", "rms_norm_eps", "bos_token_id", "eos_token_id",
              "pad_token_id", "tie_word_embeddings")


def llama_layer_config(target_config, num_layers: int = 1):
    """The config of the head's decoder layer: Llama-style for any target (what vLLM's Eagle(3)Llama loads).

    A Llama target's own config cut to one layer (unchanged names and shapes); for any other target a
    LlamaConfig with its sizes, head_dim, eps and rope (the full-attention rope of a Gemma-3), and
    silu (vLLM's Llama MLP has no other activation), no attention/MLP bias, no q/k norms.
    """
    if target_config.model_type == "llama":
        return one_layer_config(target_config, num_layers)
    kwargs = {k: getattr(target_config, k) for k in LLAMA_KEYS if getattr(target_config, k, None) is not None}
    rope = dict(getattr(target_config, "rope_parameters", None) or {})
    if rope and all(isinstance(v, dict) for v in rope.values()):  # per layer type (Gemma-3)
        rope = dict(rope.get("full_attention") or next(iter(rope.values())))
    if not rope and getattr(target_config, "rope_theta", None) is not None:
        rope = {"rope_type": "default", "rope_theta": target_config.rope_theta}
    if rope:
        kwargs["rope_parameters"] = rope
    cfg = LlamaConfig(**kwargs, num_hidden_layers=num_layers, hidden_act="silu", attention_bias=False,
                      mlp_bias=False, use_cache=True)
    cfg.target_model_type = target_config.model_type  # what the layer was adapted from (informational)
    return cfg


# Target layer tensor -> the Llama head layer's, per target family (norms of Gemma store w - 1).
LAYER_MAP = {
    "default": {n: n for n in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight")},
    "gemma": {"self_attn.q_proj.weight": "self_attn.q_proj.weight", "self_attn.k_proj.weight": "self_attn.k_proj.weight",
              "self_attn.v_proj.weight": "self_attn.v_proj.weight", "self_attn.o_proj.weight": "self_attn.o_proj.weight",
              "mlp.gate_proj.weight": "mlp.gate_proj.weight", "mlp.up_proj.weight": "mlp.up_proj.weight",
              "mlp.down_proj.weight": "mlp.down_proj.weight", "input_layernorm.weight": "input_layernorm.weight",
              "pre_feedforward_layernorm.weight": "post_attention_layernorm.weight"},
}


def target_norm_weight(tensor: torch.Tensor, model_type: str) -> torch.Tensor:
    """A target RMSNorm weight as a Llama RMSNorm's: Gemma norms multiply by (1 + w)."""
    return tensor + 1.0 if model_type.startswith("gemma") else tensor


@torch.no_grad()
def init_layer_from_target(layer: nn.Module, target_dir, target_config, index: int | None = None) -> list[str]:
    """Copy the target's decoder layer `index` (default: the last) into the head's layer where names and
    shapes allow (EAGLE-3's 2H-wide q/k/v never do; Qwen3's q/k norms have no place). Returns the copied names."""
    index = target_config.num_hidden_layers - 1 if index is None else index
    family = "gemma" if target_config.model_type.startswith("gemma") else "default"
    prefix = f"model.layers.{index}."
    source = read_target_tensors(target_dir, [prefix + n for n in LAYER_MAP[family]])
    own = layer.state_dict()
    copied = []
    for theirs, ours in LAYER_MAP[family].items():
        t = source.get(prefix + theirs)
        if t is None or ours not in own or own[ours].shape != t.shape:
            continue
        if ours.endswith("layernorm.weight"):
            t = target_norm_weight(t.float(), target_config.model_type)
        own[ours].copy_(t.to(own[ours].dtype))
        copied.append(ours)
    return copied




# Config keys of the target that make no sense in a one-layer head's config.json.
DROPPED_CONFIG_KEYS = ("_name_or_path", "_model_name_or_path", "transformers_version", "dtype",
                       "pretraining_tp", "quantization_config", "auto_map", "target_model_type")


def vllm_layer_config(target_config, dtype: torch.dtype) -> dict:
    """config.json of vLLM's EAGLE heads: the head's Llama layer config (`llama_layer_config`: a Llama target's
    own config cut to one layer, or a Llama config with any other target's sizes)."""
    cfg = llama_layer_config(target_config).to_dict()
    generic = PretrainedConfig().to_dict()  # output_attentions, id2label, ...: noise in a head's config
    cfg = {k: v for k, v in cfg.items()
           if k not in DROPPED_CONFIG_KEYS and not (k in generic and json.dumps(v) == json.dumps(generic[k]))}
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1,
               tie_word_embeddings=False,  # the head has no LM head of its own; vLLM uses the target's
               use_cache=True, torch_dtype=str(dtype).removeprefix("torch."),
               bias=False)  # EAGLE research key (fc bias off); vLLM's Llama layer reads `bias` as attention bias
    if cfg.get("layer_types"):
        cfg["layer_types"] = cfg["layer_types"][:1]
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" in rope:  # also top level, for readers that predate transformers 5's rope_parameters
        cfg["rope_theta"] = rope["rope_theta"]
    return cfg
