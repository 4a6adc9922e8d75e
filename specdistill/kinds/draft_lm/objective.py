"""The draft LM's training objective: the distribution loss at every trained position (logits at j predict
token j+1), against the cached top-k or, without one, the target's full distribution from hidden_last."""
from __future__ import annotations

import torch

from specdistill.errors import SpecdistillError
from specdistill.target import target_logits_from_hidden
from specdistill.objective.base import BaseObjective, counted


class Objective(BaseObjective):
    def forward(self, batch: dict, generator: torch.Generator | None = None) -> dict:
        """q at every trained position; p from the cached top-k, else from lm_head(hidden_last)."""
        ids, parts = batch["input_ids"], self.parts
        logits = self.head(input_ids=ids, attention_mask=batch["attention_mask"]).logits
        kept = torch.zeros_like(ids, dtype=torch.bool)
        kept[:, :-1] = counted(batch)[:, 1:]  # logits at j predict token j+1
        out = {"q_logits": logits[kept]}
        if "topk_logprobs" in batch:
            for key in ("topk_logprobs", "topk_ids", "tail_mass"):
                out[key] = batch[key][kept]
        elif "hidden_last" in batch:
            with torch.no_grad():
                out["p_logits"] = target_logits_from_hidden(
                    parts.config, parts.lm_head, batch["hidden_last"][kept].to(parts.lm_head.weight.dtype))
        else:
            raise SpecdistillError("draft.kind draft_lm needs topk (or hidden_last) in the cache (cache.store)")
        return out
