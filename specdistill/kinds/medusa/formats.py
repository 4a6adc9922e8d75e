"""Medusa heads on disk: the checkpoint (draft_config.json's `config` + draft.safetensors under vLLM's names)
and the `vllm-medusa` export.

vllm-medusa: what vLLM's Medusa loader reads (vLLM <= 0.32: `vllm/model_executor/models/medusa.py`,
`vllm/transformers_utils/configs/medusa.py`; Medusa was removed in 0.33.0, docs/vllm-formats.md):
  config.json        model_type "medusa", architectures ["MedusaModel"], hidden_size H, vocab_size V,
                     num_heads K, num_hidden_layers L (MedusaConfig renames any key with "num"+"heads" /
                     "num"+"layers" to these), truncated_vocab_size V (no token_map), medusa_fc_bias false
  model.safetensors  blocks.{k}.layers.{l}.weight [H, H] and lm_heads.{k}.weight [V, H], nothing else
The proposer returns one token per head: `num_speculative_tokens` must be K.
"""
from __future__ import annotations

from pathlib import Path

import torch

from specdistill import formats
from specdistill.errors import SpecdistillError
from specdistill.kinds.common.weights import check_head_weights
from specdistill.kinds.medusa.model import MedusaConfig, MedusaHeads


def checkpoint_config(head: MedusaHeads) -> dict:
    return head.config.to_dict()


def own_state_dict(head: MedusaHeads) -> dict[str, torch.Tensor]:
    return head.own_state_dict()


def load(config: dict, state: dict[str, torch.Tensor], target_model) -> MedusaHeads:
    """A checkpoint's heads (they share nothing with the target: no binding)."""
    head = MedusaHeads(MedusaConfig(**config))
    head.load_own_state_dict(state)
    if target_model is not None and head.config.hidden_size != target_model.config.hidden_size:
        raise SpecdistillError(f"Medusa heads read states of width {head.config.hidden_size}, the target's "
                               f"hidden_size is {target_model.config.hidden_size}")
    return head


def vllm_medusa_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor vLLM's Medusa builds from config.json (no bias, no token_map)."""
    h, v = cfg["hidden_size"], cfg.get("truncated_vocab_size") or cfg["vocab_size"]
    shapes = {}
    for k in range(cfg["num_heads"]):
        for layer in range(cfg["num_hidden_layers"]):
            shapes[f"blocks.{k}.layers.{layer}.weight"] = (h, h)
        shapes[f"lm_heads.{k}.weight"] = (v, h)
    return shapes


def vllm_medusa_config(cfg: dict, dtype: torch.dtype) -> dict:
    return {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": cfg["hidden_size"],
            "vocab_size": cfg["vocab_size"], "truncated_vocab_size": cfg["vocab_size"],
            "num_heads": cfg["num_heads"], "num_hidden_layers": cfg["num_hidden_layers"],
            "medusa_fc_bias": False, "torch_dtype": str(dtype).removeprefix("torch.")}


def export(fmt: str, step_dir: Path, draft_cfg: dict, recipe, target_config, out: Path, k: int) -> None:
    """Write export format `fmt` (vllm-medusa) of checkpoint `step_dir` into the directory `out`; k: the serve
    command's num_speculative_tokens, which vLLM's Medusa proposer needs equal to the number of heads."""
    cfg, path = draft_cfg["config"], step_dir / "draft_config.json"
    for key, want in (("hidden_size", target_config.hidden_size), ("vocab_size", target_config.vocab_size)):
        if cfg.get(key) != want:
            raise SpecdistillError(f"{path}: config.{key} = {cfg.get(key)} but the target has {want}; "
                                   "these heads were not trained for this target")
    if k != cfg["num_heads"]:
        raise SpecdistillError(f"{path}: vLLM's Medusa proposes one token per head: set "
                               f"export.num_speculative_tokens: {cfg['num_heads']} (got {k})")
    weights = step_dir / "draft.safetensors"
    state = formats.read_safetensors(weights)
    check_head_weights(weights, state, vllm_medusa_shapes(cfg), what="vLLM's Medusa")
    dtype = next(iter(state.values())).dtype
    formats.write_export(out, vllm_medusa_config(cfg, dtype), state)
