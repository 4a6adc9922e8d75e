"""The report's markdown tables (and the number and name formatting the figures share)."""
from __future__ import annotations

from specdistill import kinds
from specdistill.eval.results import column_label, heldout_simulated_tau, offline, result_at, temperatures
from specdistill.metrics import OFFLINE_KEYS, leviathan_tau


COMPARATORS = ("hf_generate", "hf_prompt_lookup", "hf_assisted")
FP32_PLAIN = "plain_static-fp32"  # the comparator decoding plainly in our static runtime in fp32 (beside bf16)
BF16_PLAIN = "plain_static-bf16"  # ... in bf16, beside an fp32 runtime where bf16 is native
PLAIN_COMPARATORS = ("hf_generate", FP32_PLAIN, BF16_PLAIN)  # the comparators that decode plainly (no drafts): candidates for the fastest
FAMILY_TEXT = {"static": "our static runtime", "eager": "our engine on transformers' forward",
               "compiled": "our static runtime under torch.compile"}
NOT_TIMED = "not timed"


DASH = "—"


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


def ci(r: dict, key: str, digits: int = 3) -> str:
    """' [low, high]' for a result's 95% bootstrap interval, '' when it has none."""
    v = r.get(f"{key}_ci95")
    return f" [{num(float(v[0]), digits)}, {num(float(v[1]), digits)}]" if v else ""


def runtime_text(runtime: str | None) -> str:
    """'static-bf16' -> 'our static runtime in bf16'."""
    family, _, dtype = str(runtime or "").partition("-")
    if family in FAMILY_TEXT and dtype:
        return f"{FAMILY_TEXT[family]} in {dtype}"
    return f"our runtime {runtime}" if runtime else "its runtime not recorded"


def plain_text(e: dict, name: str) -> str:
    """What a plain decoder of a result is, in words: ours, transformers' generate(), our static runtime's other dtype."""
    dtype = str(e.get("runtime") or "").partition("-")[2]
    if name == "ours":
        return f"our own plain decoding ({runtime_text(e.get('runtime'))})"
    if name == "hf_generate":
        return f"transformers generate(){f' in {dtype}' if dtype else ''}"
    if name in (FP32_PLAIN, BF16_PLAIN):
        return f"our own plain decoding in our static runtime in {name.rpartition('-')[2]}"
    return name


def plain_timed(e: dict, r: dict) -> list[str] | None:
    """The plain decoders timed for this checkpoint at this temperature (`plain_timed`; for results written before
    it, read from the comparators: timed at T=0, with the checkpoint that ran them); None where the result
    records no speedup over the fastest plain decoding at all."""
    if r.get("plain_timed"):
        return list(r["plain_timed"])
    if "fastest_plain" not in r:
        return None
    comps = e.get("comparators") or {}
    return ["ours", *([n for n in PLAIN_COMPARATORS if n in comps] if float(r.get("temperature", 0)) == 0 else [])]


def fastest_was_timed(e: dict, r: dict) -> bool:
    """Whether any plain decoder besides our own was timed, so a speedup over "the fastest" compares something."""
    timed = plain_timed(e, r)
    return bool(timed) and len(timed) > 1


def vs_fastest_cell(e: dict, r: dict, entry: dict | None = None, unit: str = "") -> str:
    """The speedup over the fastest plain decoding of `entry` (default the chain's result), with its interval and
    the decoder it was over; "not timed" where only our own plain decoding was timed; — where not recorded."""
    entry = r if entry is None else entry
    if plain_timed(e, r) is None or entry.get("speedup_vs_fastest_plain") is None:
        return DASH
    if not fastest_was_timed(e, r):
        return NOT_TIMED
    return f"{vs_fastest_value(entry, unit)} (vs {r.get('fastest_plain')})"


def vs_fastest_value(entry: dict, unit: str = "x") -> str:
    """'1.16x [1.05, 1.27]': entry's speedup over the fastest plain decoding and its 95% interval (where recorded)."""
    return f"{num(entry['speedup_vs_fastest_plain'], 2)}{unit}{ci(entry, 'speedup_vs_fastest_plain', 2)}"


def tree_lossless(t: dict) -> bool | None:
    """A tree is lossless when token-identical to plain greedy decoding and (where checked) to transformers'."""
    flags = [t.get("lossless"), t.get("lossless_vs_transformers")]
    if any(f is False for f in flags):
        return False
    return True if t.get("lossless") is True else None


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
                   f"speedup vs fastest plain T={T} [95% CI]", f"lossless T={T}"]
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
                    vs_fastest_cell(e, r), lossless]
        rows.append(row)
    return table(header, rows)


def comparator_table(evals: list[dict], many_runs: bool) -> str:
    temps = temperatures(evals)
    names = [*COMPARATORS, *sorted({c for e in evals for c in (e.get("comparators") or {}) if c not in COMPARATORS})]
    header = ["checkpoint"] + [f"ours T={num(t, 1)}" for t in temps] + [f"{c} (speedup, tok/s)" for c in names]
    rows = []
    for e in evals:
        comps = e.get("comparators") or {}
        row = [label(e, many_runs)] + [num(result_at(e, t).get("speedup"), 2) for t in temps]
        for c in names:
            entry = comps.get(c) or {}
            flag = ", not lossless" if entry.get("lossless") is False or entry.get("lossless_vs_transformers") is False else ""
            row.append(DASH if not entry else f"{num(entry.get('speedup'), 2)} ({num(entry.get('tokens_per_s'), 1)}{flag})")
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


def tree_label(shape: dict, tree: dict | None = None) -> str:
    """'tree (kind=dynamic, depth=4)', with ', not lossless' inside where the tree's decodes were not (`tree`:
    its result), so no figure of a tree that left greedy decoding reads as a lossless one."""
    flag = ", not lossless" if tree is not None and tree_lossless(tree) is False else ""
    return "tree (" + ", ".join(f"{k}={v}" for k, v in shape.items()) + flag + ")"


def chain_vs_tree_table(evals: list[dict], many_runs: bool) -> str:
    """Chain and tree drafting of the same checkpoint on the same prompts at T=0 (trees are greedy-only)."""
    header = ["checkpoint", "drafting", "τ", "α", "α per depth", "speedup", "speedup vs fastest plain [95% CI]",
              "ms / verify", "nodes / step", "lossless"]
    rows = []
    for e in evals:
        r = result_at(e, 0.0)
        if not r or "tree" not in r:
            continue
        t = r["tree"]
        depth = lambda xs: ", ".join(num(a, 2) for a in xs or []) or DASH  # noqa: E731
        rows.append([label(e, many_runs), f"chain K={e.get('k')}", num(r.get("tau")), num(r.get("alpha")),
                     depth(r.get("alpha_at")), num(r.get("speedup"), 2), vs_fastest_cell(e, r),
                     num(r.get("ms_per_verify"), 1), num(e.get("k")), num(r.get("lossless"))])
        lossless = tree_lossless(t)
        rows.append([label(e, many_runs), tree_label(t["shape"], t), num(t["tau"]), num(t["alpha"]), depth(t["alpha_at"]),
                     num(t["speedup"], 2), vs_fastest_cell(e, r, t), num(t["ms_per_verify"], 1),
                     num(t["nodes_per_step"], 1), "not lossless" if lossless is False else num(lossless)])
    if not rows:
        trees = "/".join(f"`{k.NAME}`" for k in kinds.all_kinds() if k.DRAFTS_TREES)
        return f"No tree drafting in these runs (set `eval.tree` in the recipe for {trees} drafts)."
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
            tree = [name, e["checkpoint"], tree_label(greedy_tree["shape"], greedy_tree)]
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


def summary_line(result: dict, r: dict) -> str:
    """A result at one temperature in one line: what `specdistill eval` prints and the export README quotes."""
    t = float(r.get("temperature", 0))
    lossless = {True: "yes", False: "NO"}.get(r.get("lossless"), "n/a (T>0)" if t > 0 else DASH)
    vs_hf = {True: " (transformers: yes)", False: " (transformers: NO)"}.get(r.get("lossless_vs_transformers"), "")
    ci95 = r.get("speedup_ci95")
    interval = f"  speedup 95% CI [{ci95[0]:.2f}, {ci95[1]:.2f}]" if ci95 else ""
    if plain_timed(result, r) is not None:  # recorded: over the fastest plain decoder timed, or "not timed"
        interval += f"  over the fastest plain decoding: {vs_fastest_cell(result, r, unit='x')}"
    return (f"{result.get('checkpoint')} T={t:g} K={result.get('k')}: tau {num(r.get('tau'), 2)}  "
            f"alpha {num(r.get('alpha'))}  speedup {num(r.get('speedup'), 2)}x ({num(r.get('tokens_per_s'), 1)} vs "
            f"{num(r.get('baseline_tokens_per_s'), 1)} tok/s)  draft {num(r.get('ms_per_draft_step'), 1)} ms/step  "
            f"verify {num(r.get('ms_per_verify'), 1)} ms  lossless {lossless}{vs_hf}  best K {num(r.get('best_k'))}"
            f"{interval}")


def summary_lines(report: dict) -> list[str]:
    """What `specdistill eval` prints of one checkpoint's result: a line per temperature (and its tree) and one per
    comparator; a spread eval (eval/spread.py) prints the same lines from the file each process wrote."""
    lines = []
    for r in report["results"]:
        lines.append(summary_line(report, r))
        if "tree" in r:
            t = r["tree"]
            lossless = "lossless yes" if tree_lossless(t) else "NOT lossless"
            lines.append(f"{report['checkpoint']} T=0 {tree_label(t['shape'], t)}: tau {t['tau']:.2f}  speedup "
                         f"{t['speedup']:.2f}x  {t['nodes_per_step']:.1f} nodes/step  verify {t['ms_per_verify']:.1f} ms  "
                         f"{lossless}  over the fastest plain decoding: {vs_fastest_cell(report, r, t, unit='x')}")
    for name, c in report["comparators"].items():
        flag = ", NOT lossless" if c.get("lossless") is False or c.get("lossless_vs_transformers") is False else ""
        lines.append(f"{report['checkpoint']} comparator {name}: {c['tokens_per_s']:.1f} tok/s, "
                     f"speedup {c['speedup']:.2f}x vs our baseline{flag}")
    return lines
