"""The workloads stage's tables (eval/by_workload.py), for its console lines, the hybrid bench and the report."""
from __future__ import annotations

from pathlib import Path

from specdistill import layout
from specdistill.formats import read_json

DRAFTERS = ("head", "lookup", "hybrid", "head_tree", "hybrid_tree")  # the trees: kinds that draft trees only
HEADER = ["workload (prompts)", "drafter", "tau [95% CI]", "speedup over plain [95% CI]", "lossless",
          "lookup's share of steps"]


def ci(pair) -> str:
    """A 95% interval as the tables print it (nan where the result has none)."""
    return "[{:.2f}, {:.2f}]".format(*(pair or (float("nan"), float("nan"))))


def rows(report: dict) -> list[list[str]]:
    """One row per workload and drafter, then the mix's (HEADER's columns)."""
    out = []
    named = [*report["workloads"].items(), *([("mix", report["mix"])] if "mix" in report else [])]
    for name, w in named:
        for d in (d for d in DRAFTERS if d in w):
            r = w[d]
            share = f"{r['lookup_step_share']:.0%}" if "lookup_step_share" in r else ("100%" if d == "lookup" else "0%")
            tau = f"{r['tau']:.2f}" + (f" {ci(r['tau_ci95'])}" if "tau_ci95" in r else "")
            out.append([f"{name} (n={w['prompts']})", d, tau, f"{r['speedup']:.2f}× {ci(r['speedup_ci95'])}",
                        "yes" if r["lossless"] else "**no**", share])
    return out


def workload_section(run_dirs: dict[str, Path]) -> str:
    """The report's table of every run's workloads result (eval/workloads-*.json), or nothing where none is."""
    parts = []
    for name, run_dir in run_dirs.items():
        for path in layout.workloads_results(run_dir):
            report = read_json(path)
            table = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
            table += ["| " + " | ".join(row) + " |" for row in rows(report)]
            parts.append(f"### {name} / {report['checkpoint']} ({k_text(report)}{tree_text(report)}, "
                         f"{report['runtime']}, T=0, "
                         f"max_new_tokens {report['max_new_tokens']}, cpu_isa {report['cpu_isa']})\n\n"
                         + "\n".join(table) + "\n")
    if not parts:
        return ""
    return ("\n## By workload: the head, prompt lookup and their hybrid\n"
            "On prompts that carry their own material (a text to summarise, a passage to answer from, code to edit) "
            "an answer copies spans of its prompt, and prompt lookup can draft better than the head. "
            "`specdistill workloads` decodes each category with both and their hybrid, every decode checked "
            "token-identical to plain decoding; intervals: 95% bootstrap over prompts. The chain hybrid drafts from "
            "lookup where the last n-gram recurs, else from the head; the hybrid tree verifies the head's tree and "
            "lookup's draft as branches of one tree (its lookup share: steps whose accepted path ran through "
            "lookup's branch).\n\n"
            + "\n".join(parts))


def lookup_k_of(report: dict) -> int:
    """The K prompt lookup drafted (a result from before eval.lookup_k: the head's)."""
    return report.get("lookup_k", report["k"])


def k_text(report: dict) -> str:
    """The K the head drafts, and prompt lookup's where it differs."""
    return f"K={report['k']}" + (f", lookup K={lookup_k_of(report)}" if lookup_k_of(report) != report["k"] else "")


def tree_text(report: dict) -> str:
    """The trees' shape as the report's heading and the console name it ("" where no tree was measured)."""
    tree = report.get("tree")
    return ", tree " + " ".join(f"{k} {v}" for k, v in tree.items()) if tree else ""


def console_lines(report: dict) -> list[str]:
    """What the workloads stage and the hybrid bench print of a report: where it was measured, then the table."""
    return [f"checkpoint {report['checkpoint']} of {report['run_dir']}, {k_text(report)}{tree_text(report)}, "
            f"{report['runtime']}, T=0, "
            f"max_new_tokens {report['max_new_tokens']}, cpu_isa {report['cpu_isa']}; {report['ci']}",
            "  ".join(HEADER), *("  ".join(row) for row in rows(report))]
