"""EAGLE-3 on disk: its checkpoint (stored as every head is) and its exports, both written from one contract
(below, vLLM's own tensor names) and checked against vLLM's loader tables and, for speculators, the
speculators 0.9.0 library's own config and model classes (tests/test_export.py).

  vllm-eagle3  vLLM's `Eagle3LlamaForCausalLM` (`"method": "eagle3"`), plain layout.
  speculators  the same tensors with a speculators-format config.json (speculators_config, verifier).
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
from specdistill.kinds.eagle3.model import Eagle3Head, check_d2t, fc_norm_names
from specdistill.target import resolve_target


def load(config: dict, state: dict[str, torch.Tensor], target_model) -> Eagle3Head:
    cfg = dict(config)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    head = Eagle3Head(config, config.draft_vocab_size, config.eagle_aux_hidden_state_layer_ids,
                      getattr(config, "fc_norm", False))
    head.load_own_state_dict(state)
    return head.bind_target(target_model.get_input_embeddings())


# Contract for an eagle3 checkpoint (vLLM 0.33 llama_eagle3.py names; `midlayer.` is read as `layers.0.`):
#   draft_config.json config: the head's Llama config (num_hidden_layers 1, vocab_size = target V) plus
#     draft_vocab_size Vd, eagle_aux_hidden_state_layer_ids (hidden_states indices = vLLM's convention,
#     docs/DESIGN.md), norm_before_residual, optional target_hidden_size Ht, fc_norm (only when true).
#   draft.safetensors: fc.weight [H, A*Ht]; layers.0.self_attn.{q,k,v}_proj.weight [*, 2H], o_proj,
#     layers.0.mlp.*, layers.0.{input_layernorm,hidden_norm,post_attention_layernorm}.weight [H];
#     norm.weight [H]; lm_head.weight [Vd, H]; d2t int64 [Vd] when Vd < V (target id = i + d2t[i]);
#     t2d optional; with fc_norm, fc_norm.{i}.weight [Ht] per aux state (vLLM: model.fc_norm.{i}.weight).
#     No embed_tokens (vLLM shares the target's).
SPECULATORS_VERSION = "0.9.0"


def eagle3_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, i, nh, nkv = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // nh
    aux = len(cfg.get("eagle_aux_hidden_state_layer_ids") or [0, 0, 0])
    ht = cfg.get("target_hidden_size") or h
    vd = cfg.get("draft_vocab_size") or cfg["vocab_size"]
    layer = "layers.0."
    shapes = {"fc.weight": (h, aux * ht), "norm.weight": (h,), "lm_head.weight": (vd, h),
              layer + "self_attn.q_proj.weight": (nh * d, 2 * h), layer + "self_attn.k_proj.weight": (nkv * d, 2 * h),
              layer + "self_attn.v_proj.weight": (nkv * d, 2 * h), layer + "self_attn.o_proj.weight": (h, nh * d),
              layer + "mlp.gate_proj.weight": (i, h), layer + "mlp.up_proj.weight": (i, h),
              layer + "mlp.down_proj.weight": (h, i)}
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        shapes[layer + norm + ".weight"] = (h,)
    if vd != cfg["vocab_size"]:
        shapes["d2t"] = (vd,)
    if cfg.get("fc_norm"):
        shapes.update((name, (ht,)) for name in fc_norm_names(aux))
    return shapes


def eagle3_tensors(step_dir: Path, cfg: dict, target_config) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under vLLM's names, checked against the target; d2t/t2d as vLLM wants them."""
    weights = step_dir / "draft.safetensors"
    state = {k.replace("midlayer.", "layers.0."): v for k, v in formats.read_safetensors(weights).items()}
    t2d = state.pop("t2d", None)  # vLLM ignores it; rebuilt from d2t below
    aux_scale = state.pop("aux_scale", None)  # vLLM's fc reads the raw aux states: fold the scaling in
    if aux_scale is not None and "fc.weight" in state and not cfg.get("fc_norm"):  # fc_norm: never read (ones)
        state["fc.weight"] = (state["fc.weight"].float() * aux_scale.float()[None, :]).to(state["fc.weight"].dtype)
    vocab, vd = target_config.vocab_size, cfg.get("draft_vocab_size") or cfg["vocab_size"]
    if vd == vocab:
        state.pop("d2t", None)  # vLLM 0.33 has no draft_id_to_target_id then: a d2t would fail to load
    expected = eagle3_shapes(cfg)
    check_head_weights(weights, state, expected)
    if "d2t" not in state:
        return state
    state["d2t"] = state["d2t"].long()
    ids = check_d2t(weights, state["d2t"], vocab)
    mask = torch.zeros(vocab, dtype=torch.bool, device=ids.device)
    mask[ids] = True
    if t2d is not None and not torch.equal(t2d.bool(), mask):
        raise SpecdistillError(f"{weights}: t2d disagrees with d2t")
    state["t2d"] = mask  # kept for SGLang / EAGLE readers
    return state


def ascending_aux_layers(aux: list[int], fc: torch.Tensor, ht: int) -> tuple[list[int], torch.Tensor]:
    """(aux ids strictly ascending, fc with its column blocks to match): vLLM's target collects each aux
    state once, in layer order (llama.py `_maybe_add_hidden_state`), whatever order the ids are listed in.
    A head over ids like [2, 2, 1] (a target of 4 layers) would meet 2 states in the other order there: its
    blocks are put in layer order, and the blocks of a repeated id summed (W1 h + W2 h = (W1 + W2) h)."""
    blocks = fc.float().split(ht, dim=1)
    merged: dict[int, torch.Tensor] = {}
    for layer_id, block in zip(aux, blocks):
        merged[layer_id] = merged[layer_id] + block if layer_id in merged else block
    ids = sorted(merged)
    return ids, torch.cat([merged[i] for i in ids], dim=1).to(fc.dtype)


def fold_repeated_fc_norms(aux: list[int], state: dict[str, torch.Tensor], ht: int) -> None:
    """fc_norm's weights in the order `ascending_aux_layers` gives fc's blocks, before it sums a repeated id's
    blocks: vLLM norms that state once, so each of its blocks takes its own norm's weight first
    (W1 diag(w1) r + W2 diag(w2) r, r the normed state) and the one norm left for it is ones."""
    norms = [state.pop(name) for name in fc_norm_names(len(aux))]
    blocks = list(state["fc.weight"].split(ht, dim=1))
    for i, layer_id in enumerate(aux):
        if aux.count(layer_id) > 1:
            blocks[i] = (blocks[i].float() * norms[i].float()[None, :]).to(blocks[i].dtype)
            norms[i] = torch.ones_like(norms[i])
    state["fc.weight"] = torch.cat(blocks, dim=1)
    ids = sorted(set(aux))
    state.update(zip(fc_norm_names(len(ids)), (norms[aux.index(layer_id)] for layer_id in ids)))


def eagle3_layer_config(cfg: dict, target_config, dtype: torch.dtype) -> dict:
    """The head's Llama config as vLLM reads it: target's rope/eps, one layer, no tied head."""
    base = vllm_layer_config(target_config, dtype)  # same Llama-only rule and rope handling as EAGLE-1
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
        if cfg.get(key) is not None:
            base[key] = cfg[key]
    base.pop("bias", None)
    return base


def export(fmt: str, step_dir: Path, draft_cfg: dict, recipe, target_config, out: Path, k: int) -> None:
    """Write export format `fmt` (vllm-eagle3 or speculators) of checkpoint `step_dir` into the directory `out`."""
    cfg = draft_cfg["config"]
    path = step_dir / "draft_config.json"
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads"):
        if key not in cfg:
            raise SpecdistillError(f"{path}: config has no {key}")
    if cfg["vocab_size"] != target_config.vocab_size:
        raise SpecdistillError(f"{path}: config.vocab_size = {cfg['vocab_size']} but the target has "
                               f"{target_config.vocab_size}; this head was not trained for this target")
    ht = cfg.get("target_hidden_size") or cfg["hidden_size"]
    if ht != target_config.hidden_size:
        raise SpecdistillError(f"{path}: the head reads target states of width {ht}, the target's hidden_size "
                               f"is {target_config.hidden_size}")
    aux = cfg.get("eagle_aux_hidden_state_layer_ids")
    if aux and not all(0 <= a <= target_config.num_hidden_layers for a in aux):
        raise SpecdistillError(f"{path}: eagle_aux_hidden_state_layer_ids {aux} outside the target's "
                               f"0..{target_config.num_hidden_layers}")
    state = eagle3_tensors(step_dir, cfg, target_config)
    fc_norm = bool(cfg.get("fc_norm"))
    if aux:
        if fc_norm:
            fold_repeated_fc_norms(aux, state, ht)
        aux, state["fc.weight"] = ascending_aux_layers(aux, state["fc.weight"], ht)
    dtype = state["fc.weight"].dtype
    layer = eagle3_layer_config(cfg, target_config, dtype)
    vd = cfg.get("draft_vocab_size") or cfg["vocab_size"]
    head = dict(draft_vocab_size=vd, target_hidden_size=ht,
                norm_before_residual=bool(cfg.get("norm_before_residual", False)))  # explicit: defaults differ
    if fmt == "vllm-eagle3":
        config = {**layer, **head}
        if fc_norm:  # vLLM reads it from the config's top level (llama_eagle3.py); absent = off
            config["fc_norm"] = True
        if aux:  # top level for the runner, in eagle_config for the fc width (vLLM reads both places)
            config["eagle_aux_hidden_state_layer_ids"] = list(aux)
        config["eagle_config"] = {"use_aux_hidden_state": True, **({"eagle_aux_hidden_state_layer_ids": list(aux)} if aux else {})}
    else:
        config = speculators_config(recipe, target_config, layer, head, aux, dtype, k, fc_norm)
    formats.write_export(out, config, state)


def speculators_config(recipe, target_config, layer: dict, head: dict, aux, dtype, k: int, fc_norm: bool) -> dict:
    """speculators' Eagle3SpeculatorConfig as saved: no top-level model_type, the layer config nested."""
    layer = {k: v for k, v in layer.items() if k not in ("architectures", "torch_dtype", "use_cache")}
    if aux and len(aux) != 3:  # vLLM's speculators path reads the fc width from here only (else 3 states)
        layer["num_aux_hidden_states"] = len(aux)
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        **head,
        "norm_before_fc": False, "fc_norm": fc_norm, "norm_output": False,  # vLLM's algos.update_eagle3 copies them
        "eagle_aux_hidden_state_layer_ids": list(aux) if aux else None,
        "embed_requires_grad": False,
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": resolve_target(recipe.target),
                         "architectures": list(target_config.architectures or [])},
        },
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
