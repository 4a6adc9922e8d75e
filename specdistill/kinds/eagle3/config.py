"""`draft.kind: eagle3`: what the recipe, the cache stage and the report know of EAGLE-3 (torch-free)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from specdistill.kinds.common.config import HeadConfig, HeadLoss

NAME = "eagle3"
LABEL = "EAGLE-3"  # in messages and reports
STORE = ["hidden_aux", "hidden_last"]
DRAFTER_READS = "hidden_aux"  # the cached target states its drafter reads (eval/chain_tau.py)
EXPORT_FORMATS = ("vllm-eagle3", "speculators")
VLLM_METHOD = {"vllm-eagle3": "eagle3", "speculators": "eagle3"}  # export format -> vLLM's "method"
DRAFTS_TREES = True
PROMPTS_FKL_NOTE = "EAGLE-3 reduced draft vocabulary: fkl undefined (q = 0 outside it); tvd and top1 exact"
DEFAULT_DRAFT_VOCAB = 32000


class Config(HeadConfig):
    """The keys of EAGLE-style heads (a released head to continue from, the layer's start) and EAGLE-3's."""
    kind: Literal["eagle3"]
    draft_vocab_size: int | None = Field(None, ge=16, description=f"default {DEFAULT_DRAFT_VOCAB} (at most the target's)")
    ttt_steps: int = Field(7, ge=1, description="training-time test: unroll steps")
    freeze_lm_head: bool = Field(False, description="keep the readout (the target's LM-head rows of the draft "
                                 "vocabulary, or draft.init_from's) as it starts: not trained")
    fc_norm: bool = Field(False, description="EAGLE 3.1 / speculators --fc-norm: a learned RMSNorm on each aux "
                          "state before fc (vLLM config key fc_norm); replaces the per-dimension aux scaling")


class Loss(HeadLoss):
    kind: Literal["eagle3"] = Field("eagle3", exclude=True)  # the recipe's draft.kind (specdistill/recipe.py)
    ttt_decay: float = Field(0.8, gt=0.0, le=1.0, description="weight decay**s of training-time-test unroll step s")
    ttt_wrong_weight: float = Field(1.0, ge=0.0, le=1.0, description="GRIFFIN-style: weight of an unrolled "
                                    "step's position whose previous step predicted the wrong token (its input was "
                                    "already off the target's path); 1: off")
    replay_weight: float = Field(0.0, ge=0.0, description="Draft-OPD (train/replay.py): before the first step, the "
                                 "head training starts from replays its T=0 chain of eval.k drafts along every train "
                                 "row as decoding would; the depths verification exposed (a rejected step's accepted "
                                 "depths and its first rejected one) count 1 + this in the loss. For a warm start "
                                 "(draft.init_from) on the target's own answers (cache.regenerate); 0: off")
