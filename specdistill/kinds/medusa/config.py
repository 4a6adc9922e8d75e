"""`draft.kind: medusa` — the recipe section (pydantic only: importable without torch)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from specdistill.section import Section


class Config(Section):
    kind: Literal["medusa"]
    num_heads: int = Field(4, ge=1, description="K heads on the target's last hidden state at position t; head k "
                           "predicts token t+2+k (the target itself gives t+1). vLLM proposes one token per head: "
                           "its num_speculative_tokens must be num_heads")
    num_layers: int = Field(1, ge=1, description="residual blocks x + SiLU(Linear(x)) per head (vLLM's "
                            "num_hidden_layers)")
    head_decay: float = Field(0.8, gt=0.0, le=1.0, description="head k's loss weighted head_decay**k (Medusa: 0.8)")
