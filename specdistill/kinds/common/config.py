"""Recipe sections every draft kind builds its own on (torch-free: the recipe loads without torch).

A kind's `config.py` defines `Config` (the recipe's `draft` section, discriminated by `kind`) and `Loss`
(the recipe's `loss` section for that kind: `LossConfig` plus the kind's own keys), so a key one kind
reads is refused in another kind's recipe (`loss.ttt_decay` in a draft-LM recipe is an unknown key).
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from specdistill.metrics import NAMES
from specdistill.section import Section


class LossConfig(Section):
    """The distribution loss every kind trains with (specdistill/objective/losses.py)."""
    terms: dict[Literal[NAMES], float] = Field(default_factory=lambda: {"fkl": 1.0})
    temperature: float = Field(1.0, gt=0.0)
    jsd_beta: float = Field(0.5, ge=0.0, le=1.0)
    acceptance_weight: float = Field(0.0, ge=0.0, le=1.0, description="hybrid objective: the loss becomes "
                                     "(1 - w) * terms + w * tvd (1 - the T=1 acceptance), w ramped linearly from 0 "
                                     "to this over the first acceptance_ramp of training (KL first); 0: off")
    acceptance_ramp: float = Field(1.0, gt=0.0, le=1.0, description="share of train.max_steps over which the "
                                   "acceptance weight ramps up")


class HeadConfig(Section):
    """The draft keys of heads over the target's states with a Llama-style layer (EAGLE-1, EAGLE-3)."""
    init_from: str | None = Field(None, description="a released head to continue training (a vllm-eagle, "
                                  "vllm-eagle3 or speculators dir; kinds/common/released.py)")
    init_layer_from_target: bool = Field(True, description="start the head's (Llama-style) decoder layer from "
                                         "the target's last layer where shapes fit (o_proj, MLP, norms)")


class HeadLoss(LossConfig):
    """The loss keys of heads trained on the target's own features (EAGLE-1, EAGLE-3)."""
    feature_noise: float = Field(0.2, ge=0.0, description="uniform noise half-width on the head's input "
                                 "features, in units of their std (EAGLE's)")
