"""EAGLE-1 draft head (Li et al. 2024), in the layout vLLM's EagleLlamaForCausalLM loads.

    f_hat[t+1] = layer( fc( cat(embed(x[t+1]), f[t]) ) )        logits = lm_head(f_hat)

`f` is the target's last hidden state after its final norm (transformers' `hidden_states[-1]`),
the state the target's LM head reads, so the head needs no final norm of its own. The decoder
layer is the target's own architecture (built from its config with one layer) with the first input
norm skipped, as in EAGLE's research code and vLLM. Embedding and LM head are the target's, frozen
and shared. Own weights are named `fc.weight`, `layers.0.*` — exactly vLLM's names, so the export
is a rename of nothing.
"""
from __future__ import annotations

import copy

import torch
from torch import nn


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


class EagleHead(nn.Module):
    kind = "eagle"

    def __init__(self, target_config):
        super().__init__()
        from transformers import AutoModel

        cfg = one_layer_config(target_config)
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
        return self.lm_head(features)

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
