"""`draft.kind: medusa` — Medusa-1 heads (Cai et al. 2024), everything about them in this package.

  config     config.py: the recipe section (num_heads, num_layers, head_decay)
  model      model.py: K heads, each residual blocks over the target's last hidden state then its own LM head
             (started from the target's); head k predicts token t+2+k
  cache      hidden_last (the final-norm state the target's LM head reads): the heads' input and, through the
             target's LM head at later positions, their target distributions
  objective  objective.py: the recipe's distribution loss per head against the target's p at t+1+k, weighted
             head_decay**k; offline metrics per head (top1_at, alpha_at, simulated_tau)
  drafter    drafter.py: a chain (one token per head from one state) or Medusa's tree of top-k per head
  formats    formats.py: the checkpoint and the vllm-medusa export (vLLM's `Medusa`, "method": "medusa")
"""
from __future__ import annotations

import torch

from specdistill.kinds.medusa.config import Config
from specdistill.kinds.medusa.drafter import MedusaDrafter
from specdistill.kinds.medusa.formats import VLLM_METHODS, checkpoint_config, load, own_state_dict, write_export
from specdistill.kinds.medusa.model import MedusaConfig, MedusaHeads
from specdistill.kinds.medusa.objective import Objective
from specdistill.target import check_same_vocab

NAME = "medusa"
LABEL = "Medusa"  # in messages and reports
STORE = ["hidden_last"]
DRAFTER_READS = "hidden_last"  # the cached target states its drafter reads (eval/chain_tau.py)
EXPORT_FORMATS = tuple(VLLM_METHODS)
DRAFTS_TREES = True
PROMPTS_FKL_NOTE = None  # the heads draft over the target's whole vocabulary: fkl on the prompts is defined

__all__ = ["NAME", "LABEL", "STORE", "DRAFTER_READS", "EXPORT_FORMATS", "DRAFTS_TREES", "PROMPTS_FKL_NOTE", "VLLM_METHODS", "Config",
           "Objective", "shapes", "build", "owns", "checkpoint_config", "own_state_dict", "load",
           "draft_vocabulary", "drafter", "prompt_logits", "write_export"]


def medusa_config(recipe, target_config) -> MedusaConfig:
    d = recipe.draft
    return MedusaConfig(hidden_size=target_config.hidden_size, vocab_size=target_config.vocab_size,
                        num_heads=d.num_heads, num_hidden_layers=d.num_layers, head_decay=d.head_decay)


def shapes(recipe, target_config) -> MedusaHeads:
    """The heads' shapes only, on the meta device (dry runs, memory estimates)."""
    with torch.device("meta"):
        return MedusaHeads(medusa_config(recipe, target_config))


def build(recipe, parts, data=None) -> MedusaHeads:
    """Fresh heads: identity blocks, every LM head a copy of the target's."""
    return MedusaHeads(medusa_config(recipe, parts.config)).init_lm_heads(parts.lm_head.weight)


def owns(module) -> bool:
    return isinstance(module, MedusaHeads)


def draft_vocabulary(head) -> torch.Tensor | None:
    return None  # the target's whole vocabulary


def drafter(head: MedusaHeads, target_model=None, static: bool = False) -> MedusaDrafter:
    """static: the target's runtime; the heads keep no cache, so it changes nothing here."""
    if target_model is not None:
        check_same_vocab(target_model, head)
    return MedusaDrafter(head)


def prompt_logits(head: MedusaHeads, target_model, seq: torch.Tensor):
    """(p, q) logits [T, V] over `seq`, teacher-forced: head 0 at row t reads f[t] and predicts token t+2 =
    target row t+1; row 0 has no draft prediction (zeros)."""
    out = target_model(seq, output_hidden_states=True)
    p_logits = out.logits[0]
    q = head.head_logits(out.hidden_states[-1][0, :-1], 0)
    return p_logits, torch.cat([torch.zeros_like(p_logits[:1]), q.to(p_logits.dtype)])
