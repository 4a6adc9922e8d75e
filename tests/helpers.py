"""Helpers only the tests use (not part of the pipeline)."""
from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file
from transformers import AutoConfig

from specdistill import kinds
from specdistill.eval.engine import SpeculativeDecoder
from specdistill.recipe import load_recipe
from specdistill.kinds.eagle.model import EagleHead
from specdistill.kinds.common.weights import check_head_weights
from specdistill.kinds.eagle.formats import check_config_fits
from specdistill.kinds.eagle.model import scale_embedding_half


# A tiny draft of any registry kind: these sizes, for the keys its `draft` section has (a kind added to the registry
# is a tiny draft here with no edit).
TINY_DRAFT = {"draft_vocab_size": 256, "ttt_steps": 2, "num_layers": 1, "num_heads": 2}


def draft_section(kind_name: str) -> str:
    """The recipe's `draft` section, in YAML flow style, of a tiny draft of `kind_name`."""
    fields = kinds.kind(kind_name).Config.model_fields
    sizes = "".join(f", {key}: {value}" for key, value in TINY_DRAFT.items() if key in fields)
    return f"{{kind: {kind_name}{sizes}}}"


def tiny_recipe(tmp_path: Path, target_dir: Path, eval_section: str = "{k: 3}"):
    """An EAGLE-1 run named `tiny` over the tiny target, as the eval and export tests use it."""
    recipe_file = tmp_path / "tiny.yaml"
    recipe_file.write_text(f"run_name: tiny\ntarget: {{path: {target_dir}}}\ncorpus: {{path: unused.jsonl}}\n"
                           f"draft: {{kind: eagle}}\ntrain: {{max_steps: 2, save_every: 1}}\neval: {eval_section}\n")
    return load_recipe(recipe_file)


def decode_baseline(target_model, prompt_ids, max_new_tokens, temperature=0.0, generator=None, eos_ids=()):
    """Plain autoregressive decoding through the engine (K = 0)."""
    return SpeculativeDecoder(target_model, None, 0, eos_ids).decode(prompt_ids, max_new_tokens, temperature, generator)


def load_vllm_eagle(export_dir: Path, target_model):
    """A vllm-eagle export read back: an EagleHead bound to the target's embedding and LM head."""
    export_dir = Path(export_dir)
    config = AutoConfig.from_pretrained(export_dir)
    check_config_fits(export_dir / "config.json", config.to_dict(), target_model.config)
    head = EagleHead(config)
    state = load_file(export_dir / "model.safetensors")
    check_head_weights(export_dir / "model.safetensors", state,
                        {k: tuple(v.shape) for k, v in head.own_state_dict().items()})
    state["fc.weight"] = scale_embedding_half(state["fc.weight"], target_model.config, fold=False)
    head.load_own_state_dict(state)
    head.bind_target(target_model.get_input_embeddings(), target_model.get_output_embeddings())
    return head.eval()
