"""Golden numbers (torchtune-style): a tiny deterministic run per draft kind, prepare -> cache -> 3 training
steps -> eval of 2 prompts on a tiny random Llama target, whose losses, held-out and on-prompt offline
metrics, decoded tokens, counters and tau are pinned to float tolerance. A refactor must leave them as they are.

Every setting the numbers depend on is written out here (not left to the recipe's defaults), so a change of a
default moves no golden number. To regenerate after an intended change of behaviour:
`SPECDISTILL_WRITE_GOLDEN=1 pytest tests/test_golden.py`, and say why in the commit.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from specdistill import layout
from specdistill.cli import main
from specdistill.recipe import load_recipe

GOLDEN = Path(__file__).parent / "golden" / "golden.json"
WRITE = os.environ.get("SPECDISTILL_WRITE_GOLDEN") == "1"
REL, ABS = 1e-5, 1e-7

CHAT = [{"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                      {"role": "assistant", "content": f"{a} plus {b} is {a + b}. Happy to help with more sums."}]}
        for a in range(10) for b in range(2)]
PROMPTS = [{"category": "math", "turns": ["What is 3 plus 4?"]},
           {"category": "writing", "turns": ["Write one line about the sea."]}]
DRAFT = {"eagle": {"kind": "eagle", "init_layer_from_target": True},
         "eagle3": {"kind": "eagle3", "draft_vocab_size": 256, "ttt_steps": 2, "init_layer_from_target": True},
         "draft_lm": {"kind": "draft_lm", "num_layers": 1, "copy_target_layers": True},
         "medusa": {"kind": "medusa", "num_heads": 3, "num_layers": 1, "head_decay": 0.8}}
TREE = {"kind": "dynamic", "depth": 3, "top_k": 2, "total_tokens": 5}


def write_recipe(tmp_path: Path, target_dir: Path, kind: str) -> Path:
    corpus, prompts = tmp_path / "chat.jsonl", tmp_path / "prompts.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in CHAT))
    prompts.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    recipe = {
        "run_name": kind, "output_dir": str(tmp_path / "runs"),
        "target": {"path": str(target_dir), "dtype": "float32"},
        "corpus": {"path": str(corpus), "format": "messages", "max_length": 64, "heldout_fraction": 0.2,
                   "pack": False, "on_bad_row": "error", "min_assistant_tokens": 1},
        "cache": {"mode": "offline", "dtype": "float32", "topk": 8, "store": None, "aux_layers": None,
                  "regenerate": False},
        "draft": DRAFT[kind],
        "loss": {"terms": {"fkl": 1.0, "tvd": 0.5}, "temperature": 1.0, "jsd_beta": 0.5, "feature_weight": 1.0,
                 "distribution_weight": 0.1, "feature_noise": 0.2, "distribution_sample": 1.0, "ttt_decay": 0.8},
        "train": {"max_steps": 3, "save_every": 3, "num_gpus": 1, "micro_batch_size": 4,
                  "gradient_accumulation_steps": 1, "lr": 0.003, "min_lr_ratio": 0.1, "warmup_steps": 1,
                  "weight_decay": 0.0, "betas": [0.9, 0.95], "grad_clip": 0.5, "zero_stage": 0, "precision": "fp32",
                  "seed": 0, "log_every": 1, "heldout_batches": 2, "report_to": ["tensorboard"]},
        "eval": {"prompts": str(prompts), "num_prompts": 2, "max_new_tokens": 12, "temperature": [0, 1], "k": 2,
                 "k_sweep": [3], "checkpoints": "last", "comparators": False, "seed": 0,
                 "tree": TREE if kind != "draft_lm" else None, "runtime": "static-fp32"},
    }
    path = tmp_path / f"{kind}.yaml"
    path.write_text(json.dumps(recipe))  # JSON is YAML
    return path


def numbers(tree) -> object:
    """The numeric leaves of a JSON tree (strings, timings and labels left out)."""
    if isinstance(tree, dict):
        return {k: numbers(v) for k, v in tree.items()
                if not isinstance(v, str) and not k.endswith(("_s", "_ms", "per_s", "per_token", "per_verify",
                                                              "per_draft_step", "speedup", "ci95", "forward_ms"))
                and k not in ("speedup_by_k", "predicted_speedup_by_k", "d", "costs", "hardware", "tokens_per_s",
                              "baseline_tokens_per_s", "per_category", "best_k", "divergences")}
    if isinstance(tree, list):
        return [numbers(v) for v in tree]
    return tree


def observe(tmp_path: Path, target_dir: Path, kind: str) -> dict:
    recipe_path = write_recipe(tmp_path, target_dir, kind)
    for stage in ("prepare", "cache", "train", "eval"):
        assert main([stage, "--recipe", str(recipe_path)]) == 0, f"{kind}: {stage} failed"
    recipe = load_recipe(recipe_path)
    run = recipe.run_dir
    log = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    step_dir = layout.checkpoints(run)[-1]
    result = json.loads((layout.eval_dir(run) / f"{step_dir.name}.json").read_text())
    return {
        "train_log": [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in log],
        "heldout": numbers(json.loads((step_dir / "metrics.json").read_text())["heldout"]),
        "offline": numbers(result["offline"]),
        "results": numbers(result["results"]),
        "decodes": decodes(recipe, step_dir),
    }


@torch.inference_mode()
def decodes(recipe, step_dir: Path) -> dict:
    """Every decoded token and per-depth counter of the checkpoint's chain (T=0 and T=1) and tree (T=0)."""
    from specdistill.eval.engine import SpeculativeDecoder, eos_token_ids
    from specdistill.eval.prompts import load_prompts
    from specdistill.eval.runtime import make_runtime
    from specdistill.eval.tree import TreeDecoder
    from specdistill.target import load_target, load_tokenizer
    from specdistill.kinds import load_draft

    target, tokenizer = load_target(recipe.target), load_tokenizer(recipe.target)
    runtime = make_runtime(target, recipe.eval.runtime)
    draft = load_draft(step_dir, target)
    eos = eos_token_ids(target, tokenizer)
    prompts = load_prompts(recipe.eval, tokenizer)
    chain = SpeculativeDecoder(runtime, draft, k=recipe.eval.k, eos_ids=eos)
    runs = {}
    for t in (0.0, 1.0):
        runs[f"chain T={t:g}"] = [chain.decode(p.ids, 12, t, torch.Generator().manual_seed(i))
                                  for i, p in enumerate(prompts)]
    if recipe.eval.tree:
        tree = TreeDecoder(runtime, draft, dict(recipe.eval.tree), eos_ids=eos)
        runs["tree T=0"] = [tree.decode(p.ids, 12) for p in prompts]
    return {name: [{"tokens": r.tokens, "steps": r.steps, "drafted": r.drafted, "tested": r.tested,
                    "accepted": r.accepted, "draft_forwards": r.draft_forwards, "tau": r.tau} for r in rs]
            for name, rs in runs.items()}


def assert_close(got, want, where: str = "") -> None:
    if isinstance(want, dict):  # every golden number still there; keys added by later features are not golden
        assert isinstance(got, dict) and set(want) <= set(got), f"{where}: keys {sorted(set(want) - set(got))} missing"
        for k in want:
            assert_close(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{where}: {got} != {want}"
        for i, (a, b) in enumerate(zip(got, want)):
            assert_close(a, b, f"{where}[{i}]")
    elif isinstance(want, float) and not isinstance(got, bool):
        assert isinstance(got, (int, float)), f"{where}: {got!r} != {want!r}"
        assert (math.isnan(got) and math.isnan(want)) or math.isclose(got, want, rel_tol=REL, abs_tol=ABS), \
            f"{where}: {got!r} != golden {want!r}"
    else:
        assert got == want, f"{where}: {got!r} != golden {want!r}"


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "draft_lm", "medusa"])
def test_golden_numbers(kind, tmp_path, tiny_target_dir, monkeypatch, one_thread):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    got = observe(tmp_path, tiny_target_dir, kind)
    got = json.loads(json.dumps(got))  # the same types a JSON round trip gives the golden file
    if WRITE:
        golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
        golden[kind] = got
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
        return
    assert_close(got, json.loads(GOLDEN.read_text())[kind], kind)
