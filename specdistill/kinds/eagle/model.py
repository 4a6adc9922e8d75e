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

import torch
from torch import nn
from transformers import AutoModel

from specdistill.errors import SpecdistillError
from specdistill.kinds.common.llama_layer import init_layer_from_target, llama_layer_config, require_same_names
from specdistill.kinds.common.released import check_fits, load_state, read_released
from specdistill.target import target_logits_from_hidden


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


def shapes(recipe, target_config) -> EagleHead:
    """The head's shapes only, on the meta device (dry runs, memory estimates)."""
    with torch.device("meta"):
        return EagleHead(target_config)


def build(recipe, parts, data=None) -> EagleHead:
    """A fresh head bound to the target's frozen embedding and LM head; warm-started from draft.init_from."""
    head = EagleHead(parts.config)
    if recipe.draft.init_from:
        warm_start(recipe.draft.init_from, head, parts.config)
    elif recipe.draft.init_layer_from_target and parts.where is not None:
        init_layer_from_target(head.body.layers[0], parts.where, parts.config)
    return head.bind_target(parts.embed, parts.lm_head)


def owns(module) -> bool:
    return isinstance(module, EagleHead)


def draft_vocabulary(head) -> torch.Tensor | None:
    """The target ids the draft can propose, where that is fewer than the target's vocabulary."""
    return None  # the target's whole vocabulary


def tiny_draft(target_model, k: int = 3) -> EagleHead:
    """A randomly initialised head bound to a (tiny) loaded target, seeded: the kind's case in the per-kind tests."""
    torch.manual_seed(7)
    return EagleHead(target_model.config).bind_target(target_model.get_input_embeddings(),
                                                      target_model.get_output_embeddings()).eval()


# ---- the head's weights in vLLM's terms (export folds, warm start unfolds) ----------------------------

def scale_embedding_half(fc: torch.Tensor, target_config, fold: bool) -> torch.Tensor:
    """Gemma scales its embeddings by sqrt(H) inside its model, not in the embedding table that vLLM shares
    with the head; our EAGLE-1 fc was trained on the scaled embeddings, so the export folds sqrt(H) into the
    embedding half of fc.weight (fold=False undoes it). Other targets: unchanged."""
    if not target_config.model_type.startswith("gemma"):
        return fc
    h = target_config.hidden_size
    scale = torch.tensor(h ** 0.5, dtype=fc.dtype, device=fc.device).float()
    out = fc.float().clone()
    out[:, :h] = out[:, :h] * scale if fold else out[:, :h] / scale
    return out.to(fc.dtype)


def warm_start(path, head: EagleHead, target_config) -> None:
    """Continue training a released vllm-eagle head (`draft.init_from`): what export folded undone."""
    config, state = read_released(path)
    check_fits(path, config, target_config, "EAGLE head")
    if "fc.bias" in state:
        raise SpecdistillError(f"draft.init_from {path}: the head has an fc.bias; the heads trained here (and vLLM's "
                               f"EagleLlamaForCausalLM with bias: false) have none")
    if "fc.weight" in state:
        state["fc.weight"] = scale_embedding_half(state["fc.weight"], target_config, fold=False)
    load_state(path, head, state, "EAGLE head")
