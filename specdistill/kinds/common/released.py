"""Released heads read back (`draft.init_from` for eagle / eagle3): continue training a released head.

Accepted: a directory holding `config.json` + `*.safetensors` in vLLM's EAGLE layout (`vllm-eagle`:
fc.weight, layers.0.*), vLLM's EAGLE-3 layout (`vllm-eagle3`: fc, layers.0.* or midlayer.*, norm,
lm_head, d2t/t2d) or speculators' EAGLE-3 format (the same tensors, a config with
`speculators_model_type` and the layer config under `transformer_layer_config`) — so every head
`specdistill export` writes comes back. The head's decoder layer must be Llama-style (what vLLM
loads), sized for the target; names and shapes are checked against a fresh head of this target.

What a kind undoes on the way in of what its export does on the way out is the kind's (its formats.py
`warm_start`): a Gemma target's sqrt(H) folded into EAGLE-1's fc, EAGLE-3's aux-state scaling in fc.
"""
from __future__ import annotations

from pathlib import Path

import torch

from specdistill import formats
from specdistill.errors import SpecdistillError
from specdistill.kinds.common.weights import check_head_weights

IGNORED = ("embed_tokens.weight", "model.embed_tokens.weight", "verifier_lm_head.weight")


def read_released(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config dict, tensors with vLLM's plain names) of a released/exported head directory."""
    config, state = formats.read_released_head(path)
    state = {k.removeprefix("model.").replace("midlayer.", "layers.0."): v for k, v in state.items()
             if k not in IGNORED}
    return config, state


def layer_config(config: dict) -> dict:
    """The decoder layer's config: speculators nests it under transformer_layer_config."""
    return {**config.get("transformer_layer_config", {}), **{k: v for k, v in config.items()
                                                             if k != "transformer_layer_config"}}


def check_fits(path, config: dict, target_config, what: str) -> None:
    layer = layer_config(config)
    if layer.get("model_type", "llama") != "llama":
        raise SpecdistillError(f"draft.init_from {path}: the {what}'s layer is '{layer.get('model_type')}', "
                               f"expected a Llama-style layer (what vLLM loads)")
    for key in ("hidden_size", "vocab_size"):
        have, want = layer.get(key), getattr(target_config, key)
        if have is not None and have != want:
            raise SpecdistillError(f"draft.init_from {path}: {key} {have} but the target has {want}; "
                                   f"this {what} belongs to another target")


def load_state(path, head, state: dict[str, torch.Tensor], what: str) -> None:
    expected = {k: tuple(v.shape) for k, v in head.own_state_dict().items()}
    try:
        check_head_weights(Path(path), state, expected)
    except SpecdistillError as e:
        raise SpecdistillError(f"draft.init_from: {e}") from None
    with torch.no_grad():
        head.load_own_state_dict(state)  # copies into the head's tensors, in their dtype
