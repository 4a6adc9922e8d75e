"""`specdistill eval`: decode the eval prompts speculatively with each checkpoint; measure tau, alpha, speedup.

Per checkpoint and temperature, every prompt is decoded by plain AR (our baseline, same engine), then
speculatively at K = eval.k and each extra K of eval.k_sweep, then (T=0 only) by the transformers
comparators: interleaved per prompt so machine noise hits all of them alike. Writes
checkpoints/<run>/eval/<checkpoint>.<prompt set>.<runtime>.json (layout.eval_result: an eval on other prompts or
in another runtime writes its own file; format in the module's `assemble_report`).

`evaluate_checkpoint` measures one checkpoint's draft (a kinds.LoadedDraft) with what the run shares (`EvalRun`):
its decoders built (`build_decoders`, `add_other_plain`), the reference resolved (`resolved`), each temperature
decoded and summarised (`at_temperature`; the comparisons in eval/comparison.py), the offline predictions
(`offline_numbers`), the report assembled (`assemble_report`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from specdistill import device as devices
from specdistill import integrity, kinds, layout, provenance
from specdistill.eval import chain_tau, comparators, exactness, spread
from specdistill.eval.comparison import (SPECULATIVE_COMPARATORS, comparator_report, comparators_note, fastest_plain,
                                         vs_fastest)
from specdistill.eval.engine import SpeculativeDecoder, eos_token_ids, merge_counts
from specdistill.eval.offline import VOCAB_COVERAGE_EVAL_NOTE, offline_on_prompts, vocab_coverage_eval
from specdistill.eval.prompts import load_prompts, load_tuning_prompts
from specdistill.eval.reference import (divergences, fp32_reference_model, fp32_reference_skipped,
                                        judge_against_reference, transformers_greedy)
from specdistill.eval.results import checkpoint_tokens_seen, eval_settings, heldout_metrics, run_key
from specdistill.eval.runtime import load_runtime, make_runtime, parse_runtime, resolve_runtime_name
from specdistill.eval.summary import best_k, measure_costs, speedup_over, summarise_temperature, summarise_tree
from specdistill.eval.tables import BF16_PLAIN, FP32_PLAIN, summary_lines
from specdistill.eval.tree import TreeDecoder
from specdistill.errors import SpecdistillError
from specdistill.formats import DRAFT_FILES, checkpoint_fingerprint, write_eval
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
    # (name, decoder): our plain decoding in the static runtime's other dtype (T=0, with the comparators), fp32
    # beside bf16 and bf16 beside fp32: which is faster depends on the CPU (docs/DESIGN.md, "comparators")
    other_plain: tuple[str, SpeculativeDecoder] | None = None


def evaluate_temperature(decoders: Decoders, prompts, eval_cfg, temperature, comparator_names, label=""):
    """Decode every prompt: baseline, K, the K sweep, (T=0) the tree and the comparators, interleaved per prompt.

    A warm-up decode of each decoder runs first; within a prompt the baseline runs first on even prompts and
    after the speculative runs on odd ones, so whatever a run leaves behind (caches, clocks) favours neither."""
    baseline, chain, tree = decoders.baseline, decoders.chain, decoders.tree
    ks = [eval_cfg.k] + sorted({k for k in eval_cfg.k_sweep if k != eval_cfg.k})
    base_runs, spec_runs, tree_runs = [], {k: [] for k in ks}, []
    other = decoders.other_plain if comparator_names and temperature == 0 else None
    comp = {name: {"tokens": 0, "seconds": 0.0, "outputs": [], "per_prompt": []}
            for name in [*comparator_names, *([other[0]] if other is not None else [])]}
    dev = decoders.target.device

    def generator(seed):  # the same seed for every decoder of a prompt, on the device it samples on
        return devices.generator(dev, seed)
    if prompts:
        warm_up([baseline, chain, tree if temperature == 0 else None, other and other[1]], prompts[0].ids, temperature, dev)
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
        if other is not None:
            run = other[1].decode(prompt.ids, eval_cfg.max_new_tokens, temperature, generator(seed))
            timed.append((other[0], run.tokens, run.total_s))
        for name, tokens, seconds in timed:
            comp[name]["tokens"] += len(tokens)
            comp[name]["seconds"] += seconds
            comp[name]["outputs"].append(tokens)
            comp[name]["per_prompt"].append((len(tokens), seconds))
    return base_runs, spec_runs, comp, tree_runs


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


@dataclass(frozen=True)
class EvalRun:
    """What every checkpoint of one eval run is measured with (`run` loads it once): the recipe, the target (a
    transformers model), its tokenizer, the eval prompts; `runtime`: the target's runtime (eval/runtime.py; None:
    the recipe's eval.runtime, made per checkpoint); the float32 lossless reference: transformers' greedy
    generate() output per prompt (`reference_tokens`, computed per checkpoint when not given) by
    `reference_model` (the float32 target; made when not given), or why that was not loaded
    (`reference_skipped`: fp32_reference_skipped, checked when no reference model is given)."""
    recipe: object
    target: object
    tokenizer: object
    prompts: list
    runtime: object = None
    reference_tokens: list[list[int]] | None = None
    reference_model: object = None
    reference_skipped: str | None = None


def build_decoders(run: EvalRun, draft: kinds.LoadedDraft, runtime) -> Decoders:
    """The baseline, the chain at eval.k and (a kind that drafts trees, eval.tree set) the tree, in `runtime` (it
    casts the target and the draft to its dtype)."""
    cfg = run.recipe.eval
    eos = eos_token_ids(run.target, run.tokenizer)
    pad_id = run.tokenizer.pad_token_id if run.tokenizer.pad_token_id is not None else next(iter(eos), 0)
    tree = TreeDecoder(runtime, draft, cfg.tree, eos_ids=eos) if cfg.tree and draft.kind.DRAFTS_TREES else None
    return Decoders(run.target, draft.module, SpeculativeDecoder(runtime, draft, k=cfg.k, eos_ids=eos),
                    SpeculativeDecoder(runtime, None, eos_ids=eos), tree, eos, pad_id)


def resolved(run: EvalRun, runtime) -> EvalRun:
    """`run` with its runtime and (T=0 among the temperatures) its float32 reference model, or why it is skipped."""
    skipped, model = run.reference_skipped, run.reference_model
    if 0 in run.recipe.temperatures and model is None and skipped is None:
        skipped = fp32_reference_skipped(run.target, run.recipe.eval.fp32_reference)
    if 0 in run.recipe.temperatures and skipped is None:  # the lossless reference, plain fp32's weights
        model = model or fp32_reference_model(run.target)
    return replace(run, runtime=runtime, reference_model=model, reference_skipped=skipped)


def add_other_plain(decoders: Decoders, run: EvalRun, comparator_names: list[str]) -> None:
    """Beside a static runtime's comparators, our plain decoding in its other dtype: static-fp32 from the float32
    reference's weights beside a reduced-precision runtime; static-bf16 from a bf16 load of the target beside
    static-fp32 where bf16 is native (the plan may choose fp32 where it verifies faster: specdistill/plan_stage.py),
    so the fastest plain decoding is timed whichever the eval runs in."""
    family, dtype = parse_runtime(run.runtime.name)
    if not comparator_names or family != "static":
        return
    if dtype != "float32" and run.reference_model is not None:
        decoders.other_plain = (FP32_PLAIN, SpeculativeDecoder(make_runtime(run.reference_model, "static-fp32"), None,
                                                               eos_ids=decoders.eos))
    elif dtype == "float32" and devices.native_bf16(run.target.device):
        bf16 = load_target(run.recipe.target.model_copy(update={"dtype": "bfloat16"}), device=run.target.device)
        decoders.other_plain = (BF16_PLAIN, SpeculativeDecoder(make_runtime(bf16, "static-bf16"), None,
                                                               eos_ids=decoders.eos))


def check_exactness(runtime, prompts, ks: list[int]) -> dict | None:
    """Whether each verify row equals its 1-token forward for every K verified (a warning if not)."""
    exact = exactness.verify_rows_match(runtime, prompts[0].ids, ks) if prompts else None
    if exact is not None and not exact["exact"]:
        print(f"warning: {runtime.name} is not batch-invariant on this machine (a verify row differs from its 1-token "
              f"forward: {exact['checks']}); T=0 decodes may diverge from plain decoding", flush=True)
    return exact


@dataclass
class Measured:
    """What decoding the prompts measured, temperature by temperature."""
    results: list[dict] = field(default_factory=list)
    comparators: dict = field(default_factory=dict)  # the T=0 comparators' report
    greedy_outputs: list[list[int]] | None = None  # the baseline's tokens per prompt at T=0
    sampled_outputs: dict = field(default_factory=dict)  # temperature -> the baseline's tokens per prompt


def at_temperature(run: EvalRun, decoders: Decoders, temperature, comparator_names, costs, tuning, measured: Measured,
                   label: str) -> None:
    """Every prompt decoded at one temperature: its result (the chain, K tuned, the tree; at T=0 the divergences, the
    float32 reference's verdict and the comparators), added to `measured`."""
    cfg, prompts = run.recipe.eval, run.prompts
    base_runs, spec_runs, comp, tree_runs = evaluate_temperature(
        decoders, prompts, cfg, temperature, comparator_names if temperature == 0 else [], label=label)
    result = summarise_temperature(temperature, prompts, base_runs, spec_runs, cfg.k, costs)
    if tuning:
        result.update(tune_k(decoders, tuning, len(prompts), cfg, temperature, label=label))
    if tree_runs:
        result["tree"] = summarise_tree(cfg.tree, base_runs, tree_runs)
    measured.results.append(result)
    if temperature > 0:
        measured.sampled_outputs.setdefault(temperature, [r.tokens for r in base_runs])
        fastest_plain(result, {})  # the plain comparators run at T=0 only
        return
    # `lossless` stays strict; beside it, each divergence and how close a tie it was
    labelled = {f"chain K={k}": runs for k, runs in spec_runs.items()} | ({"tree": tree_runs} if tree_runs else {})
    result["divergences"] = divergences(run.runtime, prompts, base_runs, labelled)
    measured.greedy_outputs = [r.tokens for r in base_runs]
    reference = judge_against_reference(result, run.reference_model, run.reference_tokens, run.reference_skipped,
                                        prompts, base_runs, spec_runs, tree_runs, cfg.max_new_tokens, decoders.eos,
                                        decoders.pad_id)
    measured.comparators.update(comparator_report(comp, result, reference if run.reference_model is not None else None))
    fastest = fastest_plain(result, measured.comparators)
    for name in SPECULATIVE_COMPARATORS:
        if name in measured.comparators:
            vs_fastest(measured.comparators[name], measured.comparators[name]["per_prompt"],
                       result["fastest_plain_tokens_per_s"], fastest)


def offline_numbers(run: EvalRun, draft: kinds.LoadedDraft, decoders: Decoders, heldout: dict | None,
                    measured: Measured) -> tuple[dict, dict]:
    """The offline predictions beside the measured ones: held-out (training's), on the prompts' continuations
    (greedy; sampled at the lowest T > 0 measured), the chain replayed along the greedy ones; and the draft
    vocabulary's coverage of the greedy tokens."""
    cfg, ids = run.recipe.eval, [p.ids for p in run.prompts]
    greedy = measured.greedy_outputs
    if greedy is None:  # the offline metrics need the target's greedy continuations
        greedy = [decoders.baseline.decode(p, cfg.max_new_tokens).tokens for p in ids]
    coverage = vocab_coverage_eval(draft, greedy, run.target.config.vocab_size)
    offline = {"heldout": heldout, "prompts": offline_on_prompts(run.target, draft, ids, greedy),
               "chain_on_continuations": chain_tau.on_continuations(decoders.chain, ids, greedy, cfg.k,
                                                                    cfg.max_new_tokens)}
    if measured.sampled_outputs:  # T>0 is predicted on continuations sampled at that temperature, not greedy ones
        t = min(measured.sampled_outputs)
        offline["prompts_sampled"] = offline_on_prompts(
            run.target, draft, ids, measured.sampled_outputs[t], temperature=t,
            continuations_label=f"the target's own outputs sampled at T={t:g} (baseline)")
    return offline, coverage


def assemble_report(run: EvalRun, draft: kinds.LoadedDraft, checkpoint: str, step: int | None,
                    fingerprint: str | None, checks: dict, measured: Measured, note: str, offline: dict,
                    coverage: dict) -> dict:
    """The eval JSON of one checkpoint (checks: the exactness check and the forward costs)."""
    recipe, runtime = run.recipe, run.runtime
    return {
        "checkpoint": checkpoint,
        "step": step,
        "draft_kind": draft.kind.NAME,
        "target": recipe.target.path,
        "prompts": recipe.eval.prompts,
        "num_prompts": len(run.prompts),
        "max_new_tokens": recipe.eval.max_new_tokens,
        "k": recipe.eval.k,
        "hardware": devices.hardware(run.target.device),
        "checkpoint_fingerprint": fingerprint,
        "runtime": runtime.name,
        "exactness_check": checks["exactness"],
        "costs": checks["costs"],
        "eval_settings": eval_settings(recipe),
        "run_key": run_key(recipe, runtime.name),
        "plan": applied_plan(recipe),  # null: the recipe's sizes as written
        "code_version": provenance.git_commit(),
        "evaluated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "offline": offline,
        "results": measured.results,
        "comparators": measured.comparators,
        "comparators_note": note,
        "lossless_note": T0_LOSSLESS_NOTE,
        **coverage,
        "vocab_coverage_eval_note": VOCAB_COVERAGE_EVAL_NOTE,
    }


def evaluate_checkpoint(run: EvalRun, draft: kinds.LoadedDraft, checkpoint: str, step: int | None,
                        heldout: dict | None, with_comparators: bool = True, fingerprint: str | None = None) -> dict:
    """Everything measured for one draft (kinds.LoadedDraft: its kind is the report's draft_kind); the dict
    written to eval/<checkpoint>.<prompt set>.<runtime>.json.

    Comparators do not depend on the draft (but for assisted generation), so `run` measures them with the last
    checkpoint only (`with_comparators`), saving their decode time on every earlier one. `heldout`: training's
    held-out metrics of the checkpoint; `fingerprint`: checkpoint_fingerprint of the step dir.
    """
    cfg = run.recipe.eval
    runtime = run.runtime or make_runtime(run.target, cfg.runtime)  # casts the target (and the draft) to its dtype
    wanted = comparators.comparator_names(draft.module) if cfg.comparators and with_comparators else []
    decoders = build_decoders(run, draft, runtime)
    run = resolved(run, runtime)
    add_other_plain(decoders, run, wanted)
    tree = decoders.tree
    ks = [cfg.k, *cfg.k_sweep, *([tree.shape.verified_tokens - 1] if tree is not None else [])]
    checks = {"exactness": check_exactness(runtime, run.prompts, ks),
              "costs": measure_costs(runtime, run.prompts, cfg, tree)}
    tuning = load_tuning_prompts(cfg, run.tokenizer)
    measured = Measured()
    for temperature in run.recipe.temperatures:
        at_temperature(run, decoders, temperature, wanted, checks["costs"], tuning, measured, checkpoint)
    note = comparators_note(cfg, runtime, decoders.other_plain and decoders.other_plain[0], with_comparators,
                            measured.comparators)
    offline, coverage = offline_numbers(run, draft, decoders, heldout, measured)
    return assemble_report(run, draft, checkpoint, step, fingerprint, checks, measured, note, offline, coverage)


def run(recipe, args) -> list[Path]:
    which = getattr(args, "checkpoint", None) or recipe.eval.checkpoints
    steps = layout.select_checkpoints(recipe.run_dir, which)
    for step_dir in steps:  # before minutes of loading: a corrupt checkpoint is refused with one line
        integrity.check_checkpoint(step_dir, only=DRAFT_FILES)
    name = resolve_runtime_name(recipe.eval.runtime, load_target_config(recipe.target))
    family, dtype = parse_runtime(name)
    device = devices.resolve(recipe.device)
    devices.warn_if_bf16_emulated(DTYPES[dtype], device, f"the eval decodes with {name}", f"eval.runtime={family}-fp32")
    if short := one_device_shortfall(recipe.target, device):
        raise SpecdistillError(f"eval: {short}: the eval holds the target on one GPU (the cache pass alone spreads "
                               "it over several)")
    if (processes := spread.process_count(recipe, device, len(steps))) > 1:  # one process per GPU (eval/spread.py)
        return spread.spread(recipe, steps, processes, device, name)
    target, runtime = load_runtime(recipe.target, name, device)  # the target and every decoder of it run in its dtype
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
    shared = EvalRun(recipe, target, tokenizer, prompts, runtime, reference, reference_model, reference_skipped)
    for step_dir in steps:
        draft = kinds.load_draft(step_dir, target)
        report = evaluate_checkpoint(shared, draft, step_dir.name, layout.step_of(step_dir), heldout_metrics(step_dir),
                                     # assisted generation is the one comparator that reads the draft
                                     with_comparators=step_dir.name == last or
                                     comparators.assistant_of(draft.module) is not None,
                                     fingerprint=checkpoint_fingerprint(step_dir))
        report["tokens_seen"] = checkpoint_tokens_seen(step_dir)  # kept here too: keep_last may prune the checkpoint
        out = layout.eval_result(recipe.run_dir, step_dir.name, recipe.eval, name)  # never another prompt set's
        write_eval(out, report)
        for line in summary_lines(report):
            print(line, flush=True)
        written.append(out)
    return written
