"""`draft.kind: draft_lm`: what the recipe, the cache stage and the report know of a draft LM (torch-free)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from specdistill.kinds.common.config import LossConfig
from specdistill.section import Section

NAME = "draft_lm"
LABEL = "draft LM"  # in messages and reports
STORE = ["topk"]  # the target's top-k log-probs, so the draft's hidden size is free
DRAFTER_READS = None  # its drafter reads no target states (eval/chain_tau.py)
EXPORT_FORMATS = ("hf",)
VLLM_METHOD = {"hf": "draft_model"}  # export format -> vLLM's speculative-config "method"
DRAFTS_TREES = False
PROMPTS_FKL_NOTE = None


class LoraConfig(Section):
    r: int = Field(16, ge=1)
    alpha: int = Field(32, ge=1)
    dropout: float = 0.0
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


class Config(Section):
    kind: Literal["draft_lm"]
    init_from: str | None = Field(None, description="an existing small model (hub id or dir) with the target's vocabulary")
    num_layers: int = Field(2, ge=1)
    hidden_size: int | None = Field(None, description="default the target's")
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    copy_target_layers: bool = Field(True, description="initialise from the target's first layers when shapes fit")
    lora: LoraConfig | None = None


class Loss(LossConfig):
    """The distribution loss only: no key of its own."""
    kind: Literal["draft_lm"] = Field("draft_lm", exclude=True)  # the recipe's draft.kind (specdistill/recipe.py)
