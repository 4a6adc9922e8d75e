"""Draft kinds: one package per kind (`eagle/`, `eagle3/`, `medusa/`, `draft_lm/`), the same files in each, owning
everything about it; what two kinds share is in `common/` (a kind never imports another kind).

  config.py     (torch-free) NAME (the recipe's `draft.kind`), LABEL (in messages and reports),
                Config (its `draft` section: a member of the union the recipe builds from KIND_NAMES),
                Loss (its `loss` section: common/config.py LossConfig + the kind's own keys),
                STORE (what the cache stage stores for it by default, `cache.store`),
                DRAFTER_READS (the cached target states its drafter reads: hidden_last, hidden_aux, or
                None; eval/chain_tau.py),
                EXPORT_FORMATS (the export formats it offers, the default first), VLLM_METHOD (format ->
                vLLM's speculative-config "method"), DRAFTS_TREES (whether eval/tree.py can draft trees
                with it), PROMPTS_FKL_NOTE (why fkl on the eval prompts is undefined, or None)
  model.py      build(recipe, parts, data)   a fresh draft from the target's parts and the cached train split
                shapes(recipe, target_config)   the same on the meta device
                owns(module)   whether a loaded module is this kind's (the engine and the eval ask it)
                draft_vocabulary(draft)   the target ids it can propose when fewer than the target's, else None
                tiny_draft(target_model, k)   a small seeded random draft: the kind's case in the per-kind tests
  objective.py  Objective(head, parts, loss, data)   what DeepSpeed wraps: forward(batch, generator) ->
                predictions; `loss(pred)` -> (loss, components); `offline_metrics(batches)`
  drafter.py    drafter(draft, target_model, static)   what the decode loop calls to draft (eval/engine.py)
                prompt_logits(draft, target_model, seq)   teacher-forced (p, q) logits over the target's vocabulary
  formats.py    checkpoint_config(draft) / own_state_dict(draft) / load(config, state, target_model)
                the checkpoint; export(fmt, step_dir, draft_cfg, recipe, target_config, out, k) writes an
                export format into the directory `out` (train/export.py adds the README and the serve command)

`load_draft(step_dir, target)` returns a `LoadedDraft`: the module with its kind (the checkpoint's), so what
decodes or measures it never asks the module its kind again. `loaded(draft)` makes one of a bare module handed
in from outside (a test's or a benchmark's own draft, the target drafting for itself): the one caller of
`kind_of`, which asks every kind whether it owns the module.

`kind(name)` is a `Kind`: these names, each from the file that defines it, a file imported when one of its
names is first asked for, so the recipe, `specdistill config` and `specdistill report` (config.py's names
only) never import torch.

Adding a kind: its package here; KIND_NAMES finds it (docs/DESIGN.md "Adding a kind").
"""
from __future__ import annotations

import importlib
import pkgutil
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdistill.errors import SpecdistillError
from specdistill.formats import read_checkpoint

def discover(paths) -> tuple[str, ...]:
    """Every kind package under `paths` (`common` is not a kind), by name, those whose `__init__.py` sets
    ASKED_LAST after the rest: `kind_of` asks in this order, and draft_lm owns any causal LM."""
    names = sorted(m.name for m in pkgutil.iter_modules(paths) if m.ispkg and m.name != "common")
    last = [n for n in names if getattr(importlib.import_module(f"{__name__}.{n}"), "ASKED_LAST", False)]
    return tuple([n for n in names if n not in last] + last)


# The registry: every kind, by package name (eagle, eagle3, medusa, draft_lm).
KIND_NAMES = discover(__path__)


FILES = ("config", "model", "objective", "drafter", "formats")  # the files of every kind package


class Kind:
    """A draft kind: the names its package's files define (FILES, in that order), each file imported when
    one of its names is first asked for."""

    def __init__(self, package: str):
        self.package = package

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        for file in FILES:
            names = vars(importlib.import_module(f"{__name__}.{self.package}.{file}"))
            if name in names and not isinstance(names[name], types.ModuleType):
                return names[name]
        raise AttributeError(f"draft kind {self.package!r} has no {name!r} (looked in {', '.join(FILES)})")

    def __repr__(self) -> str:
        return f"<draft kind {self.package}>"


_KINDS = {name: Kind(name) for name in KIND_NAMES}


def kind(name: str) -> Kind:
    """The kind of a `draft.kind` name (as written in a recipe or a checkpoint)."""
    if name not in _KINDS:
        raise SpecdistillError(f"draft.kind {name!r} is not implemented; implemented: {', '.join(KIND_NAMES)}")
    return _KINDS[name]


def all_kinds() -> list[Kind]:
    """Every kind, in registry order."""
    return list(_KINDS.values())


def kind_of(module) -> Kind:
    """The kind of a bare draft module: the first kind (in registry order) that owns it; draft_lm owns any causal LM."""
    return next(k for k in all_kinds() if k.owns(module))


@dataclass(frozen=True)
class LoadedDraft:
    """A draft module (a torch module) and its kind."""
    module: Any
    kind: Kind


def loaded(draft) -> LoadedDraft:
    """`draft` with its kind: a LoadedDraft as it is; a bare module, handed in from outside (a test's or a
    benchmark's own draft, the target drafting for itself), with the kind that owns it (kind_of)."""
    return draft if isinstance(draft, LoadedDraft) else LoadedDraft(draft, kind_of(draft))


def export_formats() -> list[str]:
    """Every export format of every kind."""
    return [fmt for k in all_kinds() for fmt in k.EXPORT_FORMATS]


def kind_of_format(fmt: str) -> Kind:
    """The kind that exports `fmt`."""
    for k in all_kinds():
        if fmt in k.EXPORT_FORMATS:
            return k
    raise SpecdistillError(f"--format {fmt!r}: expected one of {', '.join(export_formats())}")


def load_draft(step_dir: Path, target_model) -> LoadedDraft:
    """A checkpoint's draft with its kind (the checkpoint's `kind`): the module bound to the loaded target's frozen
    parts, in eval mode, on the target's device and dtype (a head of its kind, or a transformers causal LM)."""
    config, state = read_checkpoint(step_dir)
    draft_kind = kind(config["kind"])
    ref = target_model.get_input_embeddings().weight
    with ref.device:  # built where it runs: no host copy of the head on the way to a GPU
        module = draft_kind.load(config["config"], state, target_model)
    return LoadedDraft(module.to(device=ref.device, dtype=ref.dtype).eval().requires_grad_(False), draft_kind)
