"""The `report` stage: report.md + PNG plots + TensorBoard scalars from checkpoints/<run>/eval/*.json.

What it shows (definitions: ../shared/docs/metrics.md):
  - one row per checkpoint: offline fkl / tvd / predicted α / top-1 (held-out and eval prompts) next to
    the measured α, τ, speedup and lossless flag per temperature;
  - measured α against what should predict it: predicted α = 1 − E[tvd] for T > 0, top-1 for T = 0
    (greedy verification accepts exactly when the argmaxes agree); and measured α against fkl;
  - measured τ per K against Leviathan's E = (1 − α^(K+1)) / (1 − α) with the measured α;
  - the comparators' speedups on the same prompts; where the time goes; α per draft depth;
  - how much data buys how much τ: held-out simulated and measured τ of every checkpoint against the training
    tokens it had seen, with a fitted saturating curve τ(N) = τ∞ − c·N^(−b) extrapolated to 10× the data;
  - the draft vocabulary's coverage (EAGLE-3): held-out, and of the target's greedy outputs on the eval prompts.
`--runs A B C` puts several runs in one report: checkpoints/compare-A-B-C/report.md.
"""
from __future__ import annotations

import json
import math
import os
import textwrap
from pathlib import Path

from specdistill import layout
from specdistill.errors import SpecdistillError
from specdistill.eval.evaluate import eval_settings, run_key
from specdistill.formats import checkpoint_fingerprint, read_eval, write_text_atomic
from specdistill.metrics import OFFLINE_KEYS, leviathan_tau, simulated_tau

COMPARATORS = ("hf_generate", "hf_prompt_lookup", "hf_assisted")
DASH = "—"


# ---------------------------------------------------------------------------------------- reading

def load_evals(run_dir: Path) -> list[dict]:
    """Every checkpoint's eval JSON in a run, oldest step first; each gets `_run` and `_file`."""
    files = sorted(layout.eval_dir(run_dir).glob("*.json"))
    if not files:
        raise SpecdistillError(f"{layout.eval_dir(run_dir)}: no eval results (*.json); run `specdistill eval` first")
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


def num(x, digits: int = 3) -> str:
    if x is None:
        return DASH
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def label(e: dict, many_runs: bool) -> str:
    name = f"{e['_run']}/{e['checkpoint']}" if many_runs else e["checkpoint"]
    return name + (" ⚠ STALE" if e.get("_stale") else "")


def short_label(e: dict, many_runs: bool) -> str:
    return f"{e['_run']}@{e['step']}" if many_runs else str(e["step"])


def heldout_simulated_tau(e: dict, temperature: float, k: int | None = None):
    """The held-out simulated tau at the eval's K: at T=0 the replayed chain (`chain_tau`) where training
    measured it at that K; else the product formula (metrics.md) of the per-depth acceptance training measured
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


HEADLINE_RULES = {
    "simulated_tau": "best held-out simulated τ (offline, chosen without looking at the measured numbers)",
    "last": "last checkpoint (not the best measured speedup: picking the maximum of noisy numbers biases it upward)",
}


def best_checkpoint(evals: list[dict]) -> dict:
    """The headline checkpoint, by a rule that is not biased upward (HEADLINE_RULES): the best held-out
    simulated τ when every checkpoint has one, else the last checkpoint. Results marked stale are passed over
    while a fresh one exists. Sets `_headline_rule` on the chosen one."""
    fresh = [e for e in evals if not e.get("_stale")] or evals
    t0 = temperatures(evals)[0]
    sims = [heldout_simulated_tau(e, t0) for e in fresh]
    if all(x is not None for x in sims):
        best, rule = max(zip(fresh, sims), key=lambda x: x[1])[0], "simulated_tau"
    else:
        best, rule = max(fresh, key=lambda e: (e["step"] is not None, e["step"] or 0)), "last"
    best["_headline_rule"] = rule
    return best


def ci(r: dict, key: str, digits: int = 3) -> str:
    """' [low, high]' for a result's 95% bootstrap interval, '' when it has none."""
    v = r.get(f"{key}_ci95")
    return f" [{num(float(v[0]), digits)}, {num(float(v[1]), digits)}]" if v else ""


# ------------------------------------------------------------------------------- stale results

def changed(had: dict, now: dict) -> list[str]:
    """The keys whose value differs between what a result recorded and what the recipe asks now."""
    return sorted(k for k in set(had) | set(now) if had.get(k) != now.get(k))


def check_freshness(evals: list[dict], run_dir: Path, eval_settings: dict | None = None,
                    run_key: dict | None = None) -> None:
    """Mark (e['_stale'] = reasons) every result that does not match the checkpoint on disk or the recipe.

    A result is the measurement of one checkpoint under one set of eval settings: one evaluated before a
    retraining, or under other settings (prompts, K, max_new_tokens...), must not pass for the current one;
    nor one of another target, runtime or decoding code (`run_key`, evaluate.run_key)."""
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
            elif diff := changed(had, eval_settings):
                reasons.append("eval settings differ from the recipe's: " + ", ".join(
                    f"{k} {had.get(k)!r} → {eval_settings.get(k)!r}" for k in diff))
        if run_key is not None:
            had = e.get("run_key")
            if had is None:
                reasons.append("unverified: no target / runtime / decoding code recorded (evaluated by an older version)")
            elif diff := changed(had, run_key):
                reasons.append("measured with another " + ", ".join(
                    f"{k} ({had.get(k)!r} → {run_key.get(k)!r})" for k in diff))
        e["_stale"] = reasons


# ------------------------------------------------------------------------------------- provenance

def hardware_text(e: dict) -> str:
    hw = e.get("hardware") or {}
    parts = [str(hw[k]) for k in ("cpu", "device") if hw.get(k)]
    if hw.get("threads"):
        parts.append(f"{hw['threads']} threads")
    return ", ".join(parts) or "unknown hardware"


def provenance(evals: list[dict], command: str) -> str:
    """One line saying what produced a figure: target, prompts, T, K, max_new_tokens, n, hardware, command."""
    def joined(key):
        return ", ".join(sorted({str(e.get(key, DASH)) for e in evals}))
    temps = ", ".join(num(t, 1) for t in temperatures(evals))
    return (f"target {joined('target')} | prompts {joined('prompts')} (n={joined('num_prompts')}) | "
            f"T {temps} | K {joined('k')} | max_new_tokens {joined('max_new_tokens')} | "
            f"{'; '.join(sorted({hardware_text(e) for e in evals}))} | {command}")


# ---------------------------------------------------------------------------------------- tables

def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


OFFLINE_NAMES = {"fkl": "fkl", "tvd": "tvd", "predicted_alpha": "pred α", "top1": "top-1"}


def checkpoint_table(evals: list[dict], many_runs: bool) -> str:
    """Offline numbers (each labelled with the distribution it was computed on) and, per temperature, the
    measured first-draft α next to pooled α and τ (with 95% bootstrap intervals over prompts) and the
    held-out simulated τ that predicts τ."""
    temps = temperatures(evals)
    sampled = any(offline(e, "prompts_sampled", "predicted_alpha") is not None for e in evals)
    header = ["checkpoint", "step"]
    header += [f"{OFFLINE_NAMES[k]} ({name}){column_label(evals, src, k)}"
               for src, name in (("heldout", "held-out"), ("prompts", "prompts, greedy cont.")) for k in OFFLINE_KEYS]
    if sampled:
        header.append(f"pred α (prompts, sampled cont.){column_label(evals, 'prompts_sampled', 'predicted_alpha')}")
    for t in temps:
        T = num(t, 1)
        header += [f"α₁ T={T} (first draft)", f"α T={T} (pooled) [95% CI]", f"τ T={T} [95% CI]"]
        if t == 0:  # beside the measured τ: the chain replayed on the target's own continuations (eval/chain_tau.py)
            header.append("sim. τ T=0 (continuations)")
        header += [f"sim. τ T={T} (held-out)", f"speedup T={T} [95% CI]",
                   f"speedup vs fastest plain T={T} (ours or generate())", f"lossless T={T}"]
    rows = []
    for e in evals:
        row = [label(e, many_runs), str(e["step"])]
        row += [num(offline(e, src, k)) for src in ("heldout", "prompts") for k in OFFLINE_KEYS]
        if sampled:
            row.append(num(offline(e, "prompts_sampled", "predicted_alpha")))
        for t in temps:
            r = result_at(e, t)
            lossless = "n/a (T>0)" if r and r.get("lossless") is None and t > 0 else num(r.get("lossless"))
            if r.get("lossless_vs_transformers") is not None:
                lossless += f"; vs generate(): {num(r['lossless_vs_transformers'])}"
            first = (r.get("alpha_at") or [None])[0]
            row += [num(first), num(r.get("alpha")) + ci(r, "alpha"), num(r.get("tau")) + ci(r, "tau")]
            if t == 0:
                row.append(num(((e.get("offline") or {}).get("chain_on_continuations") or {}).get("tau")))
            row += [num(heldout_simulated_tau(e, t)), num(r.get("speedup"), 2) + ci(r, "speedup", 2),
                    num(r.get("speedup_vs_fastest_plain"), 2)
                    + (f" (vs {r['fastest_plain']})" if r.get("fastest_plain") else ""), lossless]
        rows.append(row)
    return table(header, rows)


def comparator_table(evals: list[dict], many_runs: bool) -> str:
    temps = temperatures(evals)
    header = ["checkpoint"] + [f"ours T={num(t, 1)}" for t in temps] + [f"{c} (speedup, tok/s)" for c in COMPARATORS]
    rows = []
    for e in evals:
        comps = e.get("comparators") or {}
        row = [label(e, many_runs)] + [num(result_at(e, t).get("speedup"), 2) for t in temps]
        for c in COMPARATORS:
            entry = comps.get(c) or {}
            row.append(DASH if not entry else f"{num(entry.get('speedup'), 2)} ({num(entry.get('tokens_per_s'), 1)})")
        rows.append(row)
    return table(header, rows)


def time_table(evals: list[dict], many_runs: bool) -> str:
    header = ["checkpoint", "T", "ms / draft step", "ms / verify", "ms / token", "baseline ms / token",
              "tokens/s", "baseline tokens/s", "α per depth"]
    rows = []
    for e in evals:
        for r in sorted(e["results"], key=lambda r: float(r["temperature"])):
            depth = ", ".join(num(a, 2) for a in r.get("alpha_at") or []) or DASH
            rows.append([label(e, many_runs), num(float(r["temperature"]), 1), num(r.get("ms_per_draft_step"), 2),
                         num(r.get("ms_per_verify"), 2), num(r.get("ms_per_token"), 2),
                         num(r.get("baseline_ms_per_token"), 2), num(r.get("tokens_per_s"), 1),
                         num(r.get("baseline_tokens_per_s"), 1), depth])
    return table(header, rows)


def tau_k_table(evals: list[dict], many_runs: bool) -> str:
    header = ["checkpoint", "T", "α", "K", "measured τ", "Leviathan E", "simulated τ (held-out)", "speedup at K",
              "predicted τ/(Kd+v)", "best K"]
    rows = []
    for e in evals:
        for r in sorted(e["results"], key=lambda r: float(r["temperature"])):
            for k, tau in tau_points(e, r):
                alpha = r.get("alpha")
                speedup = (r.get("speedup_by_k") or {}).get(str(k), r.get("speedup") if k == e.get("k") else None)
                t = float(r["temperature"])
                rows.append([label(e, many_runs), num(t, 1), num(alpha), str(k), num(tau),
                             num(leviathan_tau(alpha, k)) if alpha is not None else DASH,
                             num(heldout_simulated_tau(e, t, k)), num(speedup, 2),
                             num((r.get("predicted_speedup_by_k") or {}).get(str(k)), 2), num(r.get("best_k"))])
    return table(header, rows)


def cost_table(evals: list[dict], many_runs: bool) -> str:
    """The measured cost curve of each eval: ms of a 1-token forward, v(M) = ms(M) / ms(1), and d."""
    sizes = sorted({int(m) for e in evals for m in ((e.get("costs") or {}).get("v") or {})})
    header = ["checkpoint", "runtime", "ms, 1 token"] + [f"v({m})" for m in sizes if m > 1] + ["d (T=0)"]
    rows = []
    for e in evals:
        c = e.get("costs")
        if not c:
            continue
        r0 = next((r for r in e["results"] if float(r["temperature"]) == 0), e["results"][0])
        rows.append([label(e, many_runs), c["runtime"], num(c["forward_ms"]["1"], 1)]
                    + [num(c["v"].get(str(m)), 2) for m in sizes if m > 1] + [num(r0.get("d"), 3)])
    return table(header, rows) if rows else "(no cost curve in these results: evaluated before eval/runtime.py)"


def tree_label(shape: dict) -> str:
    return "tree (" + ", ".join(f"{k}={v}" for k, v in shape.items()) + ")"


def chain_vs_tree_table(evals: list[dict], many_runs: bool) -> str:
    """Chain and tree drafting of the same checkpoint on the same prompts at T=0 (trees are greedy-only)."""
    header = ["checkpoint", "drafting", "τ", "α", "α per depth", "speedup", "ms / verify", "nodes / step", "lossless"]
    rows = []
    for e in evals:
        r = result_at(e, 0.0)
        if not r or "tree" not in r:
            continue
        t = r["tree"]
        depth = lambda xs: ", ".join(num(a, 2) for a in xs or []) or DASH  # noqa: E731
        rows.append([label(e, many_runs), f"chain K={e.get('k')}", num(r.get("tau")), num(r.get("alpha")),
                     depth(r.get("alpha_at")), num(r.get("speedup"), 2), num(r.get("ms_per_verify"), 1),
                     num(e.get("k")), num(r.get("lossless"))])
        rows.append([label(e, many_runs), tree_label(t["shape"]), num(t["tau"]), num(t["alpha"]), depth(t["alpha_at"]),
                     num(t["speedup"], 2), num(t["ms_per_verify"], 1), num(t["nodes_per_step"], 1),
                     num(t["lossless"])])
    if not rows:
        return "No tree drafting in these runs (set `eval.tree` in the recipe for `eagle`/`eagle3` heads)."
    return table(header, rows)


def methods_table(runs: dict[str, list[dict]]) -> str:
    """Each run's last checkpoint (equal training budget when the recipes match), chain and tree drafting,
    side by side at every temperature. Trees are greedy-only: at T>0 their row repeats the exact chain."""
    temps = temperatures([e for es in runs.values() for e in es])
    header = ["run", "checkpoint", "drafting"]
    for t in temps:
        header += [f"τ T={num(t, 1)}", f"α T={num(t, 1)}", f"speedup T={num(t, 1)}"]
    rows = []
    for name, evals in runs.items():
        if not evals:
            continue
        e = max(evals, key=lambda x: x["step"])
        chain = [name, e["checkpoint"], f"chain K={e.get('k')}"]
        for t in temps:
            r = result_at(e, t)
            chain += [num(r.get("tau")), num(r.get("alpha")), num(r.get("speedup"), 2)]
        rows.append(chain)
        greedy_tree = result_at(e, 0.0).get("tree")
        if greedy_tree:
            tree = [name, e["checkpoint"], tree_label(greedy_tree["shape"])]
            for t in temps:
                tr = result_at(e, t).get("tree")  # only at T=0: at T>0 the tree decoder is the chain
                tree += [num(tr["tau"]), num(tr["alpha"]), num(tr["speedup"], 2)] if tr else ["(chain)"] * 3
            rows.append(tree)
    return table(header, rows)


def category_table(e: dict) -> str:
    rows = []
    for r in sorted(e["results"], key=lambda r: float(r["temperature"])):
        for cat, c in sorted((r.get("per_category") or {}).items()):
            rows.append([cat, num(float(r["temperature"]), 1), num(c.get("tau")), num(c.get("alpha")),
                         num(c.get("speedup"), 2), num(c.get("num_prompts"))])
    return table(["category", "T", "τ", "α", "speedup", "prompts"], rows) if rows else "no per-category results"


def tau_points(e: dict, r: dict) -> list[tuple[int, float]]:
    """(K, τ) pairs: the K sweep when there is one, else the single K of the run."""
    by_k = r.get("tau_by_k") or {}
    if by_k:
        return sorted((int(k), float(v)) for k, v in by_k.items() if v is not None)
    if r.get("tau") is not None and e.get("k") is not None:
        return [(int(e["k"]), float(r["tau"]))]
    return []


# ------------------------------------------------------------------------ how much data buys how much τ

TAU_GOAL = 2.2  # issue 12's goal: measured τ at T=0 on MT-bench
EXTRAPOLATE = 10.0  # the fitted curve is drawn (dashed) up to this multiple of the largest tokens_seen


def read_checkpoint_metrics(step_dir: Path) -> dict | None:
    try:
        data = json.loads((step_dir / "metrics.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def run_k(evals: list[dict]) -> int | None:
    """The run's eval K (its last evaluated checkpoint's): simulated τ is computed at it for every checkpoint."""
    ks = [e.get("k") for e in sorted(evals, key=lambda e: e["step"] or 0) if e.get("k") is not None]
    return int(ks[-1]) if ks else None


def scaling_points(name: str, evals: list[dict], run_dir: Path | None = None) -> list[dict]:
    """One point per checkpoint of a run (complete on disk, or evaluated and since pruned by keep_last):
    step, tokens_seen (metrics.json; else the copy in its eval JSON; None when trained before it was recorded),
    held-out simulated τ at T=0 at the run's eval K, measured τ (chain, T=0, eval K; None when not evaluated or
    not at T=0) and whether that measurement is stale (then it is shown but not fitted)."""
    k = run_k(evals)
    points: dict[str, dict] = {}
    for e in evals:
        points[e["checkpoint"]] = {"run": name, "checkpoint": e["checkpoint"], "step": e["step"],
                                   "tokens_seen": e.get("tokens_seen"),
                                   "heldout": (e.get("offline") or {}).get("heldout"),
                                   "measured": result_at(e, 0.0).get("tau"), "stale": bool(e.get("_stale")),
                                   "evaluated": True}
    for step_dir in layout.checkpoints(run_dir) if run_dir is not None else []:
        pt = points.setdefault(step_dir.name, {
            "run": name, "checkpoint": step_dir.name, "step": int(layout.STEP_DIR.match(step_dir.name).group(1)),
            "tokens_seen": None, "heldout": None, "measured": None, "stale": False, "evaluated": False})
        metrics = read_checkpoint_metrics(step_dir) or {}
        if metrics.get("tokens_seen") is not None:
            pt["tokens_seen"] = metrics["tokens_seen"]
        if isinstance(metrics.get("heldout"), dict) and (metrics["heldout"].get("top1_at")
                                                         or metrics["heldout"].get("chain_tau")):
            pt["heldout"] = metrics["heldout"]
    out = []
    for pt in points.values():
        pt["simulated"] = heldout_simulated_tau({"offline": {"heldout": pt.pop("heldout")}}, 0.0, k)
        pt["k"] = k
        out.append(pt)
    return sorted(out, key=lambda p: (p["step"] is not None, p["step"] or 0))


def saturating(n, tau_inf: float, c: float, b: float):
    """τ(N) = τ∞ − c·N^(−b): rises with the data N and saturates at τ∞."""
    return tau_inf - c * n ** (-b)


def fit_saturating(tokens: list[float], taus: list[float]) -> dict:
    """Least-squares fit of τ(N) = τ∞ − c·N^(−b) (scipy curve_fit; τ∞ ≥ 1, c ≥ 0, b > 0) to (tokens, τ) points.

    Returns {ok: True, tau_inf, c, b, points, n_min, n_max, rmse} or {ok: False, points, why}. With exactly
    3 points the curve passes through them (3 parameters): it says so in `exact`."""
    import warnings

    import numpy as np
    from scipy.optimize import curve_fit

    pts = sorted((float(n), float(t)) for n, t in zip(tokens, taus)
                 if n is not None and t is not None and n > 0 and math.isfinite(float(n)) and math.isfinite(float(t)))
    if len({n for n, _ in pts}) < 3:
        return {"ok": False, "points": len(pts),
                "why": f"{len(pts)} point(s) at {len({n for n, _ in pts})} distinct token counts; "
                       "a 3-parameter fit needs at least 3"}
    n, y = np.array([p[0] for p in pts]), np.array([p[1] for p in pts])
    scale = float(n.max())  # fit on N / N_max: keeps c and the Jacobian well scaled
    p0 = [max(float(y.max()) + 0.1, 1.0 + 1e-6), max(float(y.max() - y.min()), 1e-3), 0.5]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "covariance could not be estimated" with 3 points: expected
            (tau_inf, c, b), _ = curve_fit(saturating, n / scale, y, p0=p0, maxfev=20000,
                                           bounds=([1.0, 0.0, 1e-6], [np.inf, np.inf, 20.0]))
    except (RuntimeError, ValueError) as err:
        return {"ok": False, "points": len(pts), "why": f"the fit failed ({str(err).splitlines()[0]})"}
    c = float(c) * scale ** float(b)  # back to raw tokens: c·(N/s)^(−b) = (c·s^b)·N^(−b)
    fit = {"ok": True, "tau_inf": float(tau_inf), "c": c, "b": float(b), "points": len(pts),
           "n_min": float(n.min()), "n_max": scale, "exact": len(pts) == 3}
    if not all(math.isfinite(fit[k]) for k in ("tau_inf", "c", "b")):
        return {"ok": False, "points": len(pts), "why": "the fit did not converge to finite parameters"}
    fit["rmse"] = float(np.sqrt(np.mean((saturating(n, fit["tau_inf"], c, fit["b"]) - y) ** 2)))
    return fit


def tokens_for_tau(fit: dict, tau: float) -> float | None:
    """N at which the fitted curve reaches τ; None when it never does (τ ≥ τ∞)."""
    if tau >= fit["tau_inf"]:
        return None
    if fit["c"] <= 0:
        return 0.0
    return (fit["c"] / (fit["tau_inf"] - tau)) ** (1.0 / fit["b"])


def tokens_text(n: float) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return f"{n:.0f}"


SCALING_SERIES = (("simulated", "simulated τ (held-out)"), ("measured", "measured τ (chain)"))


def scaling_fits(points: list[dict]) -> list[dict]:
    """One fit per (run, series): held-out simulated τ and measured τ against tokens_seen. A stale measured τ
    is not fitted."""
    fits = []
    for run in dict.fromkeys(p["run"] for p in points):
        for key, name in SCALING_SERIES:
            use = [p for p in points if p["run"] == run and p["tokens_seen"] is not None and p[key] is not None
                   and not (key == "measured" and p["stale"])]
            fit = fit_saturating([p["tokens_seen"] for p in use], [p[key] for p in use])
            if not use and not any(p["run"] == run and p["tokens_seen"] is not None for p in points):
                fit["why"] = "no checkpoint of this run records tokens_seen"
            fits.append({"run": run, "series": key, "name": name, "steps": [p["step"] for p in use], **fit})
    return fits


def fit_text(f: dict, many_runs: bool) -> str:
    who = f"{f['run']}, {f['name']}" if many_runs else f["name"]
    if not f["ok"]:
        return f"- {who}: no fit: {f['why']}."
    span = f"N = {tokens_text(f['n_min'])} … {tokens_text(f['n_max'])} tokens"
    exact = "; 3 points, 3 parameters: the curve passes through them" if f["exact"] else ""
    head = (f"- {who}: τ(N) = {f['tau_inf']:.3f} − {f['c']:.3g}·N^(−{f['b']:.3g}), fitted to {f['points']} "
            f"checkpoints ({span}, RMSE {f['rmse']:.3f}{exact}). ")
    need = tokens_for_tau(f, TAU_GOAL)
    if need is None:
        return head + (f"**τ = {TAU_GOAL}: not reached by the fit (τ∞ = {f['tau_inf']:.3f})** — an extrapolation "
                       f"from {f['points']} points.")
    if need <= f["n_max"]:
        return head + f"τ = {TAU_GOAL} at N ≈ {tokens_text(need)} tokens, inside the data seen."
    return head + (f"**τ = {TAU_GOAL} at N ≈ {tokens_text(need)} tokens ({need / f['n_max']:.3g}× the largest N "
                   f"seen) — an extrapolation from {f['points']} points**, τ∞ = {f['tau_inf']:.3f}.")


def scaling_table(points: list[dict]) -> str:
    k = ", ".join(sorted({str(p["k"]) for p in points}))
    header = ["run", "step", "tokens_seen", f"simulated τ (held-out, T=0, K={k})", f"measured τ (chain, T=0, K={k})"]
    rows = []
    for p in points:
        measured = num(p["measured"])
        if p["measured"] is not None and p["stale"]:
            measured += " ⚠ STALE (not fitted)"
        elif p["measured"] is None:
            measured = f"{DASH} (no T=0 result)" if p["evaluated"] else f"{DASH} (not evaluated)"
        seen = f"{int(p['tokens_seen']):,}" if p["tokens_seen"] is not None else f"{DASH} (not recorded)"
        rows.append([p["run"], str(p["step"]), seen, num(p["simulated"]), measured])
    return table(header, rows)


def scaling_section(points: list[dict], fits: list[dict], many_runs: bool, figure: str) -> str:
    missing = [p for p in points if p["tokens_seen"] is None]
    skipped = ""
    if missing:
        names = ", ".join(f"{p['run']}/{p['checkpoint']}" if many_runs else p["checkpoint"] for p in missing)
        skipped = (f"\n\n**{len(missing)} of {len(points)} checkpoint(s) have no `tokens_seen`** (trained before "
                   f"train/loop.py recorded it in metrics.json): left out of the plot and the fits: {names}. "
                   "Retrain (or train on) to record it.")
    return f"""## How much data buys how much τ
Every checkpoint's held-out simulated τ (the T=0 chain replayed at the run's eval K, `chain_tau`; checkpoints trained before it was measured: 1 + Σₖ Πᵢ≤ₖ top1_atᵢ, optimistic; from its metrics.json) and
measured τ (real chain decoding at T=0 on the eval prompts, eval K) against the training tokens it had seen
(`tokens_seen`: cumulative non-pad tokens over all ranks). Per series, a least-squares fit of the saturating
curve τ(N) = τ∞ − c·N^(−b) (τ∞ ≥ 1, c ≥ 0, b > 0). **Beyond the largest N seen the curve is an extrapolation**
(dashed in the plot, to {EXTRAPOLATE:g}× the data): a fit through a handful of checkpoints of one run, not a
measurement; checkpoints of one run also differ in learning-rate schedule position, not only in data.{skipped}

{scaling_table(points)}

Fits (goal: measured τ ≥ {TAU_GOAL}):
{chr(10).join(fit_text(f, many_runs) for f in fits)}

![τ vs training tokens]({figure})

"""


def scaling_summary(fits: list[dict]) -> str:
    """One stdout line: what the measured-τ fits say about τ = TAU_GOAL."""
    parts = []
    for f in fits:
        if f["series"] != "measured":
            continue
        if not f["ok"]:
            parts.append(f"{f['run']}: no fit ({f['why']})")
            continue
        need = tokens_for_tau(f, TAU_GOAL)
        parts.append(f"{f['run']}: " + (f"not reached by the fit (τ∞ = {f['tau_inf']:.3f})" if need is None else
                                        f"≈{tokens_text(need)} tokens") + f", extrapolation from {f['points']} points")
    return f"measured τ = {TAU_GOAL} (chain, T=0) vs training tokens: " + "; ".join(parts)


# ------------------------------------------------------------------------------ draft vocabulary coverage

def coverage_section(evals: list[dict], many_runs: bool) -> str:
    """EAGLE-3's reduced draft vocabulary: held-out coverage (target mass inside it) next to the coverage on the
    eval prompts: the same mass over the target's greedy continuations, and the share of its greedy tokens."""
    rows = []
    for e in evals:
        held = offline(e, "heldout", "vocab_coverage")
        if held is None and e.get("vocab_coverage_eval") is None and not e.get("draft_vocab_size"):
            continue
        eval_cov = e.get("vocab_coverage_eval")
        if eval_cov is None and "vocab_coverage_eval" not in e:
            eval_text = f"{DASH} (evaluated before it was measured)"
        else:
            eval_text = num(eval_cov) + (f" of {e['vocab_coverage_eval_tokens']} tokens"
                                         if e.get("vocab_coverage_eval_tokens") and eval_cov is not None else "")
        rows.append([label(e, many_runs), num(e.get("draft_vocab_size")), num(held),
                     num(offline(e, "prompts", "vocab_coverage")), eval_text])
    if not rows:
        return ""
    return ("## Draft vocabulary coverage (EAGLE-3)\n"
            "A token outside the reduced draft vocabulary can never be drafted, so at T=0 the share of the target's "
            "greedy tokens inside it caps first-draft acceptance. Held-out and prompts (mass): the target's "
            "probability mass (T=1) inside the draft vocabulary, averaged over positions; eval prompts (greedy tokens): "
            "the share of the target's plain greedy (T=0) output tokens on the eval prompts that lie in it.\n\n"
            + table(["checkpoint", "draft vocab size", "held-out (mass)", "eval prompts (mass, greedy cont.)",
                     "eval prompts (greedy tokens in draft vocab)"], rows) + "\n\n")


# ----------------------------------------------------------------------------------------- plots

def new_figure(ncols: int = 1):
    import matplotlib  # deferred: slow to import, and only the report draws

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(6.2 * ncols, 5.0), squeeze=False)
    return fig, list(axes[0])


def save_figure(fig, path: Path, footer: str) -> Path:
    import matplotlib.pyplot as plt

    wrapped = "\n".join(textwrap.wrap(footer, int(fig.get_figwidth() * 17)))  # ~chars per line at 6.5 pt
    fig.text(0.01, 0.005, wrapped, fontsize=6.5, va="bottom", ha="left", color="0.3")
    fig.tight_layout(rect=(0, 0.04 + 0.02 * wrapped.count("\n"), 1, 1))
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def plot_alpha_vs_predicted(evals, many_runs, path, footer) -> Path:
    """Like with like: the measured FIRST-draft α (alpha_at[0]) against the offline first-draft prediction:
    top-1 at T=0, predicted α = 1 − E[tvd] at T>0 (eval prompts: on continuations sampled at T); y = x."""
    temps = temperatures(evals)
    fig, axes = new_figure(len(temps))
    for ax, t in zip(axes, temps):
        key, what = ("top1", "top-1") if t == 0 else ("predicted_alpha", "predicted α = 1 − E[tvd]")
        for src, marker in (("heldout", "o"), ("prompts", "s")):
            pts = [(first_draft_prediction(e, src, t), (result_at(e, t).get("alpha_at") or [None])[0],
                    short_label(e, many_runs)) for e in evals]
            pts = [p for p in pts if p[0] is not None and p[1] is not None]
            if pts:
                where = src if src == "heldout" or t == 0 else "prompts, sampled cont."
                dist = column_label(evals, "prompts_sampled" if where.endswith("sampled cont.") else src, key)
                ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=f"{what} ({where}){dist}")
                for x, y, name in pts:
                    ax.annotate(name, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax.plot([0, 1], [0, 1], "k--", lw=0.8, label="y = x")
        ax.set(xlim=(0, 1), ylim=(0, 1), xlabel=f"offline first-draft {what}", ylabel="measured α at depth 1 (alpha_at[0])",
               title=f"first-draft α vs offline prediction, T={num(t, 1)} (labels: step)")
        ax.title.set_fontsize(9)
        ax.legend(fontsize=7)
    return save_figure(fig, path, footer)


def plot_alpha_vs_fkl(evals, many_runs, path, footer) -> Path:
    fig, (ax,) = new_figure()
    for t in temperatures(evals):
        for src, marker in (("heldout", "o"), ("prompts", "s")):
            pts = [(offline(e, src, "fkl"), (result_at(e, t).get("alpha_at") or [None])[0]) for e in evals]
            pts = [p for p in pts if None not in p]
            if pts:
                ax.scatter(*zip(*pts), marker=marker, label=f"T={num(t, 1)}, fkl on {src}{column_label(evals, src, 'fkl')}")
    ax.set(xlabel="offline fkl = KL(p ‖ q) (nats/token; labelled when truncated or restricted)",
           ylabel="measured α at depth 1 (alpha_at[0])", ylim=(0, 1),
           title="first-draft α vs offline forward KL, per checkpoint")
    ax.legend(fontsize=7)
    return save_figure(fig, path, footer)


def plot_tau_vs_k(evals, many_runs, path, footer) -> Path:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    temps = temperatures(evals)
    fig, axes = new_figure(len(temps))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, t in zip(axes, temps):
        for i, e in enumerate(evals):
            r = result_at(e, t)
            pts = tau_points(e, r)
            if not pts or r.get("alpha") is None:
                continue
            color = colors[i % len(colors)]
            ks = list(range(1, max(k for k, _ in pts) + 2))
            ax.plot(ks, [leviathan_tau(r["alpha"], k) for k in ks], "--", color=color, lw=0.9)
            ax.plot(*zip(*pts), "o-", color=color, label=f"{label(e, many_runs)} (α={r['alpha']:.2f})")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set(xlabel="K (drafted tokens per step)", ylabel="τ (tokens per target step)",
               title=f"measured τ (dots) vs Leviathan (1−α^(K+1))/(1−α) (dashed), T={num(t, 1)}")
        ax.title.set_fontsize(8)
        ax.legend(fontsize=7)
    return save_figure(fig, path, footer)


def plot_comparators(e: dict, path, footer) -> Path:
    names, values, colors = [], [], []
    for r in sorted(e["results"], key=lambda r: float(r["temperature"])):
        if r.get("speedup") is not None:
            names.append(f"ours {e['checkpoint']}\nT={num(float(r['temperature']), 1)}")
            values.append(r["speedup"])
            colors.append("C0")
    for c in COMPARATORS:
        entry = (e.get("comparators") or {}).get(c) or {}
        if entry.get("speedup") is not None:
            names.append(c)
            values.append(entry["speedup"])
            colors.append("C1")
    fig, (ax,) = new_figure()
    ax.bar(range(len(values)), values, color=colors)
    ax.set_xticks(range(len(names)), names, fontsize=7)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set(ylabel="speedup over plain autoregressive decoding (same run)",
           title=f"speedup on the same prompts: {e['_run']}/{e['checkpoint']} vs comparators")
    ax.title.set_fontsize(9)
    return save_figure(fig, path, footer)


def plot_time_split(evals, many_runs, path, footer) -> Path:
    """Left: ms per committed token, ours vs baseline. Right: α per draft depth."""
    from matplotlib.ticker import MaxNLocator

    fig, (ax, ax2) = new_figure(2)
    bars = []
    for e in evals:
        for r in sorted(e["results"], key=lambda r: float(r["temperature"])):
            draft = (r.get("ms_per_draft_step") or 0) * int(e.get("k") or 0)
            bars.append((f"{label(e, many_runs)}\nT={num(float(r['temperature']), 1)}", draft,
                         r.get("ms_per_verify") or 0, r.get("ms_per_token"), r.get("baseline_ms_per_token")))
    x = range(len(bars))
    ax.bar(x, [b[1] for b in bars], label="drafting per step (K × ms/draft step)")
    ax.bar(x, [b[2] for b in bars], bottom=[b[1] for b in bars], label="verify per step")
    ax.plot(x, [b[3] if b[3] is not None else math.nan for b in bars], "k^", label="ms per token (ours)")
    ax.plot(x, [b[4] if b[4] is not None else math.nan for b in bars], "rv", label="ms per token (baseline)")
    ax.set_xticks(list(x), [b[0] for b in bars], fontsize=6, rotation=30)
    ax.set(ylabel="milliseconds", title="where the time goes, per step and per token")
    ax.legend(fontsize=7)
    for e in evals:
        for r in e["results"]:
            if r.get("alpha_at"):
                ax2.plot(range(1, len(r["alpha_at"]) + 1), r["alpha_at"], "o-",
                         label=f"{label(e, many_runs)} T={num(float(r['temperature']), 1)}")
    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.set(xlabel="draft depth i", ylabel="α at depth i (given depths < i accepted)", ylim=(0, 1),
            title="acceptance per draft depth")
    ax2.legend(fontsize=6)
    return save_figure(fig, path, footer)


def plot_tau_vs_tokens(points: list[dict], fits: list[dict], many_runs: bool, path, footer) -> Path:
    """Simulated (hollow) and measured (filled) τ per checkpoint against tokens seen, log x; per series its fitted
    curve, solid over the data and dashed (labelled "extrapolation") up to EXTRAPOLATE× the largest N."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax,) = new_figure()
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    runs = list(dict.fromkeys(p["run"] for p in points))
    plotted = False
    for i, run in enumerate(runs):
        for j, (key, name) in enumerate(SCALING_SERIES):
            color = colors[(2 * i + j) % len(colors)]
            pts = [(p["tokens_seen"], p[key]) for p in points if p["run"] == run and p["tokens_seen"] is not None
                   and p[key] is not None and not (key == "measured" and p["stale"])]
            if not pts:
                continue
            plotted = True
            who = f"{run}: {name}" if many_runs else name
            ax.plot(*zip(*pts), "s" if key == "measured" else "o", color=color,
                    mfc=color if key == "measured" else "none", label=who)
            f = next((f for f in fits if f["run"] == run and f["series"] == key), None)
            if f and f["ok"]:
                seen = np.geomspace(f["n_min"], f["n_max"], 50)
                ahead = np.geomspace(f["n_max"], EXTRAPOLATE * f["n_max"], 50)
                ax.plot(seen, saturating(seen, f["tau_inf"], f["c"], f["b"]), "-", color=color, lw=1,
                        label=f"{who} fit, τ∞ = {f['tau_inf']:.2f}")
                end = saturating(ahead, f["tau_inf"], f["c"], f["b"])
                ax.plot(ahead, end, "--", color=color, lw=1, label=f"{who} fit: extrapolation ({EXTRAPOLATE:g}×)")
                ax.annotate("extrapolation", (ahead[-1], end[-1]), fontsize=7, color=color, ha="right",
                            xytext=(0, 4), textcoords="offset points")
    ax.axhline(TAU_GOAL, color="k", ls=":", lw=0.8, label=f"goal τ = {TAU_GOAL}")
    if plotted:
        ax.set_xscale("log")
    else:
        ax.set_ylim(1.0, TAU_GOAL + 0.3)
        ax.text(0.5, 0.4, "no checkpoint records tokens_seen\n(trained before train/loop.py recorded it)",
                transform=ax.transAxes, ha="center", va="center", fontsize=9)
    ax.set(xlabel="training tokens seen (cumulative, non-pad, all ranks)", ylabel="τ at T=0 (tokens per target step)",
           title="τ vs training data: simulated (held-out, hollow) and measured (filled), τ(N) = τ∞ − c·N^(−b)")
    ax.title.set_fontsize(8)
    ax.legend(fontsize=6)
    return save_figure(fig, path, footer)


# ----------------------------------------------------------------------------------- TensorBoard

def write_tensorboard(run_dir: Path, evals: list[dict]) -> None:
    from torch.utils.tensorboard import SummaryWriter

    for old in layout.tb_dir(run_dir).glob("events.out.tfevents.*.report"):
        old.unlink()  # our own previous report's scalars: a rerun replaces them instead of doubling them
    writer = SummaryWriter(str(layout.tb_dir(run_dir)), filename_suffix=".report")
    for e in evals:
        if e["step"] is None:
            continue
        step = int(e["step"])
        for src in ("heldout", "prompts"):
            for k in OFFLINE_KEYS:
                if offline(e, src, k) is not None:
                    writer.add_scalar(f"eval/offline_{src}/{k}", offline(e, src, k), step)
        for r in e["results"]:
            t = f"T{float(r['temperature']):g}"
            for k in ("tau", "alpha", "speedup", "tokens_per_s", "ms_per_token", "predicted_tau_leviathan"):
                if isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool):
                    writer.add_scalar(f"eval/{t}/{k}", r[k], step)
            for i, a in enumerate(r.get("alpha_at") or []):
                writer.add_scalar(f"eval/{t}/alpha_at_{i}", a, step)
    writer.close()


# ------------------------------------------------------------------------------------------ report

def run(recipe, args) -> None:
    names = list(getattr(args, "runs", None) or [recipe.run_name])
    root = recipe.run_dir.parent
    for name in names:
        if not (root / name).is_dir():
            raise SpecdistillError(f"--runs {name}: no run directory {root / name}")
    runs = {name: load_evals(root / name) for name in names}
    for name in names:  # the recipe's own eval settings apply to its own run only
        own = name == recipe.run_name
        check_freshness(runs[name], root / name, eval_settings(recipe) if own else None,
                        run_key(recipe) if own else None)
    out_dir = root / names[0] if len(names) == 1 else root / f"compare-{'-'.join(names)}"
    runs_flag = f" --runs {' '.join(names)}" if getattr(args, "runs", None) else ""
    command = f"specdistill report --recipe {recipe.source}{runs_flag}"
    path, headline = write_report(runs, out_dir, command, run_dirs={name: root / name for name in names})
    for name in names:
        write_tensorboard(root / name, runs[name])
    print(f"report: {path}")
    print(headline)
    print(scaling_summary(scaling_fits([p for name in names
                                        for p in scaling_points(name, runs[name], root / name)])))


def write_report(runs: dict[str, list[dict]], out_dir: Path, command: str,
                 run_dirs: dict[str, Path] | None = None) -> tuple[Path, str]:
    """Write out_dir/report.md and its PNGs; return the path and the headline line. run_dirs: each run's
    directory, for the checkpoints that were never evaluated (the τ-vs-tokens points)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    evals = [e for es in runs.values() for e in es]
    points = [p for name, es in runs.items() for p in scaling_points(name, es, (run_dirs or {}).get(name))]
    fits = scaling_fits(points)
    many = len(runs) > 1
    footer = provenance(evals, command)
    best = best_checkpoint(evals)
    t0 = temperatures(evals)[0]
    rb = result_at(best, t0)
    headline = (f"headline checkpoint: {label(best, True)} (rule: {HEADLINE_RULES[best['_headline_rule']]}), "
                f"T={num(t0, 1)}: τ {num(rb.get('tau'))}{ci(rb, 'tau')}, α {num(rb.get('alpha'))}{ci(rb, 'alpha')}, "
                f"speedup {num(rb.get('speedup'), 2)}x{ci(rb, 'speedup', 2)}"
                f"{' (95% bootstrap over prompts)' if rb.get('speedup_ci95') else ''}, lossless {num(rb.get('lossless'))}")
    figures = {
        "alpha_vs_predicted.png": plot_alpha_vs_predicted(evals, many, out_dir / "alpha_vs_predicted.png", footer),
        "alpha_vs_fkl.png": plot_alpha_vs_fkl(evals, many, out_dir / "alpha_vs_fkl.png", footer),
        "tau_vs_k.png": plot_tau_vs_k(evals, many, out_dir / "tau_vs_k.png", footer),
        "comparators.png": plot_comparators(best, out_dir / "comparators.png", footer),
        "time_split.png": plot_time_split(evals, many, out_dir / "time_split.png", footer),
        "tau_vs_tokens.png": plot_tau_vs_tokens(points, fits, many, out_dir / "tau_vs_tokens.png", footer),
    }
    scaling = scaling_section(points, fits, many, figures["tau_vs_tokens.png"].name)
    text = render(runs, evals, many, best, headline, footer, command, figures, scaling)
    write_text_atomic(out_dir / "report.md", text)
    return out_dir / "report.md", headline


def notes(evals: list[dict], key: str) -> str:
    found = sorted({e[key] for e in evals if e.get(key)})
    return ("\n\n" + "\n".join(f"Note (eval): {n}" for n in found)) if found else ""


def best_k_notes(evals: list[dict]) -> str:
    found = sorted({r["best_k_from"] for e in evals for r in e["results"] if r.get("best_k_from")})
    return ("\n\n" + "\n".join(f"Best K (eval): {n}" for n in found)) if found else ""


def methods_section(runs) -> str:
    return f"""## Runs side by side (last checkpoint of each run)
Same prompts and lengths; speedup against each run's own baseline measured in the same eval. `(chain)`:
trees are verified greedily, so at T>0 the tree drafter falls back to the exact chain (eval/tree.py) and
its numbers are the chain's.

{methods_table(runs)}

"""


def stale_section(evals: list[dict]) -> str:
    """A visible block listing results that do not match their checkpoint or the recipe (check_freshness)."""
    stale = [e for e in evals if e.get("_stale")]
    if not stale:
        return ""
    lines = [f"- `{e['_file']}`: " + "; ".join(e["_stale"]) for e in stale]
    return ("## ⚠ Stale or unverified results\nThese results do not match the checkpoint on disk or the recipe's "
            "eval settings; they are marked ⚠ STALE below and are not chosen as the headline while a fresh one "
            "exists. Rerun `specdistill eval` to replace them.\n\n" + "\n".join(lines) + "\n\n")


def render(runs, evals, many, best, headline, footer, command, figures, scaling: str = "") -> str:
    evaluate = command.split(" --runs")[0].replace("specdistill report", "specdistill eval", 1)
    note = "   # with each run's own recipe" if many else ""
    reproduce = f"{evaluate}{note}   # writes checkpoints/<run>/eval/<checkpoint>.json\n{command}"
    return f"""# specdistill report: {', '.join(runs)}

**{headline}**

Produced from {len(evals)} eval result(s): {', '.join(f'`{e["_file"]}`' for e in evals)}.
What produced every number and figure below: {footer}

Reproduce:
```sh
{reproduce}
```

{stale_section(evals)}## Checkpoints: offline prediction vs measured decoding
Offline metrics on the held-out split and on the eval prompts (`—`: not measured). Measured α, τ and
speedup come from real speculative decoding; speedup is a ratio to plain autoregressive decoding of the
same target measured in the same run; lossless = token-identical to our own plain greedy decoding and
("vs generate()") to transformers' greedy `generate()` (T=0), or a passed distribution test (T>0).
Compare like with like: the offline top-1 and predicted α are teacher-forced *first-draft* numbers, so
they predict α₁ (the measured acceptance at depth 1, `alpha_at[0]`), not the pooled α; pooled α and τ
are predicted by the held-out simulated τ = 1 + Σₖ Πᵢ≤ₖ αᵢ from per-depth held-out acceptance (EAGLE
heads drafting on their own states; `—` where the draft kind has none). A label in a header says what distribution an
offline number is over: `top-k+tail` = the k cached ids plus one bucket for the rest (fkl and tvd are then
lower bounds, pred α an upper bound), `draft vocab` = EAGLE-3's draft vocabulary with p renormalised.
Intervals: 95% bootstrap over prompts.{notes(evals, "lossless_note")}

{checkpoint_table(evals, many)}

![measured α vs predicted α]({figures['alpha_vs_predicted.png'].name})

*Measured first-draft α (α₁ = `alpha_at[0]`) against the offline first-draft number that predicts it:
top-1 agreement at T=0 (greedy verification accepts when the argmaxes agree), predicted α = 1 − E[tvd]
at T>0 (on the eval prompts: over continuations sampled at that temperature); dashed: y = x. {footer}*

![measured α vs fkl]({figures['alpha_vs_fkl.png'].name})

*Measured first-draft α against the offline forward KL of each checkpoint (labelled when over a
truncated or restricted distribution). {footer}*

{scaling}{coverage_section(evals, many)}## τ per K against Leviathan's curve
Dashed: E = (1 − α^(K+1)) / (1 − α) with the measured α; dots: measured τ. The gap shows that
acceptance is not i.i.d. across draft depths. The table adds the held-out simulated τ at each K, the
offline prediction of τ (depths past the unrolled ones repeat the deepest one's acceptance).{best_k_notes(evals)}

{tau_k_table(evals, many)}

![tau vs K]({figures['tau_vs_k.png'].name})

*{footer}*

## Comparators on the same prompts
Speedups over our own plain autoregressive baseline of the same run (tokens/s in brackets).{notes(evals, "comparators_note")}

{comparator_table(evals, many)}

![comparators]({figures['comparators.png'].name})

*Headline checkpoint {label(best, True)} against transformers' own generation modes. {footer}*

{methods_section(runs) if many else ""}## Chain vs tree drafting (T=0)
For a tree, α per depth is the share of steps whose accepted path went one level deeper; its τ is the
accepted path length + 1. At T>0 trees fall back to the exact chain (eval/tree.py).

{chain_vs_tree_table(evals, many)}

## What a step costs (`eval.runtime`)
Per step, speedup = τ / (K·d + v(K+1)): v(M) = a forward over M new tokens ÷ a 1-token forward, d = a draft
step ÷ a 1-token forward, both measured in the eval's own runtime (M = 1..9 after a 128-token cached prefix;
the largest M is the tree's size when there is a tree). The τ-per-K table above puts the speedup these costs
predict beside the measured one; with these costs a draft breaks even at τ = K·d + v(K+1).

{cost_table(evals, many)}

## Where the time goes; α per draft depth
{time_table(evals, many)}

![time split]({figures['time_split.png'].name})

*{footer}*

## Per prompt category ({label(best, True)})
{category_table(best)}
"""
