"""Warm start (`draft.init_from` for eagle / eagle3): continue training a released head.

Accepted: a directory holding `config.json` + `*.safetensors` in vLLM's EAGLE layout (`vllm-eagle`:
fc.weight, layers.0.*), vLLM's EAGLE-3 layout (`vllm-eagle3`: fc, layers.0.* or midlayer.*, norm,
lm_head, d2t/t2d) or speculators' EAGLE-3 format (the same tensors, a config with
`speculators_model_type` and the layer config under `transformer_layer_config`) — so every head
`specdistill export` writes comes back. The head's decoder layer must be Llama-style (what vLLM
loads), sized for the target; names and shapes are checked against a fresh head of this target.

Undone on the way in what export does on the way out: a Gemma target's sqrt(H) folded into EAGLE-1's
fc, and (EAGLE-3) the aux-state scaling folded into fc: the loaded fc reads raw aux states, so the
head is told to keep that function when the training loop sets its input scaling.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from specdistill import integrity
from specdistill.errors import SpecdistillError
from specdistill.train.export import check_d2t, check_eagle_weights, scale_embedding_half

IGNORED = ("embed_tokens.weight", "model.embed_tokens.weight", "verifier_lm_head.weight")


def read_released(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config dict, tensors with vLLM's plain names) of a released/exported head directory."""
    d = Path(path).expanduser()
    if not (d / "config.json").is_file():
        raise SpecdistillError(f"draft.init_from {path}: expected a directory with config.json and *.safetensors "
                               f"(a vllm-eagle, vllm-eagle3 or speculators head)")
    integrity.check_export(d, "draft.init_from: ")  # an export of ours carries SHA256SUMS: a corrupt one is refused
    config = json.loads((d / "config.json").read_text())
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise SpecdistillError(f"draft.init_from {path}: no .safetensors weight files")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
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
        check_eagle_weights(Path(path), state, expected)
    except SpecdistillError as e:
        raise SpecdistillError(f"draft.init_from: {e}") from None
    with torch.no_grad():
        head.load_own_state_dict(state)  # copies into the head's tensors, in their dtype


def warm_eagle(path, head, target_config) -> None:
    config, state = read_released(path)
    check_fits(path, config, target_config, "EAGLE head")
    if "fc.bias" in state:
        raise SpecdistillError(f"draft.init_from {path}: the head has an fc.bias; the heads trained here (and vLLM's "
                               f"EagleLlamaForCausalLM with bias: false) have none")
    if "fc.weight" in state:
        state["fc.weight"] = scale_embedding_half(state["fc.weight"], target_config, fold=False)
    load_state(path, head, state, "EAGLE head")


def released_eagle3_shape(path, target_config) -> tuple[int, list[int] | None]:
    """(draft vocabulary size, aux layer ids or None) of a released EAGLE-3 head, to build a head of its shape."""
    config, state = read_released(path)
    check_fits(path, config, target_config, "EAGLE-3 head")
    if config.get("norm_before_residual"):
        raise SpecdistillError(f"draft.init_from {path}: norm_before_residual is true; the heads trained here "
                               f"add the un-normed state as the residual (norm_before_residual: false)")
    vd = config.get("draft_vocab_size") or (state["lm_head.weight"].shape[0] if "lm_head.weight" in state else None)
    aux = config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    return int(vd or target_config.vocab_size), (list(aux) if aux else None)


def warm_eagle3(path, head, target_config) -> None:
    config, state = read_released(path)
    vocab = target_config.vocab_size
    vd = head.lm_head.weight.shape[0]
    d2t = state.pop("d2t", None)
    state.pop("t2d", None)
    if d2t is None:
        if vd != vocab:
            raise SpecdistillError(f"draft.init_from {path}: no d2t but a draft vocabulary of {vd} < {vocab}")
        d2t = torch.zeros(vd, dtype=torch.long, device=head.lm_head.weight.device)
    ids = check_d2t(Path(path), d2t.long(), vocab)
    state.pop("aux_scale", None)
    load_state(path, head, {**state, "d2t": d2t.long(), "t2d": head.t2d, "aux_scale": head.aux_scale}, "EAGLE-3 head")
    head.set_draft_vocab(ids)
    head.keep_fc_function = True  # fc reads raw aux states: set_aux_scale must not change what it computes
