"""EAGLE-1 on disk: its checkpoint (draft_config.json + draft.safetensors under vLLM's names) and its export.

  vllm-eagle   vLLM's `EagleLlamaForCausalLM` (`"method": "eagle"`); names and shapes checked against vLLM
               0.33.0's `llama_eagle.py`, `configs/eagle.py` and `config/speculative.py`.
               config.json: the head's Llama layer config (a Llama target's own config; for any other
               target a Llama config with its sizes: kinds/common/llama_layer.py) with num_hidden_layers 1
               and architectures ["LlamaForCausalLM"] (vLLM's EAGLEConfig renames it to
               EagleLlamaForCausalLM for method eagle; the same file is what EAGLE's own released
               heads ship, it parses with plain transformers, and a serve command without "method"
               fails loudly as a draft_model with missing weights instead of running a wrong class).
               model.safetensors: exactly fc.weight [H,2H] and layers.0.* without input_layernorm;
               no fc.bias, norm, lm_head or embed_tokens (vLLM shares the target's). Gemma targets:
               vLLM shares the raw embedding table, Gemma scales it by sqrt(H) inside its model, so
               sqrt(H) is folded into fc's embedding half (model.py `scale_embedding_half`).
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig

from specdistill import formats
from specdistill.errors import SpecdistillError
from specdistill.kinds.common.heads import checkpoint_config, own_state_dict  # noqa: F401  (stored as heads are)
from specdistill.kinds.common.llama_layer import vllm_layer_config
from specdistill.kinds.common.weights import check_head_weights
from specdistill.kinds.eagle.model import EagleHead, scale_embedding_half


def load(config: dict, state: dict[str, torch.Tensor], target_model) -> EagleHead:
    cfg = dict(config)
    head = EagleHead(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    head.load_own_state_dict(state)
    return head.bind_target(target_model.get_input_embeddings(), target_model.get_output_embeddings())


def expected_shapes(target_config) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor the EAGLE-1 head of this target owns (built on the meta device)."""
    with torch.device("meta"):
        head = EagleHead(target_config)
    return {k: tuple(v.shape) for k, v in head.own_state_dict().items()}


def check_config_fits(path: Path, draft_config: dict, target_config) -> None:
    for key in ("hidden_size", "vocab_size", "intermediate_size", "num_attention_heads", "num_key_value_heads"):
        have, want = draft_config.get(key), getattr(target_config, key, None)
        if have is not None and want is not None and have != want:
            raise SpecdistillError(f"{path}: config.{key} = {have} but the target has {want}; "
                                   "this head was not trained for this target")


def export(fmt: str, step_dir: Path, draft_cfg: dict, recipe, target_config, out: Path, k: int) -> None:
    """Write export format `fmt` (vllm-eagle) of checkpoint `step_dir` into the directory `out`."""
    weights = step_dir / "draft.safetensors"
    check_config_fits(step_dir / "draft_config.json", draft_cfg["config"], target_config)
    state = formats.read_safetensors(weights)
    check_head_weights(weights, state, expected_shapes(target_config))
    state["fc.weight"] = scale_embedding_half(state["fc.weight"], target_config, fold=True)
    dtype = next(iter(state.values())).dtype
    formats.write_export(out, vllm_layer_config(target_config, dtype), state)
