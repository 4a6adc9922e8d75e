"""The `report` stage: report.md + PNG plots + TensorBoard scalars from the eval results the recipe names
(checkpoints/<run>/eval/<checkpoint>.<prompt set>.<runtime>.json, layout.eval_result).

What it shows (definitions: docs/METRICS.md):
  - lines 2-5, the honest answer first (`head`): the speedup over the fastest plain decoding timed in the same run
    (named, with its 95% interval; "not timed" where only ours was) with prompt lookup beside it, under it vLLM's
    plain decoding where `specdistill served` timed it after the eval (on a CPU it has been the fastest plain
    decoding of every run), lossless or not per method (chain, tree, prompt lookup), the held-out simulated τ against
    the measured τ, then the headline;
  - one row per checkpoint: offline fkl / tvd / predicted α / top-1 (held-out and eval prompts) next to
    the measured α, τ, speedup and lossless flag per temperature;
  - measured α against what should predict it: predicted α = 1 − E[tvd] for T > 0, top-1 for T = 0
    (greedy verification accepts exactly when the argmaxes agree); and measured α against fkl;
  - measured τ per K against Leviathan's E = (1 − α^(K+1)) / (1 − α) with the measured α;
  - the comparators' speedups on the same prompts; where the time goes; α per draft depth;
  - how much data buys how much τ: held-out simulated and measured τ of every checkpoint against the training
    tokens it had seen, with a fitted saturating curve τ(N) = τ∞ − c·N^(−b) extrapolated to 10× the data;
  - the draft vocabulary's coverage (EAGLE-3): held-out, and of the target's greedy outputs on the eval prompts;
  - first, where `specdistill served` ran: whether vLLM serving each export agrees with our eval (the parity
    gate: fit to deploy, or not and why) and vLLM's own numbers beside ours (eval/served_tables.py).
`--runs A B C` puts several runs in one report: checkpoints/compare-A-B-C/report.md.
"""
from __future__ import annotations

import time
from pathlib import Path

from specdistill import layout
from specdistill.errors import SpecdistillError
from specdistill.eval.plots import (plot_alpha_vs_fkl, plot_alpha_vs_predicted, plot_comparators, plot_tau_vs_k,
                                    plot_tau_vs_tokens, plot_time_split)
from specdistill.eval.results import (check_freshness, eval_settings, heldout_simulated_tau, load_evals, offline,
                                      recipe_runtime, result_at, run_key, temperatures)
from specdistill.eval.served_tables import served_summary, speed_line
from specdistill.eval.workload_tables import workload_section
from specdistill.eval.scaling import scaling_fits, scaling_points, scaling_section, scaling_summary
from specdistill.eval.tables import (DASH, NOT_TIMED, category_table, chain_vs_tree_table, checkpoint_table, ci,
                                     comparator_table, cost_table, coverage_section, fastest_was_timed, label,
                                     methods_table, num, plain_text, plain_timed, runtime_text, tau_k_table,
                                     time_table, tree_label, tree_lossless, vs_fastest_value)
from specdistill.formats import read_json, write_text_atomic
from specdistill.metrics import OFFLINE_KEYS


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


def timed_with(best: dict, evals: list[dict], t: float) -> dict | None:
    """The eval whose plain decoders besides ours were timed at T=t: the headline checkpoint's own where they were,
    else the latest fresh one of the same run that timed them (comparators run with the last checkpoint only)."""
    if fastest_was_timed(best, result_at(best, t)):
        return best
    same_run = [e for e in evals if e.get("_run") == best.get("_run") and fastest_was_timed(e, result_at(e, t))]
    fresh = [e for e in same_run if not e.get("_stale")] or same_run
    return max(fresh, key=lambda e: (e["step"] is not None, e["step"] or 0), default=None)


def speedup_head(best: dict, evals: list[dict], t: float) -> str:
    """Line 2: the speedup over the fastest plain decoding measured in the same run (named), its interval, and
    prompt lookup over the same decoder; "not timed" where only our own plain decoding was timed."""
    r = result_at(best, t)
    where = f"{label(best, True)}, chain K={best.get('k')}, T={num(t, 1)}"
    other = timed_with(best, evals, t)
    if other is None:
        return (f"- **Speedup over the fastest plain decoding: {NOT_TIMED}** ({where}: no plain decoder besides our own "
                f"({runtime_text(best.get('runtime'))}) was timed in this run, so no comparison was made; over our own "
                f"plain decoding {num(r.get('speedup'), 2)}x{ci(r, 'speedup', 2)}); prompt lookup: {NOT_TIMED}")
    ro = result_at(other, t)
    fastest, comps = ro.get("fastest_plain"), other.get("comparators") or {}
    tps = {n: ro.get("baseline_tokens_per_s") if n == "ours" else (comps.get(n) or {}).get("tokens_per_s")
           for n in plain_timed(other, ro)}
    timed = ", ".join(f"{n} {num(v, 1)}" for n, v in tps.items())
    text = f"- **Speedup over the fastest plain decoding measured in the same run: {vs_fastest_value(ro)}** "
    if other is best:
        text += f"({where}; 95% bootstrap over prompts)"
    else:
        text += (f"({label(other, True)}, chain K={other.get('k')}, T={num(t, 1)}: the plain decoders were timed with it, "
                 f"not with the headline {label(best, True)}, for which they are {NOT_TIMED})")
    text += f" over **{fastest}** = {plain_text(other, fastest)} (plain tok/s: {timed})"
    lookup = (other.get("comparators") or {}).get("hf_prompt_lookup")
    if not lookup:
        return text + f"; prompt lookup: {NOT_TIMED}"
    over = (f"{num(lookup['speedup_vs_fastest_plain'], 2)}x{ci(lookup, 'speedup_vs_fastest_plain', 2)}"
            if lookup.get("speedup_vs_fastest_plain") is not None
            else f"{num(lookup['tokens_per_s'] / ro['fastest_plain_tokens_per_s'], 2)}x"
            if ro.get("fastest_plain_tokens_per_s") else f"{num(lookup.get('speedup'), 2)}x over our own plain decoding")
    return text + f"; **prompt lookup** (transformers, n-gram drafts from the prompt) beside it: {over}"


def lossless_head(best: dict, evals: list[dict], t: float) -> str:
    """Line 3: lossless or not, per method (chain, tree, prompt lookup), at the headline temperature."""
    def flag(x) -> str:
        return {True: "yes", False: "NOT lossless", None: DASH}[x]

    def vs_hf(x) -> str:
        return "" if x is None else f" (vs transformers' fp32 generate(): {'yes' if x else 'NO'})"

    if t > 0:
        return (f"- **Lossless** at T={num(t, 1)}: checked by the distribution test, not token by token "
                "(tests/test_engine.py); the tree drafter runs the exact chain at T>0")
    r = result_at(best, t)
    parts = [f"chain K={best.get('k')} {flag(r.get('lossless'))}{vs_hf(r.get('lossless_vs_transformers'))}"]
    tree = r.get("tree")
    parts.append(f"{tree_label(tree['shape'])} {flag(tree_lossless(tree))}{vs_hf(tree.get('lossless_vs_transformers'))}"
                 if tree else "tree: not run")
    other = timed_with(best, evals, t) or best
    lookup = (other.get("comparators") or {}).get("hf_prompt_lookup")
    if not lookup:
        parts.append(f"prompt lookup: {NOT_TIMED}")
    else:
        parts.append(f"prompt lookup {flag(lookup.get('lossless'))} (vs generate() on the same weights)"
                     f"{vs_hf(lookup.get('lossless_vs_transformers'))}" if "lossless" in lookup
                     else "prompt lookup: not checked (evaluated before it was)")
    return f"- **Lossless** at T=0 (token-identical to plain greedy decoding), {label(best, True)}: " + "; ".join(parts)


def tau_gap_head(best: dict, t: float) -> str:
    """Line 4: the held-out simulated τ (the offline prediction) against the measured τ."""
    r = result_at(best, t)
    sim, tau = heldout_simulated_tau(best, t), r.get("tau")
    if sim is None or tau is None:
        return (f"- **Held-out simulated τ vs measured τ** ({label(best, True)}, T={num(t, 1)}): simulated not measured "
                f"(none for this draft kind or checkpoint); measured τ {num(tau)}{ci(r, 'tau')}")
    return (f"- **Held-out simulated τ vs measured τ** ({label(best, True)}, T={num(t, 1)}, K={best.get('k')}): "
            f"simulated {num(sim)}, measured {num(tau)}{ci(r, 'tau')}: gap {sim - tau:+.3f} (simulated − measured)")


def head(best: dict, evals: list[dict], t: float, headline: str) -> list[str]:
    """report.md's lines 2-5: the honest answer first (speedup over the fastest plain decoding with its interval and
    prompt lookup beside it; lossless per method; simulated vs measured τ), then the headline checkpoint."""
    return [speedup_head(best, evals, t), lossless_head(best, evals, t), tau_gap_head(best, t), f"- {headline}"]


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


def write_tensorboard(run_dir: Path, evals: list[dict]) -> None:
    """The eval's numbers as TensorBoard scalars beside training's, per checkpoint step (tensorboard's own event
    writer: torch's SummaryWriter would make the report import torch)."""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    for old in layout.tb_dir(run_dir).glob("events.out.tfevents.*.report"):
        old.unlink()  # our own previous report's scalars: a rerun replaces them instead of doubling them
    writer = EventFileWriter(str(layout.tb_dir(run_dir)), filename_suffix=".report")

    def scalar(tag: str, value: float, step: int) -> None:
        writer.add_event(Event(wall_time=time.time(), step=step,
                               summary=Summary(value=[Summary.Value(tag=tag, simple_value=float(value))])))

    for e in evals:
        if e["step"] is None:
            continue
        step = int(e["step"])
        for src in ("heldout", "prompts"):
            for k in OFFLINE_KEYS:
                if offline(e, src, k) is not None:
                    scalar(f"eval/offline_{src}/{k}", offline(e, src, k), step)
        for r in e["results"]:
            t = f"T{float(r['temperature']):g}"
            for k in ("tau", "alpha", "speedup", "tokens_per_s", "ms_per_token", "predicted_tau_leviathan"):
                if isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool):
                    scalar(f"eval/{t}/{k}", r[k], step)
            for i, a in enumerate(r.get("alpha_at") or []):
                scalar(f"eval/{t}/alpha_at_{i}", a, step)
    writer.close()


def run(recipe, args) -> None:
    names = list(getattr(args, "runs", None) or [recipe.run_name])
    root = recipe.run_dir.parent
    for name in names:
        if not (root / name).is_dir():
            raise SpecdistillError(f"--runs {name}: no run directory {root / name}")
    runtime = recipe_runtime(recipe)  # every run's results on the recipe's prompt set in its runtime
    runs = {name: load_evals(root / name, recipe.eval, runtime) for name in names}
    for name in names:  # the recipe's own eval settings apply to its own run only
        own = name == recipe.run_name
        check_freshness(runs[name], root / name, eval_settings(recipe) if own else None,
                        run_key(recipe, runtime) if own else None)
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
    """Write out_dir/report.md and its PNGs; return the path and its first lines (the honest answer and the
    headline, as the console prints them). run_dirs: each run's
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
    runtime = f" ({best['runtime']})" if best.get("runtime") else ""
    headline = (f"headline checkpoint: {label(best, True)} (rule: {HEADLINE_RULES[best['_headline_rule']]}), "
                f"T={num(t0, 1)}: τ {num(rb.get('tau'))}{ci(rb, 'tau')}, α {num(rb.get('alpha'))}{ci(rb, 'alpha')}, "
                f"speedup {num(rb.get('speedup'), 2)}x{ci(rb, 'speedup', 2)}"
                f"{' (95% bootstrap over prompts)' if rb.get('speedup_ci95') else ''} over our own plain decoding"
                f"{runtime}, lossless {num(rb.get('lossless'))}")
    figures = {
        "alpha_vs_predicted.png": plot_alpha_vs_predicted(evals, many, out_dir / "alpha_vs_predicted.png", footer),
        "alpha_vs_fkl.png": plot_alpha_vs_fkl(evals, many, out_dir / "alpha_vs_fkl.png", footer),
        "tau_vs_k.png": plot_tau_vs_k(evals, many, out_dir / "tau_vs_k.png", footer),
        "comparators.png": plot_comparators(best, out_dir / "comparators.png", footer),
        "time_split.png": plot_time_split(evals, many, out_dir / "time_split.png", footer),
        "tau_vs_tokens.png": plot_tau_vs_tokens(points, fits, many, out_dir / "tau_vs_tokens.png", footer),
    }
    scaling = scaling_section(points, fits, many, figures["tau_vs_tokens.png"].name)
    lines = head(best, evals, t0, headline)
    served_speed = vllm_plain_head(best, run_dirs or {})
    if served_speed:  # the eval ran before vLLM's plain decoding was timed: said right under the eval's fastest
        lines.insert(1, served_speed)
    text = render(runs, evals, many, best, lines, footer, command, figures, scaling, served_section(run_dirs or {}))
    text += workload_section(run_dirs or {})
    write_text_atomic(out_dir / "report.md", text)
    return out_dir / "report.md", "\n".join(line.removeprefix("- ").replace("**", "") for line in lines)


def vllm_plain_head(best: dict, run_dirs: dict[str, Path]) -> str | None:
    """Our plain decoding and chain beside vLLM's plain decoding, where `specdistill served` timed it for the headline
    checkpoint: the fastest plain decoding of the run may be vLLM's (eval/served_tables.py speed_line)."""
    run_dir = run_dirs.get(best.get("_run"))
    path = layout.served_dir(run_dir) / f"{best.get('checkpoint')}.json" if run_dir else None
    if not (path and path.is_file()):
        return None
    return speed_line(read_json(path), "**Plain decoding timed by `specdistill served` (vLLM, same prompts), T=0:**")


def served_section(run_dirs: dict[str, Path]) -> str:
    """What vLLM measured of each run's exports (served/<checkpoint>.json), on the first screen: a head whose
    served numbers disagree with ours is not fit to deploy, and that is the first thing a reader must see."""
    parts = []
    for name, run_dir in run_dirs.items():
        for path in sorted(layout.served_dir(run_dir).glob("*.json")):
            record = read_json(path)
            parts.append(f"### {name} / {record['checkpoint']} (`{path.relative_to(run_dir.parent)}`)\n\n"
                         f"{served_summary(record)}\n")
    if not parts:
        return ""
    return ("## Served by vLLM: the exports measured where they are deployed\n"
            "`specdistill served` serves each export with the command its README gives and decodes the same "
            "prompts in vLLM. Fit to deploy: every tensor loaded, vLLM lossless at T=0, and at each temperature the "
            "interval of served τ − ours (prompts paired; a 5% error shared over the temperatures) holds 0.\n\n"
            + "\n".join(parts) + "\n")


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


def render(runs, evals, many, best, head_lines, footer, command, figures, scaling: str = "", served: str = "") -> str:
    evaluate = command.split(" --runs")[0].replace("specdistill report", "specdistill eval", 1)
    note = "   # with each run's own recipe" if many else ""
    reproduce = f"{evaluate}{note}   # writes checkpoints/<run>/eval/<checkpoint>.<prompt set>.<runtime>.json\n{command}"
    lines = "\n".join(head_lines)
    return f"""# specdistill report: {', '.join(runs)}
{lines}

{served}Produced from {len(evals)} eval result(s): {', '.join(f'`{e["_file"]}`' for e in evals)}.
What produced every number and figure below: {footer}

Reproduce:
```sh
{reproduce}
```

{stale_section(evals)}## Checkpoints: offline prediction vs measured decoding
Offline metrics on the held-out split and on the eval prompts (`—`: not measured). Measured α, τ and
speedup come from real speculative decoding; speedup is a ratio to plain autoregressive decoding of the
same target measured in the same run; speedup vs fastest plain = over the fastest of our plain decoding and the plain
comparators (`hf_generate`, `plain_static-fp32` or `plain_static-bf16`) timed for that checkpoint and temperature, `not timed` where only
ours was (they run at T=0, with the last checkpoint); lossless = token-identical to our own plain greedy decoding and
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
Speedups over our own plain autoregressive baseline of the same run (tokens/s in brackets; `not lossless`: a
speculative comparator whose output differed from transformers' own plain greedy `generate()` or from the float32
reference).{notes(evals, "comparators_note")}

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
