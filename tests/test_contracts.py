"""specdistill/contracts.py: every kind of the registry satisfies the kind surface (its names, its functions'
signatures), and the drafter of each kind's loaded draft satisfies the drafter contracts the engine and the
tree stepper rely on; an object that lacks a member fails the same checks."""
from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdistill import contracts, kinds
from specdistill.eval.engine import NoDraft
from specdistill.formats import write_checkpoint
from specdistill.recipe import Recipe

ROOT = Path(__file__).resolve().parent.parent
KINDS = kinds.all_kinds()
IDS = [k.package for k in KINDS]


def own_methods(protocol) -> list[str]:
    """The methods a protocol declares itself or through its protocol bases (not object's or Protocol's)."""
    return sorted({name for cls in protocol.__mro__ if getattr(cls, "_is_protocol", False) and cls is not contracts.Protocol
                   for name, value in vars(cls).items() if inspect.isfunction(value) and not name.startswith("_")})


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval().requires_grad_(False)


def loaded_draft(kind, target, tmp_path):
    """A draft of `kind` (the recipe's defaults) through a checkpoint and kinds.load_draft, as the eval loads one:
    the module and the kind the checkpoint names."""
    recipe = Recipe.model_validate({"run_name": "t", "target": {"path": "unused"}, "corpus": {"path": "x.jsonl"},
                                    "draft": {"kind": kind.NAME}, "train": {"max_steps": 1, "save_every": 1}})
    draft = kind.shapes(recipe, target.config).to_empty(device="cpu")
    with torch.no_grad():
        for t in [*draft.parameters(), *draft.buffers()]:
            t.zero_()  # any values do; zeros are a valid EAGLE-3 draft vocabulary mapping (d2t)
    write_checkpoint(tmp_path, kind.own_state_dict(draft), {"kind": kind.NAME, "config": kind.checkpoint_config(draft),
                                                            "step": 1}, {"step": 1})
    return kinds.load_draft(tmp_path, target)


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_every_kind_satisfies_the_kind_surface(kind):
    assert isinstance(kind, contracts.DraftKind)
    assert kind.NAME == kind.package and isinstance(kind.LABEL, str)
    assert isinstance(kind.EXPORT_FORMATS, tuple) and set(kind.VLLM_METHOD) == set(kind.EXPORT_FORMATS)
    assert isinstance(kind.DRAFTS_TREES, bool) and kind.DRAFTER_READS in (None, "hidden_last", "hidden_aux")
    for name in own_methods(contracts.DraftKind):  # the module's function takes what the protocol's method does
        want = list(inspect.signature(getattr(contracts.DraftKind, name)).parameters.values())[1:]  # less self
        got = list(inspect.signature(getattr(kind, name)).parameters.values())
        assert len(got) == len(want), (kind, name, got)
        assert [p.name for p in got[1:]] == [p.name for p in want[1:]], (kind, name, got)  # the first is the kind's
        assert [p.default for p in got] == [p.default for p in want], (kind, name, got)


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_every_kinds_loaded_draft_makes_a_drafter_of_the_contract(kind, target, tmp_path):
    loaded = loaded_draft(kind, target, tmp_path)
    draft = loaded.module
    assert loaded.kind is kind and isinstance(draft, torch.nn.Module) and kinds.kind_of(draft) is kind
    assert kinds.loaded(loaded) is loaded and kinds.loaded(draft) == loaded  # a bare module: the kind that owns it
    drafter = kind.drafter(draft, target)
    assert isinstance(drafter, contracts.Drafter) and not isinstance(drafter, torch.nn.Module)
    assert drafter.needs_features == (kind.DRAFTER_READS is not None)
    assert isinstance(drafter, contracts.TreeDrafting) == kind.DRAFTS_TREES
    if kind.DRAFTS_TREES:
        assert isinstance(drafter.tree_drafter(), contracts.TreeDrafter)


def test_an_object_missing_a_member_fails_the_checks():
    class NoPropose:
        needs_features = False

        def features(self, hidden_states):
            return None

        def reset(self, capacity: int = 0) -> None:
            pass

    class NoDraw:  # a tree drafter without `draft`
        def reset(self) -> None:
            pass

    assert isinstance(NoDraft(), contracts.Drafter) and not isinstance(NoDraft(), contracts.TreeDrafting)
    assert not isinstance(NoPropose(), contracts.Drafter)
    assert not isinstance(NoDraw(), contracts.TreeDrafter)
    kind = kinds.kind("eagle")
    surface = {name: getattr(kind, name) for name in [*own_methods(contracts.DraftKind),
                                                       *contracts.DraftKind.__annotations__,
                                                       *contracts.KindConfig.__annotations__]}
    assert isinstance(type("Whole", (), surface)(), contracts.DraftKind)
    del surface["export"]
    assert not isinstance(type("NoExport", (), surface)(), contracts.DraftKind)


# A copy of Medusa's package under a new name, found on the registry's own path (specdistill/kinds' __path__,
# where pkgutil looks): the registry lists it, every per-kind test collects a case for it (as many as Medusa's),
# and those cases pass: the kind's own tiny draft (model.py tiny_draft) is all the tests build it from.
FIFTH_KIND = """
import importlib.util, sys
spec = importlib.util.find_spec("specdistill.kinds")
spec.submodule_search_locations.append(sys.argv[1])
kinds = importlib.util.module_from_spec(spec)
sys.modules["specdistill.kinds"] = kinds
spec.loader.exec_module(kinds)
print("KIND_NAMES", " ".join(kinds.KIND_NAMES))
import pytest
sys.exit(pytest.main(["-p", "no:cacheprovider", *sys.argv[2:]]))
"""
PER_KIND = {"tests/test_contracts.py": 2, "tests/test_chain_tau.py": 4, "tests/test_engine.py": 1,
            "tests/test_exactness.py": 5, "tests/test_hybrid.py": 1, "tests/test_strict_device_eval.py": 10,
            "tests/test_tree.py": 9}
# Not run for the copy (collected all the same): the cases about the statistical test's own power (a deliberately
# wrong rule rejected; the same for every kind) and the joint test's second temperature on the default runtime
# (the same code path as at 0.7, ~1 minute on a busy machine).
NOT_RUN = ("wrong", "test_joint_output_follows_the_target_on_the_default_runtime[hydra-1.0]")


def fifth_kind(tmp_path, *pytest_args) -> subprocess.CompletedProcess:
    """pytest (`pytest_args`) with a copy of Medusa's package named hydra among the registry's kinds."""
    source = Path(kinds.__file__).parent / "medusa"
    copy = tmp_path / "hydra"
    copy.mkdir(exist_ok=True)
    for path in source.glob("*.py"):
        (copy / path.name).write_text(path.read_text().replace("medusa", "hydra").replace("Medusa", "Hydra"))
    done = subprocess.run([sys.executable, "-c", FIFTH_KIND, str(tmp_path), "-q", *pytest_args], capture_output=True,
                          text=True, cwd=ROOT, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # tiny models: one thread is the fastest
    assert "KIND_NAMES eagle eagle3 hydra medusa draft_lm" in done.stdout  # by name, draft_lm still asked last
    return done


def test_a_copied_kind_is_found_and_every_per_kind_test_runs_it(tmp_path):
    collect = fifth_kind(tmp_path, "--collect-only", "-k", "hydra or medusa", *PER_KIND)
    assert collect.returncode == 0, collect.stdout[-3000:] + collect.stderr[-3000:]
    collected = [line for line in collect.stdout.splitlines() if "::" in line]
    for test_file, cases in PER_KIND.items():
        hydra = [c for c in collected if c.startswith(test_file) and "hydra" in c]
        medusa = [c for c in collected if c.startswith(test_file) and "medusa" in c]
        assert len(hydra) == len(medusa) >= cases, (test_file, hydra, medusa)
    chosen = [c for c in collected if "hydra" in c and not any(n in c for n in NOT_RUN)]
    assert {c.split("::")[0] for c in chosen} == set(PER_KIND)  # every per-kind file runs the copy
    ran = fifth_kind(tmp_path, "-rA", *chosen)  # ~1 minute on an idle 2-core machine, ~3 on a busy one
    passed = {line.split()[1] for line in ran.stdout.splitlines() if line.startswith("PASSED ")}
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    assert passed == set(chosen), sorted(passed ^ set(chosen))
