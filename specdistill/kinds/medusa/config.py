"""`draft.kind: medusa`: what the recipe, the cache stage and the report know of Medusa heads (torch-free)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from specdistill.kinds.common.config import LossConfig
from specdistill.section import Section

NAME = "medusa"
LABEL = "Medusa"  # in messages and reports
STORE = ["hidden_last"]
DRAFTER_READS = "hidden_last"  # the cached target states its drafter reads (eval/chain_tau.py)
EXPORT_FORMATS = ("vllm-medusa",)
VLLM_METHOD = {"vllm-medusa": "medusa"}  # export format -> vLLM's speculative-config "method"
DRAFTS_TREES = True
PROMPTS_FKL_NOTE = None  # the heads draft over the target's whole vocabulary: fkl on the prompts is defined


class Config(Section):
    kind: Literal["medusa"]
    num_heads: int = Field(4, ge=1, description="K heads on the target's last hidden state at position t; head k "
                           "predicts token t+2+k (the target itself gives t+1). vLLM proposes one token per head: "
                           "its num_speculative_tokens must be num_heads")
    num_layers: int = Field(1, ge=1, description="residual blocks x + SiLU(Linear(x)) per head (vLLM's "
                            "num_hidden_layers)")
    head_decay: float = Field(0.8, gt=0.0, le=1.0, description="head k's loss weighted head_decay**k (Medusa: 0.8)")


class Loss(LossConfig):
    """The distribution loss only (head k's weight is draft.head_decay, stored with the heads)."""
    kind: Literal["medusa"] = Field("medusa", exclude=True)  # the recipe's draft.kind (specdistill/recipe.py)
