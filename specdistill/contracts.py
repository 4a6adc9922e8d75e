"""What the decoding engine, the tree stepper and the kinds registry expect of the objects they are handed, as
`typing.Protocol` classes (torch-free: annotations only, nothing here imports torch).

  Drafter        what eval/engine.py's decode loop drafts with: a kind's `drafter(draft, target_model, static)`
                 makes one from a loaded draft; `NoDraft` (K = 0) and a test's hand-made drafter are ones too
  TreeDrafting   a Drafter whose kind drafts trees (`DRAFTS_TREES`): it also makes its TreeDrafter
  TreeDrafter    what eval/tree.py's TreeStepper drafts a tree with, each step
  KindConfig     the names of a kind's torch-free config.py (what the recipe and the report read)
  DraftKind      every name a kind's package defines, file by file (specdistill/kinds/__init__.py FILES)

A draft (what a kind's `load` and `build` return) is a torch module; a drafter is not one, whatever its kind:
that is how the engine tells a draft it must wrap from a drafter it is given (eval/engine.py `make_drafter`).

The protocols are runtime-checkable so that tests/test_contracts.py can check every registry kind and its
drafter against them; the engine and the stepper call the methods, they never probe for them.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: this module stays torch-free
    import torch

    from specdistill.decoding.tree_drafter import DraftTree, TreeShape


@runtime_checkable
class Drafter(Protocol):
    """Drafts a chain for the decode loop (eval/engine.py). `features(hidden_states)` picks what it reads of
    each target forward (EAGLE: the last hidden state; EAGLE-3: the aux-layer states); the engine calls it
    only when `needs_features` (else the target keeps no hidden states and `new_features` is None)."""

    needs_features: bool

    def features(self, hidden_states: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """The target's hidden states (one tensor per layer) -> what the drafter reads, [1, n, F]; None for a
        drafter that reads none (`needs_features = False`)."""
        ...

    def reset(self, capacity: int = 0) -> None:
        """A new decode: drop any cache (`capacity`: the most slots it will need)."""
        ...

    def propose(self, seq: torch.Tensor, n: int, new_features: torch.Tensor | None, k: int, temperature: float,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft at most k tokens after seq[:n] -> (tokens [k'], q [k', V] at T > 0, else None), k' <= k.
        new_features: its features of the positions the target cached since the previous call."""
        ...


@runtime_checkable
class TreeDrafter(Protocol):
    """Drafts one tree per step for eval/tree.py's TreeStepper (same arguments as a chain's, and the shape)."""

    def reset(self) -> None:
        ...

    def draft(self, seq: torch.Tensor, n: int, new_features: torch.Tensor | None, shape: TreeShape,
              depth: int) -> DraftTree:
        """A tree of at most `depth` levels after seq[:n], nodes in parent-first order."""
        ...


@runtime_checkable
class TreeDrafting(Drafter, Protocol):
    """The drafter of a kind that drafts trees: the chain drafter (also the T > 0 fallback) and its trees."""

    def tree_drafter(self) -> TreeDrafter:
        """Its tree drafter, sharing its head (EAGLE heads: specdistill/decoding/tree_drafter.py TreeDrafter; Medusa: its own)."""
        ...


@runtime_checkable
class KindConfig(Protocol):
    """A kind's config.py (torch-free): what the recipe, the cache stage and the report know of it."""

    NAME: str  # the recipe's `draft.kind`
    LABEL: str  # in messages and reports
    Config: type  # its `draft` section (a specdistill.section.Section)
    Loss: type  # its `loss` section (kinds/common/config.py LossConfig + its own keys)
    STORE: list[str]  # what the cache stage stores for it by default
    DRAFTER_READS: str | None  # the cached target states its drafter reads (hidden_last, hidden_aux) or None
    EXPORT_FORMATS: tuple[str, ...]  # the default first
    VLLM_METHOD: Mapping[str, str]  # export format -> vLLM's speculative-config "method"
    DRAFTS_TREES: bool  # its drafter is a TreeDrafting one (eval/tree.py)
    PROMPTS_FKL_NOTE: str | None  # why fkl on the eval prompts is undefined, or None


@runtime_checkable
class DraftKind(KindConfig, Protocol):
    """Every name of a kind's package (specdistill/kinds/__init__.py lists them by file). A module's functions
    satisfy these methods without their `self`; the first argument's name is the kind's own (head, model)."""

    # model.py
    def build(self, recipe: Any, parts: Any, data: Any = None) -> torch.nn.Module:
        """A fresh draft from the target's parts and the cached train split."""
        ...

    def shapes(self, recipe: Any, target_config: Any) -> torch.nn.Module:
        """The same on the meta device."""
        ...

    def owns(self, module: Any) -> bool:
        """Whether a loaded draft is this kind's (`kinds.kind_of` asks every kind in registry order)."""
        ...

    def draft_vocabulary(self, draft: Any) -> torch.Tensor | None:
        """The target ids it can propose where fewer than the target's, else None."""
        ...

    def tiny_draft(self, target_model: Any, k: int = 3) -> torch.nn.Module:
        """A small, seeded, randomly initialised draft for a (tiny) loaded target that drafts up to k tokens a step:
        the kind's own case in every per-kind test (tests build no kind by name)."""
        ...

    # objective.py
    Objective: type  # (head, parts, loss, data) -> what DeepSpeed wraps (specdistill/objective/base.py Objective)

    # drafter.py
    def drafter(self, draft: Any, target_model: Any = None, static: bool = False) -> Drafter:
        """What the decode loop drafts with (a TreeDrafting one when DRAFTS_TREES)."""
        ...

    def prompt_logits(self, draft: Any, target_model: Any, seq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced (p, q) logits [T, V] over the target's vocabulary."""
        ...

    # formats.py
    def checkpoint_config(self, draft: Any) -> dict:
        ...

    def own_state_dict(self, draft: Any) -> dict[str, torch.Tensor]:
        ...

    def load(self, config: dict, state: dict[str, torch.Tensor], target_model: Any) -> torch.nn.Module:
        """A checkpoint's draft (kinds.load_draft puts it on the target's device and dtype, in eval mode)."""
        ...

    def export(self, fmt: str, step_dir: Path, draft_cfg: dict, recipe: Any, target_config: Any, out: Path,
               k: int) -> None:
        ...
