"""`draft.kind: eagle`: what the recipe, the cache stage and the report know of EAGLE-1 (torch-free)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from specdistill.kinds.common.config import HeadConfig, HeadLoss

NAME = "eagle"
LABEL = "EAGLE-1"  # in messages and reports
STORE = ["hidden_last"]
DRAFTER_READS = "hidden_last"  # the cached target states its drafter reads (eval/chain_tau.py)
EXPORT_FORMATS = ("vllm-eagle",)
VLLM_METHOD = {"vllm-eagle": "eagle"}  # export format -> vLLM's speculative-config "method"
DRAFTS_TREES = True
PROMPTS_FKL_NOTE = None  # the head drafts over the target's whole vocabulary: fkl on the prompts is defined


class Config(HeadConfig):
    kind: Literal["eagle"]


class Loss(HeadLoss):
    kind: Literal["eagle"] = Field("eagle", exclude=True)  # the recipe's draft.kind (specdistill/recipe.py)
    feature_weight: float = Field(1.0, ge=0.0, description="weight of the Smooth-L1 feature regression (EAGLE's v_w)")
    distribution_weight: float = Field(0.1, ge=0.0, description="weight of the distribution loss (EAGLE's p_w)")
    distribution_sample: float = Field(1.0, gt=0.0, le=1.0, description="share of positions that pay for the "
                                       "full-vocabulary distribution loss")
