"""Eval results read back (checkpoints/<run>/eval/<checkpoint>.<prompt set>.<runtime>.json, written by
`specdistill eval`, named by layout.eval_result): the one
reader the report, the export README and the eval summary use, with the check that a result still measures
the checkpoint on disk under the recipe's eval settings, and the one-line summary of a result.
"""
from __future__ import annotations

from pathlib import Path

from specdistill import layout, provenance
from specdistill.errors import SpecdistillError
from specdistill.eval.runtime_names import resolve_runtime_name
from specdistill.formats import checkpoint_fingerprint, read_eval, read_metrics
from specdistill.metrics import HELDOUT_EXTRA_KEYS, OFFLINE_KEYS, simulated_tau
from specdistill.target_files import local_config


def load_evals(run_dir: Path, eval_cfg, runtime: str) -> list[dict]:
    """Every checkpoint's eval result in a run on the recipe's prompt set in its runtime (layout.eval_results),
    oldest step first; each gets `_run` and `_file`."""
    files = layout.eval_results(run_dir, eval_cfg, runtime)
    if not files:
        others = sorted(p.name for p in layout.eval_dir(run_dir).glob("*.json"))
        want = f"*{layout.eval_result_suffix(eval_cfg, runtime)}"
        raise SpecdistillError(f"{layout.eval_dir(run_dir)}: no eval results ({want}) on these prompts in this runtime; "
                               "run `specdistill eval` first" + (f" (there are: {', '.join(others)})" if others else ""))
    evals = [read_eval(f) for f in files]
    for e in evals:
        e["_run"] = run_dir.name
    return sorted(evals, key=lambda e: (e["step"] is not None, e["step"] or 0, e["checkpoint"]))


def result_at(e: dict, temperature: float) -> dict:
    return next((r for r in e["results"] if float(r["temperature"]) == temperature), {})


def offline(e: dict, source: str, key: str):
    return ((e.get("offline") or {}).get(source) or {}).get(key)


def distribution_label(e: dict, source: str, key: str) -> str:
    """What distribution an offline number was computed on ('full vocabulary', 'top-32+tail', 'draft vocab', ...),
    from the metrics' own `labels`, else read from their `distribution` text (results written before labels)."""
    m = (e.get("offline") or {}).get(source) or {}
    if (m.get("labels") or {}).get(key):
        return m["labels"][key]
    text = m.get("distribution") or ""
    if text.startswith("top-") and key != "top1":
        k = text.split()[0]
        return f"{k}+tail, upper bound" if key == "predicted_alpha" else f"{k}+tail"
    if key == "fkl" and "fkl over the draft vocabulary" in text:
        return "draft vocab"
    return "full vocabulary"


def column_label(evals: list[dict], source: str, key: str) -> str:
    """' (top-32+tail)'-style suffix for a column when some value in it is not over the full vocabulary."""
    found = sorted({distribution_label(e, source, key) for e in evals if offline(e, source, key) is not None})
    found = [f for f in found if f != "full vocabulary"] or []
    return f" ({' / '.join(found)})" if found else ""


def first_draft_prediction(e: dict, source: str, temperature: float):
    """The offline number that predicts alpha_at[0] at this temperature: top-1 at T=0 (greedy continuations),
    predicted α = 1 − E[tvd] at T>0 (on the eval prompts: continuations sampled at T when measured)."""
    if temperature == 0:
        return offline(e, source, "top1")
    if source == "prompts":
        return offline(e, "prompts_sampled", "predicted_alpha")
    return offline(e, source, "predicted_alpha")


def temperatures(evals: list[dict]) -> list[float]:
    return sorted({float(r["temperature"]) for e in evals for r in e["results"]})


def heldout_simulated_tau(e: dict, temperature: float, k: int | None = None):
    """The held-out simulated tau at the eval's K: at T=0 the replayed chain (`chain_tau`) where training
    measured it at that K; else the product formula (docs/METRICS.md) of the per-depth acceptance training measured
    (T=0: top1_at, T>0: alpha_at; depths past the unrolled ones repeat the deepest). None when not measured."""
    held = (e.get("offline") or {}).get("heldout") or {}
    chain = (held.get("chain_tau") or {}).get("0")
    k_eval = k if k is not None else e.get("k")
    if temperature == 0 and chain is not None and (k_eval is None or int(k_eval) == held.get("chain_k")):
        return chain  # the chain replayed as decoding drafts it (eval/chain_tau.py), where training measured it
    per_depth = held.get("top1_at" if temperature == 0 else "alpha_at")
    if not per_depth:
        return None
    return simulated_tau(per_depth, int(k if k is not None else e.get("k") or len(per_depth)))


def changed(had: dict, now: dict) -> list[str]:
    """The keys whose value differs between what a result recorded and what the recipe asks now."""
    return sorted(k for k in set(had) | set(now) if had.get(k) != now.get(k))


# Eval keys added after results were first written, with the value a result written before them was measured
# under: such a result is not stale for lacking the key.
EVAL_KEYS_ADDED = {"fp32_reference": "auto"}
# Eval keys that change no measurement of the eval (`eval_settings` leaves them out): never a reason for a result to
# be stale. processes: how many processes share the checkpoints; workload_prompts: the workloads stage's, not the eval's.
NOT_EVAL_SETTINGS = {"processes", "workload_prompts"}


def measured(settings: dict) -> dict:
    """Eval settings less NOT_EVAL_SETTINGS (a result may record the whole eval section)."""
    return {k: v for k, v in settings.items() if k not in NOT_EVAL_SETTINGS}


def check_freshness(evals: list[dict], run_dir: Path, eval_settings: dict | None = None,
                    run_key: dict | None = None) -> None:
    """Mark (e['_stale'] = reasons) every result that does not match the checkpoint on disk or the recipe.

    A result is the measurement of one checkpoint under one set of eval settings: one evaluated before a
    retraining, or under other settings (prompts, K, max_new_tokens...), must not pass for the current one;
    nor one of another target, runtime or decoding code (`run_key`)."""
    for e in evals:
        reasons = []
        step_dir = run_dir / str(e.get("checkpoint"))
        recorded = e.get("checkpoint_fingerprint")
        if not step_dir.is_dir():
            reasons.append(f"checkpoint {step_dir.name} no longer exists")
        elif not recorded:
            reasons.append("unverified: no checkpoint_fingerprint recorded (evaluated by an older version)")
        elif recorded != checkpoint_fingerprint(step_dir):
            reasons.append(f"checkpoint changed since it was evaluated (fingerprint {recorded} ≠ "
                           f"{checkpoint_fingerprint(step_dir)})")
        if eval_settings is not None:
            had = e.get("eval_settings")
            if had is None:
                reasons.append("unverified: no eval settings recorded")
            elif diff := changed(measured({**EVAL_KEYS_ADDED, **had}), measured(eval_settings)):
                reasons.append("eval settings differ from the recipe's: " + ", ".join(
                    f"{k} {had.get(k, EVAL_KEYS_ADDED.get(k))!r} → {eval_settings.get(k)!r}" for k in diff))
        if run_key is not None:
            had = e.get("run_key")
            if had is None:
                reasons.append("unverified: no target / runtime / decoding code recorded (evaluated by an older version)")
            elif diff := changed(had, run_key):
                reasons.append("measured with another " + ", ".join(
                    f"{k} ({had.get(k)!r} → {run_key.get(k)!r})" for k in diff))
        e["_stale"] = reasons


def checkpoint_metrics(step_dir: Path) -> dict:
    """A checkpoint's metrics.json, {} where it has none or it cannot be read (an older or damaged checkpoint:
    its numbers are then simply absent)."""
    try:
        data = read_metrics(step_dir)
    except SpecdistillError:
        return {}
    return data if isinstance(data, dict) else {}


def heldout_metrics(step_dir: Path) -> dict | None:
    """The offline metrics training wrote for this checkpoint (metrics.json -> heldout)."""
    saved = read_metrics(step_dir)  # damaged: an error naming the file (the eval would report wrong numbers)
    if saved is None:
        return None
    held = saved.get("heldout", saved)
    if not isinstance(held, dict) or not any(k in held for k in OFFLINE_KEYS):
        return None
    return {k: held.get(k) for k in (*OFFLINE_KEYS, *HELDOUT_EXTRA_KEYS) if k in held}


def checkpoint_tokens_seen(step_dir: Path) -> int | None:
    """Cumulative training tokens (non-pad, all ranks) when this checkpoint was saved (metrics.json -> tokens_seen);
    None for checkpoints trained before train/loop.py recorded it."""
    value = checkpoint_metrics(step_dir).get("tokens_seen")
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def eval_settings(recipe) -> dict:
    """The recipe's eval section as JSON: a result measured under other settings is not this recipe's. Less
    eval.processes: how many processes share the checkpoints changes no measurement (each checkpoint is decoded
    by one process on one device as a serial eval decodes it), and a worker runs with processes=1; less
    eval.workload_prompts, which only the workloads stage reads."""
    return recipe.eval.model_dump(mode="json", exclude=NOT_EVAL_SETTINGS)


def recipe_runtime(recipe) -> str:
    """The runtime eval.runtime resolves to for the recipe's target (read as JSON where the target is on disk, so
    the report stays torch-free): the runtime part of an eval result's name and run key."""
    config = local_config(recipe.target)
    if config is None:  # a hub id, a GGUF not dequantised yet: transformers reads (or fetches) it
        from specdistill.target import load_target_config

        config = load_target_config(recipe.target)
    return resolve_runtime_name(recipe.eval.runtime, config)


def run_key(recipe, runtime_name: str | None = None) -> dict:
    """What else a result depends on besides its checkpoint and eval settings: the target (its recipe section),
    the runtime eval.runtime resolved to, and the decoding code (a fingerprint of its files); the report marks a
    result stale when any differs. runtime_name: the resolved runtime (else `recipe_runtime`)."""
    return {"target": recipe.target.model_dump(mode="json"), "runtime": runtime_name or recipe_runtime(recipe),
            "decode_code": provenance.code_fingerprint()}


def result_path(recipe, checkpoint: str, run_dir: Path | None = None) -> Path:
    """Where the eval result of a checkpoint on the recipe's prompt set in its runtime lives (layout.eval_result)."""
    return layout.eval_result(run_dir or recipe.run_dir, checkpoint, recipe.eval, recipe_runtime(recipe))


def read_result(recipe, checkpoint: str, run_dir: Path | None = None) -> dict | None:
    """The eval result of one checkpoint on the recipe's prompts in its runtime, freshness checked (`_stale`, as
    `check_freshness`), None if never evaluated so."""
    run_dir = run_dir or recipe.run_dir
    path = result_path(recipe, checkpoint, run_dir)
    if not path.exists():
        return None
    result = read_eval(path)
    check_freshness([result], run_dir)
    return result
