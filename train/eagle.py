"""EAGLE-1 draft head (Li et al. 2024), in the layout vLLM's EagleLlamaForCausalLM loads.

    f_hat[t+1] = layer( fc( cat(embed(x[t+1]), f[t]) ) )        logits = lm_head(f_hat)

`f` is the target's last hidden state after its final norm (transformers' `hidden_states[-1]`),
the state the target's LM head reads, so the head needs no final norm of its own. The decoder
layer is a Llama layer for any target (`llama_layer_config`: the target's sizes, rope and eps; for a
Llama target exactly its config cut to one layer), with the first input norm skipped, as in EAGLE's
research code and vLLM, which loads it with EagleLlamaForCausalLM beside any verifier. Embedding and
LM head are the target's, frozen and shared. Own weights are named `fc.weight`, `layers.0.*` —
exactly vLLM's names, so the export is a rename of nothing.
"""
from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import AutoModel, LlamaConfig

from specdistill.target import read_target_tensors, target_logits_from_hidden


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


class EagleHead(nn.Module):
    def __init__(self, target_config):
        super().__init__()
        cfg = llama_layer_config(target_config)
        if getattr(target_config, "final_logit_softcapping", None):  # Gemma-2 caps what its LM head outputs
            cfg.final_logit_softcapping = target_config.final_logit_softcapping
        self.config = cfg
        hidden = cfg.hidden_size
        body = AutoModel.from_config(cfg)
        body.layers[0].input_layernorm = nn.Identity()  # EAGLE skips the first input norm
        body.norm = nn.Identity()  # the output is h + residual, read by the target's LM head
        body.embed_tokens = nn.Identity()  # the target's embedding is used instead (see bind_target)
        self.body = body
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.embed_tokens: nn.Embedding | None = None  # the target's, bound by bind_target
        self.lm_head: nn.Linear | None = None

    def bind_target(self, embed_tokens: nn.Embedding, lm_head: nn.Linear) -> "EagleHead":
        """Share the target's frozen embedding and LM head (not registered as own parameters)."""
        object.__setattr__(self, "embed_tokens", embed_tokens)
        object.__setattr__(self, "lm_head", lm_head)
        return self

    def forward(self, input_ids, features, position_ids=None, past_key_values=None, attention_mask=None):
        """input_ids[:, t] = x[t+1], features[:, t] = f[t]  ->  predicted f[t+1], shape [B, T, H]."""
        with torch.no_grad():
            emb = self.embed_tokens(input_ids)
        x = self.fc(torch.cat([emb.to(features.dtype), features], dim=-1))
        out = self.body(inputs_embeds=x, position_ids=position_ids, past_key_values=past_key_values,
                        attention_mask=attention_mask, use_cache=past_key_values is not None)
        return out.last_hidden_state

    def logits(self, features):
        """The target's LM head over the predicted feature, with the target's logit post-processing (Gemma-2's
        final softcap), as the target reads its own features."""
        return target_logits_from_hidden(self.config, self.lm_head, features)

    def own_state_dict(self) -> dict[str, torch.Tensor]:
        """Trainable weights under vLLM's names: fc.weight, layers.0.* (no embed, no lm_head, no norm)."""
        state = {"fc.weight": self.fc.weight}
        for name, tensor in self.body.state_dict().items():
            if name.startswith("layers."):
                state[name] = tensor
        return {k: v.detach().contiguous() for k, v in state.items()}

    def load_own_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        require_same_names(set(self.own_state_dict()), state, "EAGLE head")
        self.fc.weight.data.copy_(state["fc.weight"])
        body = {k: v for k, v in state.items() if k != "fc.weight"}
        self.body.load_state_dict(body, strict=False)
