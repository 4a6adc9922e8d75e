"""The draft LM on disk: its checkpoint (a plain causal LM under HF names, LoRA merged in, the parts it shares
frozen with the target left out) and its export `hf` (an ordinary transformers model directory with the
target's tokenizer: vLLM's `"method": "draft_model"`, same vocabulary size as the target)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from specdistill import formats
from specdistill.errors import SpecdistillError
from specdistill.kinds.draft_lm.model import plain_model
from specdistill.target import load_target, load_tokenizer


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
                               "the base weights (specdistill/kinds/draft_lm/formats.py own_state_dict), this one does not")
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


def export(fmt: str, step_dir: Path, draft_cfg: dict, recipe, target_config, out: Path, k: int) -> None:
    """Write export format `fmt` (hf: a transformers model directory + the target's tokenizer) into `out`."""
    draft_vocab = draft_cfg["config"].get("vocab_size")
    if draft_vocab != target_config.vocab_size:
        raise SpecdistillError(f"{step_dir}/draft_config.json: draft vocab_size {draft_vocab} != target vocab_size "
                               f"{target_config.vocab_size}; vLLM's draft_model method needs the same vocabulary")
    target = load_target(recipe.target)
    config, state = formats.read_checkpoint(step_dir)
    model = load(config["config"], state, target)  # in the checkpoint's dtype
    model.save_pretrained(out)
    load_tokenizer(recipe.target).save_pretrained(out)
