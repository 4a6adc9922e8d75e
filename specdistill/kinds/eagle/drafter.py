"""EAGLE-1 drafting: position t reads (token t+1, the target's final state f[t]) and predicts f[t+1];
K tokens are drafted on the head's own predicted features (kinds/common/heads.py `HeadDrafter`)."""
from __future__ import annotations

import torch

from specdistill.kinds.common.heads import HeadDrafter
from specdistill.kinds.eagle.model import EagleHead
from specdistill.kinds.eagle.objective import teacher_forced
from specdistill.target import check_same_vocab


class EagleDrafter(HeadDrafter):
    """EAGLE-1 head: reads the target's final state and drafts over the target's own vocabulary."""


def drafter(head: EagleHead, target_model=None, static: bool = False) -> EagleDrafter:
    if target_model is not None:
        check_same_vocab(target_model, head)
    return EagleDrafter(head)


def prompt_logits(head: EagleHead, target_model, seq: torch.Tensor):
    """(p, q) logits [T, V] over `seq`, teacher-forced: head row t reads (token t+1, f[t]) and predicts token
    t+2 = target row t+1; row 0 has no draft prediction (zeros)."""
    out = target_model(seq, output_hidden_states=True)
    p_logits = out.logits[0]
    q = head.logits(teacher_forced(head, seq, out.hidden_states[-1][:, :-1])[0])
    return p_logits, torch.cat([torch.zeros_like(p_logits[:1]), q.to(p_logits.dtype)])
