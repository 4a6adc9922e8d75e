"""Our decoding against the others, per checkpoint and temperature (eval/evaluate.py): the comparators' report (speed
against our baseline; the speculative ones judged lossless as ours is) and its note, and the fastest plain decoding
timed with the speedup over it."""
from __future__ import annotations

from specdistill.eval.summary import baseline_timed, ratio_ci95, spec_timed, timed_per_prompt
from specdistill.eval.tables import FP32_PLAIN, PLAIN_COMPARATORS

SPECULATIVE_COMPARATORS = ("hf_prompt_lookup", "hf_assisted")  # judged lossless against hf_generate's own tokens


def fastest_plain(result: dict, comp_report: dict) -> list[dict]:
    """The fastest plain decoding timed for this checkpoint at this temperature (ours, and the plain comparators
    where they ran) and the speedup over it, with its 95% interval over prompts (the same resamples as the
    speedup's); the tree's too. `plain_timed` names every plain decoder timed: ours alone means no comparison
    was made, and the report says "not timed". Returns the fastest's per-prompt [{tokens, seconds}]."""
    plain = {"ours": (result["baseline_tokens_per_s"], baseline_timed(result["per_prompt"]))}
    plain.update({name: (c["tokens_per_s"], c["per_prompt"]) for name, c in comp_report.items() if name in PLAIN_COMPARATORS})
    fastest = max(plain, key=lambda name: plain[name][0])
    result["plain_timed"] = list(plain)
    result["fastest_plain"] = fastest
    tps, per = plain[fastest]
    result["fastest_plain_tokens_per_s"] = tps
    vs_fastest(result, spec_timed(result["per_prompt"]), tps, per)
    if "tree" in result:
        vs_fastest(result["tree"], spec_timed(result["tree"]["per_prompt"]), tps, per)
    return per


def vs_fastest(entry: dict, timed: list[dict], fastest_tps: float, fastest_timed: list[dict]) -> None:
    """entry's speedup over the fastest plain decoding and its 95% interval (timed, fastest_timed: the two
    decoders' per-prompt [{tokens, seconds}] on the same prompts)."""
    entry["speedup_vs_fastest_plain"] = entry["tokens_per_s"] / fastest_tps if fastest_tps else 0.0
    entry["speedup_vs_fastest_plain_ci95"] = ratio_ci95(timed, fastest_timed)


def comparator_report(comp: dict, result: dict, reference: list[list[int]] | None) -> dict:
    """The T=0 comparators' speed against our baseline (with its 95% interval); the speculative ones judged lossless
    as ours is: against their own plain decoding (hf_generate) and against the float32 `reference` (None: none)."""
    report, base_tps = {}, result["baseline_tokens_per_s"]
    for name, c in comp.items():
        tps = c["tokens"] / c["seconds"] if c["seconds"] else 0.0
        per_prompt = timed_per_prompt(c["per_prompt"])
        report[name] = {"tokens_per_s": tps, "speedup": tps / base_tps if base_tps else 0.0,
                        "speedup_ci95": ratio_ci95(per_prompt, baseline_timed(result["per_prompt"])),
                        "per_prompt": per_prompt}
        if name in SPECULATIVE_COMPARATORS:
            plain_hf = comp.get("hf_generate")
            report[name]["lossless"] = (c["outputs"] == plain_hf["outputs"]) if plain_hf else None
            report[name]["lossless_vs_transformers"] = (
                [list(t) for t in c["outputs"]] == [list(t) for t in reference] if reference is not None else None)
    return report


def comparators_note(cfg, runtime, other_plain: str | None, with_comparators: bool, comparators: dict) -> str:
    """What the comparators are, or why they were not measured."""
    if not cfg.comparators:
        return "skipped (eval.comparators: false)"
    if not with_comparators:
        return "measured with the last checkpoint evaluated in this run (they do not depend on the draft)"
    if not comparators:
        return "skipped: comparators run at T=0 only and eval.temperature has no 0"
    note = (f"transformers decoders, greedy (T=0), same prompts and max_new_tokens, on the same weights "
            f"in the same dtype ({str(runtime.dtype).removeprefix('torch.')}) through transformers' own "
            f"forward and DynamicCache (the closest configuration to our {runtime.name}); speedup vs our baseline")
    if other_plain == FP32_PLAIN:
        note += (f"; {FP32_PLAIN}: our own plain decoding in float32, from the float32 weights on disk (a float32 "
                 "forward of one token can be the faster one)")
    elif other_plain:
        note += (f"; {other_plain}: our own plain decoding in bfloat16, from a bfloat16 load of the weights on disk "
                 "(where the CPU computes bf16 natively it can be the faster one)")
    return note
