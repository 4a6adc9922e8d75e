"""What DeepSpeed wraps: a draft kind's training objective around its head (specdistill/kinds/).

An objective's forward takes a collated batch (data/cache_reader.py) and returns what the losses compare
at the counted positions only: q_logits [M, V] and either p_logits [M, V] (full vocabulary) or
topk_logprobs/topk_ids/tail_mass (a cached top-k); a kind adds what its own loss needs. With a
`generator` it is a training forward (the kind's input noise and sampling on); without one it is the
teacher-forced prediction the offline metrics measure. The head keeps its inference-time forward.
"""
from __future__ import annotations

import torch
from torch import nn

from specdistill.objective import losses
from specdistill.objective.offline_metrics import first_draft_metrics


def counted(batch: dict, key: str = "loss_mask") -> torch.Tensor:
    """Trained (or otherwise marked) positions that are real tokens, not padding."""
    return batch[key].bool() & batch["attention_mask"].bool()


class BaseObjective(nn.Module):
    """The base: the head as its one submodule (what DeepSpeed trains and saves); the target's frozen
    parts and the loss settings as plain attributes. The default loss is the distribution loss."""

    progress: float = 0.0  # share of training done, set by the loop before each step (the hybrid objective's ramp)
    replay_weight: float = 0.0  # > 0: the loss weights Draft-OPD's replay (train/replay.py; EAGLE-3's chain_hits)

    def __init__(self, head: nn.Module, parts, loss_cfg, data=None):
        """data: the cached train split, for what a kind measures on it once (EAGLE-1's noise scale)."""
        super().__init__()
        self.head = head
        self.parts = parts
        self.loss_cfg = loss_cfg

    # The objective adds no parameters of its own: its state is the head's, under the head's names, so that
    # DeepSpeed's state (ds/) holds what it held when it wrapped the head, and older runs resume.
    def state_dict(self, *args, **kwargs):
        return self.head.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.head.load_state_dict(state_dict, strict=strict, assign=assign)

    def recorded(self) -> dict:
        """What the kind measured on the data and records in draft_config.json beside the draft's own config."""
        return {}

    def loss(self, pred: dict):
        """(loss, {component: value}) for one micro batch."""
        log_p, log_q = losses.distribution_logprobs(pred, self.loss_cfg.temperature)
        return self.distribution_loss(log_p, log_q)

    def distribution_loss(self, log_p, log_q, weights=None):
        """loss.terms (weighted mean over positions: `weights`, default 1); with loss.acceptance_weight, blended
        toward tvd as training progresses (the hybrid objective; losses.acceptance_weight)."""
        cfg = self.loss_cfg
        loss, parts = losses.mixed_loss(log_p, log_q, dict(cfg.terms), cfg.jsd_beta, weights)
        if cfg.acceptance_weight > 0:
            w = losses.acceptance_weight(cfg.acceptance_weight, cfg.acceptance_ramp, self.progress)
            acceptance, acc_parts = losses.mixed_loss(log_p, log_q, {"tvd": 1.0}, cfg.jsd_beta, weights)
            loss = (1 - w) * loss + w * acceptance
            parts = {**parts, "tvd": acc_parts["tvd"], "acceptance_weight": torch.tensor(w, device=loss.device)}
        return loss, parts

    @torch.no_grad()
    def offline_metrics(self, batches) -> dict:
        return first_draft_metrics(self, batches)
