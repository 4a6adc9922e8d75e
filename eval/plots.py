"""The report's figures (matplotlib, Agg), each with a footer saying what produced it."""
from __future__ import annotations

import math
import os
import textwrap
from pathlib import Path

from specdistill.eval.results import column_label, first_draft_prediction, offline, result_at, temperatures
from specdistill.eval.scaling import EXTRAPOLATE, SCALING_SERIES, TAU_GOAL, saturating
from specdistill.eval.tables import COMPARATORS, label, num, short_label, tau_points
from specdistill.metrics import leviathan_tau


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
