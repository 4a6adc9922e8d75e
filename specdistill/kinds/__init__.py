"""Draft kinds: one module each (`eagle.py`, `eagle3.py`, `draft_lm.py`) owning everything about it.

Every kind module defines the same names, and the rest of the code asks the kind, never compares its name:

  NAME            the recipe's `draft.kind`
  Config          its recipe section (a member of the discriminated union `draft` in specdistill/recipe.py)
  STORE           what the cache stage stores for it by default (`cache.store`)
  EXPORT_FORMATS  the export formats it offers, the default first (train/export.py writes them)
  DRAFTS_TREES    whether eval/tree.py can draft trees with it
  build(recipe, parts, data)       a fresh head/model from the target's parts and the cached train split
  Objective(head, parts, loss)     the training objective DeepSpeed wraps: forward(batch, generator) ->
                                   predictions; `loss(pred)` -> (loss, components); `offline_metrics(batches)`
  checkpoint_config(head) / own_state_dict(head) / load(config, state, target_model)   the checkpoint
  draft_vocabulary(head)   the target ids it can propose when fewer than the target's (EAGLE-3), else None
  owns(module)    whether a loaded module is this kind's (the engine and the eval ask it)
  drafter(head, target_model, static)   what the decode loop calls to draft (eval/engine.py)
  prompt_logits(head, target_model, seq)   teacher-forced draft logits over the target's vocabulary

Adding a kind: its module here, its Config in the union of specdistill/recipe.py, a recipe.
"""
from __future__ import annotations

from pathlib import Path

from specdistill.errors import SpecdistillError
from specdistill.formats import read_checkpoint
from specdistill.kinds import draft_lm, eagle, eagle3

KINDS = {k.NAME: k for k in (eagle, eagle3, draft_lm)}  # draft_lm last: it owns any causal LM


def kind(name: str):
    """The kind module of a `draft.kind` name (as written in a recipe or a checkpoint)."""
    if name not in KINDS:
        raise SpecdistillError(f"draft.kind {name!r} is not implemented; implemented: {', '.join(KINDS)}")
    return KINDS[name]


def kind_of(module):
    """The kind module of a loaded draft: an EAGLE head of either kind, else a causal LM."""
    return next(k for k in KINDS.values() if k.owns(module))


def kind_of_format(fmt: str):
    """The kind that exports `fmt`."""
    for k in KINDS.values():
        if fmt in k.EXPORT_FORMATS:
            return k
    known = [f for k in KINDS.values() for f in k.EXPORT_FORMATS]
    raise SpecdistillError(f"--format {fmt!r}: expected one of {', '.join(known)}")


def load_draft(step_dir: Path, target_model):
    """A checkpoint's draft, bound to the loaded target's frozen parts, in eval mode, on the target's device
    and dtype: an EAGLE head of its kind, or a plain transformers causal LM."""
    config, state = read_checkpoint(step_dir)
    ref = target_model.get_input_embeddings().weight
    with ref.device:  # built where it runs: no host copy of the head on the way to a GPU
        draft = kind(config["kind"]).load(config["config"], state, target_model)
    return draft.to(device=ref.device, dtype=ref.dtype).eval().requires_grad_(False)
