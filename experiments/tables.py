"""The README table of a pipeline experiment, computed from the raw results its run recorded.

`ROWS[name](results)` gives the table's rows from experiments/records/<name>.json's `results` (what
`experiments.run` stored per arm: stage times, training tokens/s, the eval JSON of each decoded checkpoint);
`python -m experiments.run NAME --table` recomputes the table of a record without running anything.
Pipeline experiments that are not here keep the table transcribed when the record was made.
"""
from __future__ import annotations

from typing import Callable

from benchmarks import peer_table
from specdistill.eval.served import headless_divergence, verdict, vllm_own_divergence
from specdistill.eval.scaling import fit_text
from specdistill.eval.served_tables import served_rows
from specdistill.eval.tables import BF16_PLAIN, FP32_PLAIN
from specdistill.eval.workload_tables import ci
from specdistill.eval.workload_tables import lookup_k_of, rows as workload_rows


def f2(x) -> str:
    return f"{x:.2f}"


def times(x, ci=None) -> str:
    return f"{x:.2f}×" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")


def clock(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}:{secs:02d}"


def served(results: dict) -> list[list[str]]:
    """The served table (eval/served_tables.py) of the main arm's served checkpoint, as `specdistill served` prints it."""
    record = results["main"]["served"]
    return served_rows(record[sorted(record)[-1]])


def last_eval(arm: dict) -> dict:
    """The eval JSON of the arm's last decoded checkpoint."""
    return arm["eval"][sorted(arm["eval"])[-1]]


def kinds_side_by_side(results: dict) -> list[list[str]]:
    """One row per arm (draft kind): what issue 21 compares at equal cache and budget."""
    rows = []
    for name, arm in results.items():
        ev = last_eval(arm)
        by_t = {r["temperature"]: r for r in ev["results"]}
        t0, t1 = by_t[0.0], by_t.get(1.0)
        held = ev["offline"]["heldout"]
        tree = t0.get("tree")
        lookup = (ev.get("comparators") or {}).get("hf_prompt_lookup")
        rows.append([
            f"{ev['draft_kind']} ({ev['checkpoint']})",
            f"{arm['train_tokens_per_s']:.0f}",
            " / ".join(f"{x:.3f}" for x in held["top1_at"][:4]),
            f"{ev['offline']['chain_on_continuations']['tau']:.3f}",
            f2(t0["tau"]) + (" lossless" if t0["lossless"] else " **not lossless**"),
            times(t0["speedup"], t0.get("speedup_ci95")),
            f2(t1["tau"]) if t1 else "",
            times(t1["speedup"], t1.get("speedup_ci95")) if t1 else "",
            f"{f2(tree['tau'])} / {times(tree['speedup'])}" if tree else "",
            f"{t0['d']:.3f}",
            times(lookup["speedup"]) if lookup else "",
        ])
    return rows


def arms(results: dict) -> list[list[str]]:
    """One row per arm of a screen: its training wall clock and throughput, its offline and measured τ at T=0,
    and prompt lookup where the arm ran the comparators."""
    rows = []
    for name, arm in results.items():
        ev = last_eval(arm)
        t0 = next(r for r in ev["results"] if r["temperature"] == 0.0)
        held = ev["offline"]["heldout"]
        lookup = (ev.get("comparators") or {}).get("hf_prompt_lookup")
        rows.append([name, clock(arm["stage_seconds"]["train"]), f"{arm['train_tokens_per_s']:.0f}", f"{held['top1_at'][0]:.3f}",
                     f"{held['chain_tau']['0']:.3f}", f"{ev['offline']['chain_on_continuations']['tau']:.3f}",
                     f2(t0["tau"]), times(t0["speedup"], t0.get("speedup_ci95")),
                     times(lookup["speedup"]) if lookup else "—"])
    return rows


def scaling(results: dict) -> list[list[str]]:
    """One row per data size of the scaling bench (its complete runs), then one per fitted series."""
    result = results["main"]
    rows = []
    for p in result["points"]:
        gap = p["continuations"] - p["measured"]
        rows.append([str(p["step"]), f"{p['tokens_seen']:,}", f"{p['heldout_top1']:.3f}", f"{p['simulated']:.3f}",
                     f"{p['continuations']:.3f}", f2(p["measured"]), f"{gap:+.3f}"])
    return rows + [["fit: " + fit_text(f, False).removeprefix("- "), "", "", "", "", "", ""] for f in result["fits"]]


def runtimes(results: dict) -> list[list[str]]:
    """One row per runtime of the runtime bench; ratios against eager-fp32 (the runtime before eval/runtime.py), and
    the forwards timed in turn with static-fp32 (the bench's `paired`; recorded since its fused products)."""
    report = results["main"]
    paired = report.get("paired", {})

    def in_turn(name: str) -> str:
        if not all(name in row for row in paired.values()):
            return "—"
        return " / ".join(f"{row[name]['ms']:.1f} ({row[name]['ratio']:.2f}×)" for row in paired.values())

    ref = report["runtimes"]["eager-fp32"]["ar_tokens_per_s"]
    rows = []
    for name, r in report["runtimes"].items():
        ms, v = r["forward_ms"], r["v"]
        label = {"eager-fp32": "eager-fp32 (the old runtime)", report["default"]: f"**{name} (default)**"}.get(name, name)
        ratio = times(r["ar_tokens_per_s"] / ref)
        rows.append([label, f"{ms['1']:.1f}", f"{ms['2']:.1f}", f"{ms['5']:.1f}", f"{ms['9']:.1f}", f2(v["4"]),
                     f2(v["5"]), f2(v["9"]), f2(r["draft_step_ms"]), f"{r['d']:.3f}", f"{r['ar_tokens_per_s']:.1f}",
                     f"**{ratio}**" if name == report["default"] else ratio, f"{r['hf_generate_tokens_per_s']:.1f}",
                     in_turn(name)])
    return rows


def default_run(results: dict) -> list[list[str]]:
    """One row per decoded checkpoint of a complete run (offline, measured at T=0 and T=1, tree, comparators),
    then one row of the stages' wall clock."""
    arm = results["main"]
    rows = []
    for ev in arm["eval"].values():
        by_t = {r["temperature"]: r for r in ev["results"]}
        t0, t1 = by_t[0.0], by_t.get(1.0)
        tree = t0.get("tree")
        held = ev["offline"]["heldout"]
        lookup = (ev.get("comparators") or {}).get("hf_prompt_lookup")
        rows.append([
            str(ev["step"]), f"{ev['tokens_seen']:,}", f"{held['top1_at'][0]:.3f}", f"{held['chain_tau']['0']:.3f}",
            f"{ev['offline']['chain_on_continuations']['tau']:.3f}",
            f2(t0["tau"]) + ("" if t0["lossless"] else " **not lossless**"),
            times(t0["speedup"], t0.get("speedup_ci95")),
            f"{times(t0['speedup_vs_fastest_plain'])} ({t0['fastest_plain']})" if ev.get("comparators") else "not timed",
            f2(t1["tau"]) if t1 else "", times(t1["speedup"], t1.get("speedup_ci95")) if t1 else "",
            f"{f2(tree['tau'])} / {times(tree['speedup'])}" if tree else "",
            times(lookup["speedup"]) if lookup else ""])
    stages = arm["stage_seconds"]
    text = " · ".join(f"{name} {clock(s)}" + (f" ({arm['train_tokens_per_s']:.0f} tokens/s)" if name == "train" else "")
                      for name, s in stages.items())
    return rows + [[f"stages: {text} · total {clock(sum(stages.values()))}"] + [""] * 11]


def default_run_chosen_k(results: dict) -> list[list[str]]:
    """`default_run` with one more column: at T=0, the K the tuning prompts chose (eval.k_sweep, highest measured
    speedup there) and the reported prompts' measured τ and speedup at that K."""
    rows = default_run(results)
    for row, ev in zip(rows, results["main"]["eval"].values()):
        t0 = next(r for r in ev["results"] if r["temperature"] == 0.0)
        k = str(t0["best_k"])
        row.insert(8, f"K={k}: {f2(t0['tau_by_k'][k])} / {times(t0['speedup_by_k'][k], t0['ci95_by_k'][k]['speedup_ci95'])}")
    rows[-1].append("")
    return rows


def deploy_verdict(head: dict, headless: list[dict]) -> str:
    """The served gate as eval/served.py judges it now, from the counters and outputs the record holds: a record
    made before a rule changed is judged by the current rule (a T=0 divergence that vLLM's headless methods share
    is vLLM's own)."""
    fit, why = verdict(head, headless)
    own = headless_divergence(headless, 0.0) if fit and vllm_own_divergence(head, headless) else []
    return ("yes" + (f" (T=0: vLLM's own divergence, {' and '.join(own)} too)" if own else "")) if fit else \
        "**no**: " + "; ".join(why)


def planned_run(results: dict) -> list[list[str]]:
    """`make distill` under its time budget: what the plan sized, what the head reached in our eval and served
    by vLLM, then one row of each stage's planned and measured minutes."""
    arm = results["main"]
    plan = arm["plan"]
    sized = dict(o.split("=", 1) for o in plan["overrides"])
    ev = last_eval(arm)
    by_t = {r["temperature"]: r for r in ev["results"]}
    t0, t1 = by_t[0.0], by_t.get(1.0)
    tree = t0.get("tree")
    lookup = (ev.get("comparators") or {}).get("hf_prompt_lookup")
    served_record = arm["served"][sorted(arm["served"])[-1]]
    engines = {e["name"]: e for e in served_record["engines"]}
    head = next(e for e in served_record["engines"] if e.get("fit_to_deploy") is not None)
    by_served_t = {r["temperature"]: r for r in head["results"]}

    def vllm_speedup(name):
        r = next((r for r in (engines.get(name) or {}).get("results", []) if r["temperature"] == 0.0), None)
        return times(r["speedup"]) if r else "—"

    served_tau = " / ".join(f"{f2(by_served_t[t]['tau'])} ({f2(by_served_t[t]['ours']['tau'])})"
                            for t in sorted(by_served_t))
    # the fastest plain decoding timed in the run: the eval's plain decoders, and vLLM's own in the served stage
    vllm_plain = next((r["tokens_per_s"] for r in served_record["plain"].get("results", []) if r["temperature"] == 0),
                      0.0)
    if vllm_plain > t0["fastest_plain_tokens_per_s"]:
        over_fastest = f"{times(t0['tokens_per_s'] / vllm_plain)} (vLLM plain)"
    elif ev.get("comparators"):
        over_fastest = f"{times(t0['speedup_vs_fastest_plain'])} ({t0['fastest_plain']})"
    else:
        over_fastest = "not timed"
    row = [f"{int(sized['corpus.max_rows']):,} rows, {sized['train.max_steps']} steps (×{plan['scale']:.2f})",
           f"{ev['tokens_seen']:,}", f"{ev['offline']['heldout']['top1_at'][0]:.3f}",
           f"{ev['offline']['heldout']['chain_tau']['0']:.3f}",
           f2(t0["tau"]) + (" lossless" if t0["lossless"] else " **not lossless**"),
           times(t0["speedup"], t0.get("speedup_ci95")), over_fastest,
           times(lookup["speedup"]) if lookup else "not timed",
           f"{f2(t1['tau'])} / {times(t1['speedup'], t1.get('speedup_ci95'))}" if t1 else "",
           (f"{f2(tree['tau'])} / {times(tree['speedup'])}" + ("" if tree["lossless"] else " not lossless"))
           if tree else "",
           served_tau, deploy_verdict(head, [e for e in served_record["engines"] if e.get("fit_to_deploy") is None]),
           " / ".join(vllm_speedup(n) for n in (head["name"], "ngram", "suffix"))]
    planned, took = plan["estimate_s"], arm["stage_seconds"]
    text = " · ".join(f"{s} {took[s] / 60:.1f} ({planned[s] / 60:.1f})" for s in took)
    total = sum(took.values())
    return [row, [f"minutes per stage, measured (planned): {text} · total {total / 60:.1f} ({plan['total_s'] / 60:.1f}, "
                  f"{total / plan['total_s'] - 1:+.0%}) on {plan['machine']}"] + [""] * (len(row) - 1)]


def by_workload(results: dict) -> list[list[str]]:
    """One row per workload and drafter of the hybrid bench (the workloads stage's table, eval/workload_tables.py)."""
    return workload_rows(results["main"])


def lookup_k(results: dict) -> list[list[str]]:
    """The hybrid bench's rows of each arm, the lookup K it drafted first (the head's K is the same in every arm)."""
    return [[str(lookup_k_of(report)), *row] for report in results.values() for row in workload_rows(report)]


def served_cell(arm: dict) -> str:
    """The arm's served check in one cell: vLLM's tau at T=0 (ours) / the verdict; "not served" where it did not run."""
    record = next(iter(arm.get("served", {}).values()), None)
    head = next((e for e in (record or {}).get("engines", []) if e.get("fit_to_deploy") is not None), None)
    if head is None:
        return "not served"
    t0 = next(r for r in head["results"] if r["temperature"] == 0)
    verdict = "yes" if head["fit_to_deploy"] else "no: " + "; ".join(head["not_fit_because"])
    return f"{t0['tau']:.2f} ({t0['ours']['tau']:.2f}) / {verdict}"


def fc_norm_screen(results: dict) -> list[list[str]]:
    """The arms screen's row per arm, with the served check where the arm ran it."""
    return [row + [served_cell(arm)] for row, arm in zip(arms(results), results.values())]


def runtime_choice(results: dict) -> list[list[str]]:
    """One row per runtime arm and temperature of the decode bench: the verify's cost, plain decoding in both
    dtypes (T=0, where the other dtype is timed), the speculative rate and both speedups."""
    rows = []
    for arm, report in results.items():
        ms, k = report["costs"]["forward_ms"], report["k"]
        other = next((n for n in report.get("comparators", {}) if n in (FP32_PLAIN, BF16_PLAIN)), None)
        for r in report["results"]:
            t0 = float(r["temperature"]) == 0
            plain = f"{r['baseline_tokens_per_s']:.1f}" + (
                f" / {report['comparators'][other]['tokens_per_s']:.1f}" if other and t0 else "")
            lossless = {True: "yes", False: "NO", None: "(T>0)"}[r.get("lossless")]
            rows.append([report["runtime"], f"{r['temperature']:g}", f2(r["tau"]),
                         f"{ms[str(k + 1)]:.1f} / {ms['1']:.1f}", plain, f"{r['tokens_per_s']:.1f}",
                         times(r["speedup"], r.get("speedup_ci95")),
                         times(r["speedup_vs_fastest_plain"], r.get("speedup_vs_fastest_plain_ci95"))
                         + f" ({r['fastest_plain']})", lossless])
    return rows


def peer(results: dict) -> list[list[str]]:
    """One row per trainer of the peer bench (ours, speculators'), as the bench prints them."""
    return peer_table.rows(results["main"])


DATA_ARMS = {"sharegpt": "ShareGPT's answers", "regenerated": "the target's own answers (vLLM, greedy)",
             "mix": "half and half (a hash of the row)"}


def head_cells(arm: dict) -> list[str]:
    """What an arm's head reached, offline and decoding: held-out top-1, simulated τ on the MT-bench continuations,
    MT-bench τ at T=0, τ per workload, and τ and speedup on the mix of workloads (head / hybrid)."""
    ev = last_eval(arm)
    t0 = next(r for r in ev["results"] if r["temperature"] == 0.0)
    last = arm["workloads"][sorted(arm["workloads"])[-1]]
    mix, work = last["mix"], last["workloads"]
    return [
        f"{ev['offline']['heldout']['top1_at'][0]:.3f}",
        f"{ev['offline']['chain_on_continuations']['tau']:.3f}",
        f2(t0["tau"]) + (f" {ci(t0['tau_ci95'])}" if t0.get("tau_ci95") else ""),
        " / ".join(f2(w["head"]["tau"]) for w in work.values()),
        f"{f2(mix['head']['tau'])} {ci(mix['head']['tau_ci95'])} / {f2(mix['hybrid']['tau'])} {ci(mix['hybrid']['tau_ci95'])}",
        f"{times(mix['head']['speedup'], mix['head']['speedup_ci95'])} / "
        f"{times(mix['hybrid']['speedup'], mix['hybrid']['speedup_ci95'])}",
    ]


def data_ab(results: dict) -> list[list[str]]:
    """One row per data arm at equal wall clock: what its minutes bought (regeneration, cache, training), the head's
    offline numbers, MT-bench τ (the eval) and τ per workload and on their mix (the workloads stage)."""
    rows = []
    for name, arm in results.items():
        ev, took, regen = last_eval(arm), arm["stage_seconds"], arm.get("regenerated")
        regen_s = regen["seconds"] if regen else 0.0
        cache_s = took["cache"] - regen_s  # the cache stage regenerates first
        # the regenerated corpus's tokens were all read by the cache pass; its assistant tokens are all the
        # target's only where every row was regenerated
        rates = "—"
        if regen:
            made = regen["assistant_tokens"] / regen_s if "fraction" not in regen["regenerated_from"] else None
            rates = (f"{made:.0f} / " if made else "— / ") + f"{regen['tokens'] / cache_s:.0f}"
        rows.append([
            DATA_ARMS.get(name, name),
            f"{ev['step']} steps, {ev['tokens_seen']:,} tokens",
            f"{regen_s / 60:.1f} + {cache_s / 60:.1f} + {took['train'] / 60:.1f} = "
            f"{(took['cache'] + took['train']) / 60:.1f}",
            rates,
            *head_cells(arm),
        ])
    return rows


OPD_ARMS = {"base": "base (52 steps from scratch)", "sft": "+ plain continued training",
            "replay": "+ Draft-OPD replay (loss.replay_weight 2)"}


def draft_opd(results: dict) -> list[list[str]]:
    """One row per arm: base, then the two continuations of it at equal wall clock (the train stage's minutes, the
    replay's inside them), with the replay's own counts, the offline numbers, MT-bench τ and the workloads."""
    rows = []
    for name, arm in results.items():
        ev, took, made = last_eval(arm), arm["stage_seconds"], arm.get("replay")
        replay_s = made["seconds"] if made else 0.0
        rows.append([
            OPD_ARMS.get(name, name),
            f"{ev['step']} steps, {ev['tokens_seen']:,} tokens",
            f"{replay_s / 60:.1f} + {(took['train'] - replay_s) / 60:.1f} = {took['train'] / 60:.1f}",
            f"{made['steps']:,} steps, τ {made['tau']:.3f}, {made['rejected']:,} rejected" if made else "—",
            *head_cells(arm),
        ])
    return rows


ROWS: dict[str, Callable[[dict], list[list[str]]]] = {"medusa-vs-eagle3": kinds_side_by_side, "arms-screen": arms,
                                                      "scaling": scaling, "runtime-bench": runtimes, "runtime-bench-avx2": runtimes,
                                                      "default-muon-2proc": default_run, "peer": peer, "peer-bf16": peer,
                                                      "default-5k-amx": default_run_chosen_k, "default-8k-amx": default_run_chosen_k,
                                                      "served-parity": served, "default-90min-avx2": planned_run,
                                                      "default-90min-avx512": planned_run,
                                                      "default-90min-xeon": planned_run, "by-workload-xeon": by_workload,
                                                      "lookup-k-avx2": lookup_k,
                                                      "runtime-choice-xeon": runtime_choice,
                                                      "fc-norm-screen": fc_norm_screen, "data-ab": data_ab,
                                                      "draft-opd": draft_opd}
