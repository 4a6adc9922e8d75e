"""How much data buys how much τ: held-out simulated and measured τ of every checkpoint against the training
tokens it had seen, a fitted saturating curve τ(N) = τ∞ − c·N^(−b), and the tokens it predicts for a goal."""
from __future__ import annotations

import math
from pathlib import Path

from specdistill import layout
from specdistill.eval.results import checkpoint_metrics, heldout_simulated_tau, result_at
from specdistill.eval.tables import DASH, num, table


TAU_GOAL = 1.6  # issue 20's goal: measured τ at T=0 on MT-bench (issue 12 asked for 2.2)


EXTRAPOLATE = 10.0  # the fitted curve is drawn (dashed) up to this multiple of the largest tokens_seen


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
        metrics = checkpoint_metrics(step_dir)
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
    return f"training tokens the fit puts at measured τ {TAU_GOAL} (chain, T=0): " + "; ".join(parts)
