"""`specdistill eval`: decode the eval prompts speculatively with each checkpoint; measure tau, alpha, speedup.

Per checkpoint and temperature, every prompt is decoded by plain AR (our baseline, same engine), then
speculatively at K = eval.k and each extra K of eval.k_sweep, then (T=0 only) by the transformers
comparators: interleaved per prompt so machine noise hits all of them alike. Writes
checkpoints/<run>/eval/<checkpoint>.<prompt set>.<runtime>.json (layout.eval_result: an eval on other prompts or
in another runtime writes its own file; format in the module's `evaluate_checkpoint`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specdistill import device as devices
from specdistill import integrity, kinds, layout, provenance
from specdistill.eval import chain_tau, comparators, exactness, spread
from specdistill.eval.engine import SpeculativeDecoder, eos_token_ids, merge_counts
from specdistill.eval.offline import VOCAB_COVERAGE_EVAL_NOTE, offline_on_prompts, vocab_coverage_eval
from specdistill.eval.prompts import load_prompts, load_tuning_prompts
from specdistill.eval.reference import (divergences, fp32_reference_model, fp32_reference_skipped,
                                        judge_against_reference, transformers_greedy)
from specdistill.eval.results import checkpoint_tokens_seen, eval_settings, heldout_metrics, run_key
from specdistill.eval.runtime import make_runtime, parse_runtime, resolve_runtime_name
from specdistill.eval.summary import (baseline_timed, best_k, measure_costs, ratio_ci95, spec_timed, speedup_over,
                                      summarise_temperature, summarise_tree, timed_per_prompt)
from specdistill.eval.tables import FP32_PLAIN, PLAIN_COMPARATORS, summary_lines
from specdistill.eval.tree import TreeDecoder
from specdistill.errors import SpecdistillError
from specdistill.formats import DRAFT_FILES, checkpoint_fingerprint, read_draft_config, write_eval
from specdistill.plan import applied_plan
from specdistill.target import DTYPES, load_target, load_target_config, load_tokenizer, one_device_shortfall


T0_LOSSLESS_NOTE = ("lossless is checked token by token at T=0 only; at T>0 exactness is the job of the "
                    "statistical test (tests/test_engine.py::test_sampling_distribution_matches_target)")


WARMUP_TOKENS = 8


def warm_up(decoders, prompt_ids, temperature, device) -> None:
    """One short untimed decode per decoder before any timed one (first-call allocations, lazy kernels)."""
    for d in decoders:
        if d is not None:
            d.decode(prompt_ids, WARMUP_TOKENS, temperature, devices.generator(device, 0))


@dataclass
class Decoders:
    """Everything that decodes the prompts for one checkpoint, all in one runtime."""
    target: object  # the transformers model (the comparators decode with it)
    draft: object  # the loaded head or draft LM (assisted generation reads it)
    chain: SpeculativeDecoder
    baseline: SpeculativeDecoder
    tree: TreeDecoder | None
    eos: set[int]
    pad_id: int
    # our plain decoding in static-fp32 beside a bf16 runtime's (T=0, with the comparators): a 1-token fp32
    # forward can be the faster one (docs/DESIGN.md, "comparators")
    fp32_plain: SpeculativeDecoder | None = None


SPECULATIVE_COMPARATORS = ("hf_prompt_lookup", "hf_assisted")  # judged lossless against hf_generate's own tokens


def evaluate_temperature(decoders: Decoders, prompts, eval_cfg, temperature, comparator_names, label=""):
    """Decode every prompt: baseline, K, the K sweep, (T=0) the tree and the comparators, interleaved per prompt.

    A warm-up decode of each decoder runs first; within a prompt the baseline runs first on even prompts and
    after the speculative runs on odd ones, so whatever a run leaves behind (caches, clocks) favours neither."""
    baseline, chain, tree = decoders.baseline, decoders.chain, decoders.tree
    ks = [eval_cfg.k] + sorted({k for k in eval_cfg.k_sweep if k != eval_cfg.k})
    base_runs, spec_runs, tree_runs = [], {k: [] for k in ks}, []
    fp32_plain = decoders.fp32_plain if comparator_names and temperature == 0 else None
    comp = {name: {"tokens": 0, "seconds": 0.0, "outputs": [], "per_prompt": []}
            for name in [*comparator_names, *([FP32_PLAIN] if fp32_plain is not None else [])]}
    dev = decoders.target.device

    def generator(seed):  # the same seed for every decoder of a prompt, on the device it samples on
        return devices.generator(dev, seed)
    if prompts:
        warm_up([baseline, chain, tree if temperature == 0 else None, fp32_plain], prompts[0].ids, temperature, dev)
    for i, prompt in enumerate(tqdm(prompts, desc=f"{label} T={temperature:g}", unit="prompt", leave=False)):
        seed = eval_cfg.seed + i
        base_first = i % 2 == 0
        if base_first:
            base_runs.append(baseline.decode(prompt.ids, eval_cfg.max_new_tokens, temperature, generator(seed)))
        for k in ks:
            spec_runs[k].append(chain.decode(prompt.ids, eval_cfg.max_new_tokens, temperature, generator(seed), k=k))
        if not base_first:
            base_runs.append(baseline.decode(prompt.ids, eval_cfg.max_new_tokens, temperature, generator(seed)))
        if tree is not None and temperature == 0:  # trees are greedy-only (eval/tree.py)
            tree_runs.append(tree.decode(prompt.ids, eval_cfg.max_new_tokens, temperature, generator(seed)))
        timed = []  # (name, new tokens, seconds) of each comparator on this prompt
        for name in comparator_names:
            timed.append((name, *comparators.run_comparator(name, decoders.target, prompt.ids, eval_cfg.max_new_tokens,
                                                            decoders.eos, decoders.pad_id, draft=decoders.draft,
                                                            k=eval_cfg.k)))
        if fp32_plain is not None:
            run = fp32_plain.decode(prompt.ids, eval_cfg.max_new_tokens, temperature, generator(seed))
            timed.append((FP32_PLAIN, run.tokens, run.total_s))
        for name, tokens, seconds in timed:
            comp[name]["tokens"] += len(tokens)
            comp[name]["seconds"] += seconds
            comp[name]["outputs"].append(tokens)
            comp[name]["per_prompt"].append((len(tokens), seconds))
    return base_runs, spec_runs, comp, tree_runs


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


def tune_k(decoders: Decoders, tuning, reported: int, eval_cfg, temperature, label="") -> dict:
    """best_k chosen on the tuning prompts (disjoint from the reported ones): baseline and every K decoded
    there, the K with the highest measured speedup."""
    chain_only = Decoders(decoders.target, decoders.draft, decoders.chain, decoders.baseline, None, decoders.eos,
                          decoders.pad_id)
    base_runs, spec_runs, _, _ = evaluate_temperature(chain_only, tuning, eval_cfg, temperature, [],
                                                      label=f"{label} tuning")
    base = merge_counts(base_runs)
    speedup_by_k = {str(k): speedup_over(merge_counts(runs), base) for k, runs in sorted(spec_runs.items())}
    return {"best_k": best_k(speedup_by_k), "tuning_speedup_by_k": speedup_by_k,
            "best_k_from": f"the highest measured speedup over K in {sorted(int(k) for k in speedup_by_k)} on "
                           f"{len(tuning)} tuning prompts disjoint from the {reported} reported ones "
                           "(eval.tuning_prompts)"}


def evaluate_checkpoint(recipe, target, tokenizer, draft, prompts, checkpoint: str, step: int | None,
                        draft_kind: str, heldout: dict | None, with_comparators: bool = True,
                        reference_tokens: list[list[int]] | None = None, fingerprint: str | None = None,
                        runtime=None, reference_model=None, reference_skipped: str | None = None) -> dict:
    """Everything measured for one draft; the dict written to eval/<checkpoint>.<prompt set>.<runtime>.json.

    Comparators do not depend on the draft (but for assisted generation), so `run` measures them with
    the last checkpoint only (`with_comparators`), saving their decode time on every earlier one.
    `reference_tokens`: transformers' float32 greedy generate() output per prompt, by `reference_model` (the
    float32 target; computed here when not given); `fingerprint`: checkpoint_fingerprint of the step dir;
    `runtime`: the target's runtime (eval/runtime.py; default: eval.runtime of the recipe); `reference_skipped`:
    why the float32 reference was not loaded (fp32_reference_skipped; checked here when no reference is given).
    """
    cfg = recipe.eval
    eos = eos_token_ids(target, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos), 0)
    runtime = runtime or make_runtime(target, cfg.runtime)  # casts the target (and below the draft) to its dtype
    tree = None
    if cfg.tree and kinds.kind_of(draft).DRAFTS_TREES:
        tree = TreeDecoder(runtime, draft, cfg.tree, eos_ids=eos)
    decoders = Decoders(target, draft, SpeculativeDecoder(runtime, draft, k=cfg.k, eos_ids=eos),
                        SpeculativeDecoder(runtime, None, eos_ids=eos), tree, eos, pad_id)
    baseline = decoders.baseline
    wanted = comparators.comparator_names(draft) if cfg.comparators and with_comparators else []
    if 0 in recipe.temperatures and reference_model is None and reference_skipped is None:
        reference_skipped = fp32_reference_skipped(target, cfg.fp32_reference)
    if 0 in recipe.temperatures and reference_skipped is None:  # the lossless reference, plain fp32's weights
        reference_model = reference_model or fp32_reference_model(target)
    family, dtype = parse_runtime(runtime.name)
    if wanted and family == "static" and dtype != "float32" and reference_model is not None:
        decoders.fp32_plain = SpeculativeDecoder(make_runtime(reference_model, "static-fp32"), None, eos_ids=eos)

    ks = [cfg.k, *cfg.k_sweep, *([tree.shape.verified_tokens - 1] if tree is not None else [])]
    exact = exactness.verify_rows_match(runtime, prompts[0].ids, ks) if prompts else None
    if exact is not None and not exact["exact"]:
        print(f"warning: {runtime.name} is not batch-invariant on this machine (a verify row differs from its 1-token "
              f"forward: {exact['checks']}); T=0 decodes may diverge from plain decoding", flush=True)
    costs = measure_costs(runtime, prompts, cfg, tree)
    tuning = load_tuning_prompts(cfg, tokenizer)
    results, comp_report, greedy_outputs, sampled_outputs, reference = [], {}, None, {}, None
    for temperature in recipe.temperatures:
        names = wanted if temperature == 0 else []
        base_runs, spec_runs, comp, tree_runs = evaluate_temperature(decoders, prompts, cfg, temperature, names,
                                                                     label=checkpoint)
        result = summarise_temperature(temperature, prompts, base_runs, spec_runs, cfg.k, costs)
        if tuning:
            result.update(tune_k(decoders, tuning, len(prompts), cfg, temperature, label=checkpoint))
        if tree_runs:
            result["tree"] = summarise_tree(cfg.tree, base_runs, tree_runs)
        if temperature == 0:  # `lossless` stays strict; beside it, each divergence and how close a tie it was
            labelled = {f"chain K={k}": runs for k, runs in spec_runs.items()}
            if tree_runs:
                labelled["tree"] = tree_runs
            result["divergences"] = divergences(runtime, prompts, base_runs, labelled)
        results.append(result)
        if temperature > 0:
            sampled_outputs.setdefault(temperature, [r.tokens for r in base_runs])
        if temperature == 0:
            greedy_outputs = [r.tokens for r in base_runs]
            reference = judge_against_reference(result, reference_model, reference_tokens, reference_skipped, prompts,
                                                base_runs, spec_runs, tree_runs, cfg.max_new_tokens, eos, pad_id)
            base_tps = result["baseline_tokens_per_s"]
            for name, c in comp.items():
                tps = c["tokens"] / c["seconds"] if c["seconds"] else 0.0
                comp_report[name] = {"tokens_per_s": tps, "speedup": tps / base_tps if base_tps else 0.0,
                                     "speedup_ci95": ratio_ci95(timed_per_prompt(c["per_prompt"]),
                                                                baseline_timed(result["per_prompt"])),
                                     "per_prompt": timed_per_prompt(c["per_prompt"])}
                if name in SPECULATIVE_COMPARATORS:  # lossless as ours is: against its own plain decoding, and fp32
                    plain_hf = comp.get("hf_generate")
                    comp_report[name]["lossless"] = (c["outputs"] == plain_hf["outputs"]) if plain_hf else None
                    comp_report[name]["lossless_vs_transformers"] = (
                        [list(t) for t in c["outputs"]] == [list(t) for t in reference]
                        if reference_model is not None and reference is not None else None)
        fastest = fastest_plain(result, comp_report if temperature == 0 else {})  # plain comparators: T=0 only
        if temperature == 0:
            for name in SPECULATIVE_COMPARATORS:
                if name in comp_report:
                    vs_fastest(comp_report[name], comp_report[name]["per_prompt"], result["fastest_plain_tokens_per_s"],
                               fastest)
    comp_note = (f"transformers decoders, greedy (T=0), same prompts and max_new_tokens, on the same weights "
                 f"in the same dtype ({str(runtime.dtype).removeprefix('torch.')}) through transformers' own "
                 f"forward and DynamicCache (the closest configuration to our {runtime.name}); speedup vs our baseline")
    if decoders.fp32_plain is not None:
        comp_note += (f"; {FP32_PLAIN}: our own plain decoding in float32, from the float32 weights on disk (a float32 "
                      "forward of one token can be the faster one)")
    if not cfg.comparators:
        comp_note = "skipped (eval.comparators: false)"
    elif not with_comparators:
        comp_note = "measured with the last checkpoint evaluated in this run (they do not depend on the draft)"
    elif not comp_report:
        comp_note = "skipped: comparators run at T=0 only and eval.temperature has no 0"
    if greedy_outputs is None:  # the offline metrics need the target's greedy continuations
        greedy_outputs = [baseline.decode(p.ids, cfg.max_new_tokens).tokens for p in prompts]
    coverage = vocab_coverage_eval(draft, greedy_outputs, target.config.vocab_size)
    offline_prompts = offline_on_prompts(target, draft, [p.ids for p in prompts], greedy_outputs)
    offline = {"heldout": heldout, "prompts": offline_prompts,
               "chain_on_continuations": chain_tau.on_continuations(decoders.chain, [p.ids for p in prompts],
                                                                    greedy_outputs, cfg.k, cfg.max_new_tokens)}
    if sampled_outputs:  # T>0 is predicted on continuations sampled at that temperature, not greedy ones
        t = min(sampled_outputs)
        offline["prompts_sampled"] = offline_on_prompts(
            target, draft, [p.ids for p in prompts], sampled_outputs[t], temperature=t,
            continuations_label=f"the target's own outputs sampled at T={t:g} (baseline)")

    return {
        "checkpoint": checkpoint,
        "step": step,
        "draft_kind": draft_kind,
        "target": recipe.target.path,
        "prompts": cfg.prompts,
        "num_prompts": len(prompts),
        "max_new_tokens": cfg.max_new_tokens,
        "k": cfg.k,
        "hardware": devices.hardware(target.device),
        "checkpoint_fingerprint": fingerprint,
        "runtime": runtime.name,
        "exactness_check": exact,
        "costs": costs,
        "eval_settings": eval_settings(recipe),
        "run_key": run_key(recipe, runtime.name),
        "plan": applied_plan(recipe),  # null: the recipe's sizes as written
        "code_version": provenance.git_commit(),
        "evaluated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "offline": offline,
        "results": results,
        "comparators": comp_report,
        "comparators_note": comp_note,
        "lossless_note": T0_LOSSLESS_NOTE,
        **coverage,
        "vocab_coverage_eval_note": VOCAB_COVERAGE_EVAL_NOTE,
    }


def run(recipe, args) -> list[Path]:
    which = getattr(args, "checkpoint", None) or recipe.eval.checkpoints
    steps = layout.select_checkpoints(recipe.run_dir, which)
    for step_dir in steps:  # before minutes of loading: a corrupt checkpoint is refused with one line
        integrity.check_checkpoint(step_dir, only=DRAFT_FILES)
    # loaded straight in the runtime's dtype: target.dtype is what the cache pass ran in, and a bf16 load
    # cast up to fp32 would not be the fp32 target
    name = resolve_runtime_name(recipe.eval.runtime, load_target_config(recipe.target))
    family, dtype = parse_runtime(name)
    device = devices.resolve(recipe.device)
    devices.warn_if_bf16_emulated(DTYPES[dtype], device, f"the eval decodes with {name}", f"eval.runtime={family}-fp32")
    if short := one_device_shortfall(recipe.target, device):
        raise SpecdistillError(f"eval: {short}: the eval holds the target on one GPU (the cache pass alone spreads "
                               "it over several)")
    if (processes := spread.process_count(recipe, device, len(steps))) > 1:  # one process per GPU (eval/spread.py)
        return spread.spread(recipe, steps, processes, device, name)
    target = load_target(recipe.target.model_copy(update={"dtype": dtype}), device=device)
    runtime = make_runtime(target, name)  # the target and every decoder of it run in its dtype
    tokenizer = load_tokenizer(recipe.target)
    prompts = load_prompts(recipe.eval, tokenizer)
    reference, reference_model, reference_skipped = None, None, None
    if 0 in recipe.temperatures or 0.0 in recipe.temperatures:
        reference_skipped = fp32_reference_skipped(target, recipe.eval.fp32_reference)
        if reference_skipped:
            print(f"warning: {reference_skipped}", flush=True)
    if (0 in recipe.temperatures or 0.0 in recipe.temperatures) and not reference_skipped:  # once per run
        eos = eos_token_ids(target, tokenizer)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos), 0)
        # the lossless reference runs in float32, loaded from disk (not the runtime's cast weights)
        reference_model = (target if target.dtype == torch.float32 else
                           load_target(recipe.target.model_copy(update={"dtype": "float32"}), device=target.device))
        reference = transformers_greedy(reference_model, prompts, recipe.eval.max_new_tokens, eos, pad_id)
    written, last = [], getattr(args, "comparators_with", None) or steps[-1].name  # a spread process: the run's last
    for step_dir in steps:
        draft = kinds.load_draft(step_dir, target)
        report = evaluate_checkpoint(recipe, target, tokenizer, draft, prompts, step_dir.name, layout.step_of(step_dir),
                                     read_draft_config(step_dir)["kind"], heldout_metrics(step_dir),
                                     # assisted generation is the one comparator that reads the draft
                                     with_comparators=step_dir.name == last or comparators.assistant_of(draft) is not None,
                                     reference_tokens=reference, reference_model=reference_model,
                                     reference_skipped=reference_skipped,
                                     fingerprint=checkpoint_fingerprint(step_dir),
                                     runtime=runtime)
        report["tokens_seen"] = checkpoint_tokens_seen(step_dir)  # kept here too: keep_last may prune the checkpoint
        out = layout.eval_result(recipe.run_dir, step_dir.name, recipe.eval, name)  # never another prompt set's
        write_eval(out, report)
        for line in summary_lines(report):
            print(line, flush=True)
        written.append(out)
    return written
