"""`specdistill eval`: decode the eval prompts speculatively with each checkpoint; measure tau, alpha, speedup.

Per checkpoint and temperature, every prompt is decoded by plain AR (our baseline, same engine), then
speculatively at K = eval.k and each extra K of eval.k_sweep, then (T=0 only) by the transformers
comparators: interleaved per prompt so machine noise hits all of them alike. Writes
checkpoints/<run>/eval/<checkpoint>.json (format in the module's `evaluate_checkpoint`).
"""
from __future__ import annotations

import copy
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specdistill import device as devices
from specdistill import integrity, kinds, layout, metrics, provenance
from specdistill.errors import SpecdistillError
from specdistill.eval import chain_tau, comparators, exactness
from specdistill.eval.engine import SpeculativeDecoder, eos_token_ids, merge_counts
from specdistill.eval.prompts import load_prompts, load_tuning_prompts
from specdistill.eval.runtime import forward_costs, make_runtime, parse_runtime, resolve_runtime_name
from specdistill.eval.tree import TreeDecoder
from specdistill.formats import DRAFT_FILES, checkpoint_fingerprint, read_draft_config, read_metrics, write_eval
from specdistill.target import load_target, load_target_config, load_tokenizer

T0_LOSSLESS_NOTE = ("lossless is checked token by token at T=0 only; at T>0 exactness is the job of the "
                    "statistical test (tests/test_engine.py::test_sampling_distribution_matches_target)")


# ----------------------------------------------------------------------------- small pieces

def select_checkpoints(run_dir: Path, which: str | int | None) -> list[Path]:
    """'all', 'last', 'best' (the `best` link training keeps), n (n checkpoints evenly spread, the last
    included: enough points for the data-scaling curve without decoding with every one), or one
    checkpoint named step-N / step-000000N / N."""
    found = layout.checkpoints(run_dir)
    if not found:
        raise SpecdistillError(f"{run_dir}: no complete checkpoint (step-*/COMPLETE); run `specdistill train` first")
    if which in (None, "all"):
        return found
    if which == "last":
        return found[-1:]
    if which == "best":
        link = layout.best_link(run_dir)
        if not link.exists():
            raise SpecdistillError(f"--checkpoint best: {link} does not exist (training links it at each save)")
        best = [p for p in found if p.resolve() == link.resolve()]
        if not best:
            raise SpecdistillError(f"--checkpoint best: {link} points at {link.resolve().name}, not a complete checkpoint")
        return best
    if isinstance(which, int):
        n = max(1, which)
        picks = sorted({round(i * (len(found) - 1) / max(1, n - 1)) for i in range(n)}) if n > 1 else [len(found) - 1]
        return [found[i] for i in picks]
    step = layout.parse_step(which)
    if step is None:
        raise SpecdistillError(f"--checkpoint {which!r}: expected step-N, 'all', 'last' or 'best'")
    for p in found:
        if layout.step_of(p) == step:
            return [p]
    raise SpecdistillError(f"--checkpoint {which}: no complete checkpoint {layout.step_dir(run_dir, step)}; "
                           f"have: {', '.join(p.name for p in found)}")


def heldout_metrics(step_dir: Path) -> dict | None:
    """The offline metrics training wrote for this checkpoint (metrics.json -> heldout)."""
    saved = read_metrics(step_dir)
    if saved is None:
        return None
    held = saved.get("heldout", saved)
    if not isinstance(held, dict) or not any(k in held for k in metrics.OFFLINE_KEYS):
        return None
    return {k: held.get(k) for k in (*metrics.OFFLINE_KEYS, *metrics.HELDOUT_EXTRA_KEYS) if k in held}


def checkpoint_tokens_seen(step_dir: Path) -> int | None:
    """Cumulative training tokens (non-pad, all ranks) when this checkpoint was saved (metrics.json -> tokens_seen);
    None for checkpoints trained before train/loop.py recorded it."""
    try:
        value = (read_metrics(step_dir) or {}).get("tokens_seen")
    except (SpecdistillError, AttributeError):
        return None
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def reduced_draft_ids(draft, vocab_size: int) -> torch.Tensor | None:
    """The target ids of a head's reduced draft vocabulary (EAGLE-3: draft id i -> target id i + d2t[i]);
    None for drafts over the whole vocabulary."""
    ids = kinds.kind_of(draft).draft_vocabulary(draft)
    return ids.detach().cpu().long() if ids is not None and ids.numel() < vocab_size else None


VOCAB_COVERAGE_EVAL_NOTE = ("share of the target's plain greedy (T=0) output tokens on the eval prompts that lie in the "
                            "draft vocabulary: a greedy token outside it can never be accepted. The held-out "
                            "`vocab_coverage` is another quantity: the target's probability mass (T=1) inside it")


def vocab_coverage_eval(draft, outputs: list[list[int]], vocab_size: int) -> dict:
    """{vocab_coverage_eval, vocab_coverage_eval_tokens, draft_vocab_size}: the share of `outputs` (the target's
    greedy tokens) inside a reduced draft vocabulary; the coverage is None for heads without one."""
    ids = reduced_draft_ids(draft, vocab_size)
    tokens = [t for out in outputs for t in out]
    if ids is None:
        return {"vocab_coverage_eval": None, "vocab_coverage_eval_tokens": len(tokens), "draft_vocab_size": None}
    inside = torch.zeros(vocab_size, dtype=torch.bool, device="cpu")  # host bookkeeping over token lists
    inside[ids] = True
    hits = int(inside[torch.tensor(tokens, dtype=torch.long, device="cpu")].sum()) if tokens else 0
    return {"vocab_coverage_eval": hits / len(tokens) if tokens else None, "vocab_coverage_eval_tokens": len(tokens),
            "draft_vocab_size": int(ids.numel())}


def best_k(speedup_by_k: dict[str, float]) -> int:
    """The K whose measured speedup was highest (eval.k and every K of eval.k_sweep, same prompts and run)."""
    return int(max(speedup_by_k, key=lambda k: (speedup_by_k[k], -int(k))))


def predicted_speedup(tau: float, k: int, d: float, v: dict[str, float]) -> float | None:
    """tau / (K d + v(K+1)): the per-step speedup the measured costs predict (docs/DESIGN.md, Costs)."""
    vk = v.get(str(k + 1))
    return tau / (k * d + vk) if vk else None


# ----------------------------------------------------------------------------- offline on the prompts

@torch.inference_mode()
def offline_on_prompts(target, draft, prompt_ids: list[list[int]], continuations: list[list[int]],
                       temperature: float = 1.0, continuations_label: str | None = None) -> dict:
    """fkl, tvd, predicted_alpha, top1 at `temperature` over the continuation positions, teacher-forced:
    first-draft quantities (what alpha_at[0] measures), not pooled over depths.

    The continuation is the target's own output: greedy for the T=0 comparison (top-1), sampled at T for
    the T>0 one (predicted alpha). EAGLE heads read the target's real features (position t: token t+1 and
    f[t]), one step ahead, exactly as in training.
    """
    draft_kind = kinds.kind_of(draft)
    sums = {"fkl": 0.0, "tvd": 0.0, "top1": 0.0}
    reduced = reduced_draft_ids(draft, target.config.vocab_size)
    if reduced is not None:
        sums["vocab_coverage"] = 0.0
    positions = 0
    for prompt, cont in zip(prompt_ids, continuations):
        if not cont or len(prompt) < 2:
            continue
        seq = torch.tensor([prompt + cont], device=target.device)
        p_logits, q_logits = draft_kind.prompt_logits(draft, target, seq)  # row j predicts token j+1
        rows = slice(len(prompt) - 1, seq.shape[1] - 1)  # predictions of the continuation tokens
        log_p = torch.log_softmax(p_logits[rows].float() / temperature, -1)
        log_q = torch.log_softmax(q_logits[rows].float() / temperature, -1)
        per = metrics.divergences(log_p, log_q, ("fkl", "tvd"))
        sums["fkl"] += per["fkl"].sum().item()
        sums["tvd"] += per["tvd"].sum().item()
        sums["top1"] += (log_p.argmax(-1) == log_q.argmax(-1)).sum().item()
        if reduced is not None:  # the target's probability mass inside the draft vocabulary (held-out's definition)
            sums["vocab_coverage"] += log_p.exp()[:, reduced.to(log_p.device)].sum(-1).sum().item()
        positions += log_p.shape[0]
    if positions == 0:
        return {"positions": 0}
    out = {k: v / positions for k, v in sums.items()}
    out["predicted_alpha"] = 1.0 - out["tvd"]
    out["distribution"] = "full vocabulary"
    if draft_kind.PROMPTS_FKL_NOTE:  # q is zero outside a reduced draft vocabulary: KL(p||q) is infinite there
        out["fkl"] = None
        out["note"] = draft_kind.PROMPTS_FKL_NOTE
        out["distribution"] = f"full vocabulary (q zero outside the {draft_kind.LABEL} draft vocabulary)"
    return {**out, "positions": positions, "temperature": temperature,
            "continuations": continuations_label or "the target's own greedy outputs (baseline, T=0)"}


# ----------------------------------------------------------------------------- one checkpoint

def _speedup(spec: dict, base: dict) -> float:
    return spec["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else 0.0


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


def evaluate_temperature(decoders: Decoders, prompts, eval_cfg, temperature, comparator_names, label=""):
    """Decode every prompt: baseline, K, the K sweep, (T=0) the tree and the comparators, interleaved per prompt.

    A warm-up decode of each decoder runs first; within a prompt the baseline runs first on even prompts and
    after the speculative runs on odd ones, so whatever a run leaves behind (caches, clocks) favours neither."""
    baseline, chain, tree = decoders.baseline, decoders.chain, decoders.tree
    ks = [eval_cfg.k] + sorted({k for k in eval_cfg.k_sweep if k != eval_cfg.k})
    base_runs, spec_runs, tree_runs = [], {k: [] for k in ks}, []
    comp = {name: {"tokens": 0, "seconds": 0.0, "outputs": []} for name in comparator_names}
    dev = decoders.target.device

    def generator(seed):  # the same seed for every decoder of a prompt, on the device it samples on
        return devices.generator(dev, seed)
    if prompts:
        warm_up([baseline, chain, tree if temperature == 0 else None], prompts[0].ids, temperature, dev)
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
        for name in comparator_names:
            tokens, seconds = comparators.run_comparator(name, decoders.target, prompt.ids, eval_cfg.max_new_tokens,
                                                         decoders.eos, decoders.pad_id, draft=decoders.draft, k=eval_cfg.k)
            comp[name]["tokens"] += len(tokens)
            comp[name]["seconds"] += seconds
            comp[name]["outputs"].append(tokens)
    return base_runs, spec_runs, comp, tree_runs


@torch.inference_mode()
def divergences(runtime, prompts, base_runs, runs_by_label: dict) -> list[dict]:
    """Where a T=0 decode left plain greedy decoding: per run that differs, the first differing position
    and the gap between the top-2 logits of plain decoding's own forward there (a gap at rounding level
    means a near-tie that batched and 1-token forwards broke differently, not a wrong engine)."""
    found = []
    for label, runs in runs_by_label.items():
        for i, (run, base) in enumerate(zip(runs, base_runs)):
            if run.tokens == base.tokens:
                continue
            at = next((j for j, (a, b) in enumerate(zip(run.tokens, base.tokens)) if a != b),
                      min(len(run.tokens), len(base.tokens)))
            ids = torch.tensor(prompts[i].ids + base.tokens[:at], device=runtime.device)
            runtime.reset(ids.numel() + 8)
            logits, _ = runtime.forward(ids, 0, logits_to_keep=1)
            top = logits[-1].float().topk(2).values
            found.append({"decoder": label, "prompt": i, "position": at, "top2_logit_gap": float(top[0] - top[1])})
    return found


def measure_costs(runtime, prompts, cfg, tree=None) -> dict:
    """The runtime's cost curve: ms of one forward over M = 1..9 new tokens (and the tree's size) after a
    128-token cached prefix of real prompt text, and v(M) = ms(M) / ms(1)."""
    ids = [t for p in prompts for t in p.ids] or [0]
    sizes = list(range(1, 10))
    if tree is not None:
        sizes.append(tree.shape.verified_tokens)
    while len(ids) < 128 + max(sizes):
        ids = ids + ids
    ms = forward_costs(runtime, torch.tensor(ids[:128 + max(sizes)], device=runtime.device), sorted(set(sizes)),
                       repeats=15)
    return {"runtime": runtime.name, "prefix_tokens": 128, "forward_ms": ms,
            "v": {m: t / ms["1"] for m, t in ms.items()}, "tree_tokens": sizes[-1] if tree is not None else None}


def cost_terms(spec: dict, tau_by_k: dict, costs: dict | None) -> dict:
    """d = ms per draft step / ms of a 1-token forward; the speedup tau / (K d + v(K+1)) predicts per K."""
    if not costs:
        return {}
    d = spec["ms_per_draft_step"] / costs["forward_ms"]["1"]
    return {"d": d, "predicted_speedup_by_k": {k: predicted_speedup(tau, int(k), d, costs["v"])
                                               for k, tau in tau_by_k.items()}}


def summarise_tree(tree_cfg, base_runs, tree_runs) -> dict:
    """Tree drafting at T=0 against the same baseline runs: tau, alpha per depth, speedup, lossless."""
    t, base = merge_counts(tree_runs), merge_counts(base_runs)
    return {"shape": tree_cfg.model_dump(exclude_none=True), "tau": t["tau"], "alpha": t["alpha"], "alpha_at": t["alpha_at"],
            "speedup": _speedup(t, base), "tokens_per_s": t["tokens_per_s"], "ms_per_verify": t["ms_per_verify"],
            "ms_per_draft_step": t["ms_per_draft_step"], "ms_per_token": t["ms_per_token"],
            "nodes_per_step": sum(r.nodes for r in tree_runs) / max(1, t["steps"]),
            "lossless": all(a.tokens == b.tokens for a, b in zip(tree_runs, base_runs))}


BOOTSTRAP_SAMPLES = 2000
CI_NOTE = (f"95% percentile bootstrap over prompts ({BOOTSTRAP_SAMPLES} resamples of the prompt set, seed 0): "
           "tau, alpha and speedup recomputed from the pooled counts and times of each resample")


def bootstrap_ci95(base_runs, spec_runs, samples: int = BOOTSTRAP_SAMPLES, seed: int = 0) -> dict:
    """[low, high] 95% percentile intervals of tau, alpha and speedup, resampling prompts with replacement.

    Each resample pools its prompts exactly as the point estimates do (sum of tokens / sum of steps, ...)."""
    first = lambda counts: counts[0] if counts else 0  # noqa: E731  (depth 0: the first drafted token)
    per = [(len(s.tokens), s.steps, sum(s.accepted), sum(s.tested), s.total_s, len(b.tokens), b.total_s,
            first(s.accepted), first(s.tested)) for s, b in zip(spec_runs, base_runs)]
    n = len(per)
    if n == 0:
        return {"tau_ci95": None, "alpha_ci95": None, "speedup_ci95": None, "alpha_first_ci95": None}
    rng = random.Random(seed)
    taus, alphas, speedups, firsts = [], [], [], []
    for _ in range(samples):
        pick = [per[rng.randrange(n)] for _ in range(n)]
        tok, steps, acc, tested, secs, btok, bsecs, acc0, tested0 = (sum(x) for x in zip(*pick))
        taus.append(tok / steps if steps else 0.0)
        alphas.append(acc / tested if tested else 0.0)
        speedups.append((tok / secs) / (btok / bsecs) if secs and bsecs and btok else 0.0)
        firsts.append(acc0 / tested0 if tested0 else 0.0)

    def interval(xs):
        xs = sorted(xs)
        return [xs[int(0.025 * (len(xs) - 1))], xs[int(round(0.975 * (len(xs) - 1)))]]

    return {"tau_ci95": interval(taus), "alpha_ci95": interval(alphas), "speedup_ci95": interval(speedups),
            "alpha_first_ci95": interval(firsts)}


def summarise_temperature(temperature, prompts, base_runs, spec_runs, main_k, costs: dict | None = None) -> dict:
    """costs: the runtime's measured forward cost curve (`measure_costs`), for d and the predicted speedups."""
    base, spec = merge_counts(base_runs), merge_counts(spec_runs[main_k])
    speedup_by_k = {str(k): _speedup(merge_counts(runs), base) for k, runs in sorted(spec_runs.items())}
    tau_by_k = {str(k): merge_counts(runs)["tau"] for k, runs in sorted(spec_runs.items())}
    k_best = best_k(speedup_by_k)
    lossless = None
    if temperature == 0:
        lossless = all(s.tokens == b.tokens for runs in spec_runs.values() for s, b in zip(runs, base_runs))
    per_category = {}
    for cat in sorted({p.category for p in prompts}):
        idx = [i for i, p in enumerate(prompts) if p.category == cat]
        s = merge_counts([spec_runs[main_k][i] for i in idx])
        b = merge_counts([base_runs[i] for i in idx])
        per_category[cat] = {"tau": s["tau"], "alpha": s["alpha"], "speedup": _speedup(s, b), "num_prompts": len(idx)}
    return {
        "temperature": temperature,
        "tau": spec["tau"],
        "alpha": spec["alpha"],
        "alpha_at": spec["alpha_at"],
        "tested_at": spec["tested_at"],
        "speedup": _speedup(spec, base),
        "tokens_per_s": spec["tokens_per_s"],
        "baseline_tokens_per_s": base["tokens_per_s"],
        "lossless": lossless,
        "ms_per_draft_step": spec["ms_per_draft_step"],
        "ms_per_verify": spec["ms_per_verify"],
        "ms_per_token": spec["ms_per_token"],
        "baseline_ms_per_token": base["ms_per_token"],
        "baseline_ms_per_verify": base["ms_per_verify"],
        "tau_by_k": tau_by_k,
        "speedup_by_k": speedup_by_k,
        **cost_terms(spec, tau_by_k, costs),
        "best_k": k_best,
        "best_k_from": f"the highest measured speedup over K in {sorted(int(k) for k in speedup_by_k)} on the "
                       "reported prompts themselves (not a held-out choice: set eval.tuning_prompts)",
        "predicted_tau_leviathan": metrics.leviathan_tau(spec["alpha"], main_k),
        **bootstrap_ci95(base_runs, spec_runs[main_k]),
        "ci95_by_k": {str(k): bootstrap_ci95(base_runs, runs) for k, runs in sorted(spec_runs.items())},
        "ci_method": CI_NOTE,
        "tokens": spec["tokens"],
        "steps": spec["steps"],
        "per_category": per_category,
    }


def tune_k(decoders: Decoders, tuning, reported: int, eval_cfg, temperature, label="") -> dict:
    """best_k chosen on the tuning prompts (disjoint from the reported ones): baseline and every K decoded
    there, the K with the highest measured speedup."""
    chain_only = Decoders(decoders.target, decoders.draft, decoders.chain, decoders.baseline, None, decoders.eos,
                          decoders.pad_id)
    base_runs, spec_runs, _, _ = evaluate_temperature(chain_only, tuning, eval_cfg, temperature, [],
                                                      label=f"{label} tuning")
    base = merge_counts(base_runs)
    speedup_by_k = {str(k): _speedup(merge_counts(runs), base) for k, runs in sorted(spec_runs.items())}
    return {"best_k": best_k(speedup_by_k), "tuning_speedup_by_k": speedup_by_k,
            "best_k_from": f"the highest measured speedup over K in {sorted(int(k) for k in speedup_by_k)} on "
                           f"{len(tuning)} tuning prompts disjoint from the {reported} reported ones "
                           "(eval.tuning_prompts)"}


def eval_settings(recipe) -> dict:
    """The recipe's eval section as JSON: a result measured under other settings is not this recipe's."""
    return recipe.eval.model_dump(mode="json")


def run_key(recipe, runtime_name: str | None = None) -> dict:
    """What else a result depends on besides its checkpoint and eval settings: the target (its recipe section),
    the runtime eval.runtime resolved to, and the decoding code (a fingerprint of its files); the report marks a
    result stale when any differs. runtime_name: the resolved runtime (resolved from the target's config if None)."""
    if runtime_name is None:
        runtime_name = resolve_runtime_name(recipe.eval.runtime, load_target_config(recipe.target))
    return {"target": recipe.target.model_dump(mode="json"), "runtime": runtime_name,
            "decode_code": provenance.code_fingerprint()}


def transformers_greedy(target, prompts, max_new_tokens: int, eos, pad_id) -> list[list[int]]:
    """transformers' own greedy generate() tokens for each prompt (untimed): the reference of lossless."""
    return [comparators.run_comparator("hf_generate", target, p.ids, max_new_tokens, eos, pad_id)[0] for p in prompts]


def fp32_reference_model(target):
    """The target in float32 for the lossless reference: itself when it is float32, else a float32 copy of the
    weights it runs with (`run` loads the float32 target from disk instead)."""
    return target if target.dtype == torch.float32 else copy.deepcopy(target).float()


@torch.inference_mode()
def reference_divergences(reference_model, prompts, reference: list[list[int]], runs_by_label: dict) -> list[dict]:
    """Each of our T=0 decodes that differs from transformers' fp32 greedy output: the first differing position
    and the gap between the reference model's top-2 logits there (a gap near 0 is a near-tie that fp32 and our
    runtime's precision break differently, not a wrong engine)."""
    found = []
    for label, runs in runs_by_label.items():
        for i, (run, want) in enumerate(zip(runs, reference)):
            want = list(want)
            if run.tokens == want:
                continue
            at = next((j for j, (a, b) in enumerate(zip(run.tokens, want)) if a != b), min(len(run.tokens), len(want)))
            ids = torch.tensor([prompts[i].ids + want[:at]], device=reference_model.device)
            logits = reference_model(ids).logits[0, -1].float()
            top = logits.topk(2).values
            found.append({"decoder": label, "prompt": i, "position": at, "top2_logit_gap": float(top[0] - top[1])})
    return found


def lossless_vs_reference(reference: list[list[int]], base_runs, spec_runs, tree_runs) -> tuple[bool, list[int]]:
    """Every greedy decode of ours (baseline, each K, the tree) token-identical to the reference; mismatching prompts."""
    bad = set()
    for runs in [base_runs, tree_runs, *spec_runs.values()]:
        bad |= {i for i, (r, want) in enumerate(zip(runs, reference)) if r.tokens != list(want)}
    return not bad, sorted(bad)


def evaluate_checkpoint(recipe, target, tokenizer, draft, prompts, checkpoint: str, step: int | None,
                        draft_kind: str, heldout: dict | None, with_comparators: bool = True,
                        reference_tokens: list[list[int]] | None = None, fingerprint: str | None = None,
                        runtime=None, reference_model=None) -> dict:
    """Everything measured for one draft; the dict written to eval/<checkpoint>.json.

    Comparators do not depend on the draft (but for assisted generation), so `run` measures them with
    the last checkpoint only (`with_comparators`), saving their decode time on every earlier one.
    `reference_tokens`: transformers' float32 greedy generate() output per prompt, by `reference_model` (the
    float32 target; computed here when not given); `fingerprint`: checkpoint_fingerprint of the step dir;
    `runtime`: the target's runtime (eval/runtime.py; default: eval.runtime of the recipe).
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

    ks = [cfg.k, *cfg.k_sweep, *([tree.shape.verified_tokens - 1] if tree is not None else [])]
    exact = exactness.verify_rows_match(runtime, prompts[0].ids, ks) if prompts else None
    if exact is not None and not exact["exact"]:
        print(f"warning: {runtime.name} is not batch-invariant on this machine (a verify row differs from its 1-token "
              f"forward: {exact['checks']}); T=0 decodes may diverge from plain decoding", flush=True)
    costs = measure_costs(runtime, prompts, cfg, tree)
    tuning = load_tuning_prompts(cfg, tokenizer)
    results, comp_report, greedy_outputs, sampled_outputs = [], {}, None, {}
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
            reference_model = reference_model or fp32_reference_model(target)
            reference = reference_tokens
            if reference is None:
                reference = transformers_greedy(reference_model, prompts, cfg.max_new_tokens, eos, pad_id)
            # the chain (baseline and every K) and the tree are judged apart: a tree tie says nothing of the chain
            result["lossless_vs_transformers"], mismatched = lossless_vs_reference(reference, base_runs, spec_runs, [])
            result["transformers_mismatched_prompts"] = mismatched
            chain_runs = {"baseline": base_runs, **{f"chain K={k}": runs for k, runs in spec_runs.items()}}
            result["transformers_divergences"] = reference_divergences(reference_model, prompts, reference, chain_runs)
            result["lossless_vs_transformers_reference"] = (
                "transformers generate(), greedy, float32 weights (batch-invariant enough to be the reference); each "
                "divergence of ours is listed with the reference's top-2 logit gap at its first differing token")
            if tree_runs:
                result["tree"]["lossless_vs_transformers"] = lossless_vs_reference(reference, [], {}, tree_runs)[0]
                result["tree"]["transformers_divergences"] = reference_divergences(reference_model, prompts, reference,
                                                                                    {"tree": tree_runs})
            base_tps = result["baseline_tokens_per_s"]
            for name, c in comp.items():
                tps = c["tokens"] / c["seconds"] if c["seconds"] else 0.0
                comp_report[name] = {"tokens_per_s": tps, "speedup": tps / base_tps if base_tps else 0.0}
        plain = {"ours": result["baseline_tokens_per_s"]}
        if "hf_generate" in comp_report and temperature == 0:  # generate() is timed at T=0 only
            plain["hf_generate"] = comp_report["hf_generate"]["tokens_per_s"]
        fastest = max(plain, key=plain.get)
        result["fastest_plain"] = fastest
        result["speedup_vs_fastest_plain"] = result["tokens_per_s"] / plain[fastest] if plain[fastest] else 0.0
    comp_note = (f"transformers decoders, greedy (T=0), same prompts and max_new_tokens, on the same weights "
                 f"in the same dtype ({str(runtime.dtype).removeprefix('torch.')}) through transformers' own "
                 f"forward and DynamicCache (the closest configuration to our {runtime.name}); speedup vs our baseline")
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


def summary_line(report: dict, r: dict) -> str:
    lossless = {True: "yes", False: "NO", None: "n/a (T>0)"}[r["lossless"]]
    vs_hf = {True: " (transformers: yes)", False: " (transformers: NO)"}.get(r.get("lossless_vs_transformers"), "")
    ci = (f"  speedup 95% CI [{r['speedup_ci95'][0]:.2f}, {r['speedup_ci95'][1]:.2f}]"
          if r.get("speedup_ci95") else "")
    return (f"{report['checkpoint']} T={r['temperature']:g} K={report['k']}: tau {r['tau']:.2f}  "
            f"alpha {r['alpha']:.3f}  speedup {r['speedup']:.2f}x ({r['tokens_per_s']:.1f} vs "
            f"{r['baseline_tokens_per_s']:.1f} tok/s)  draft {r['ms_per_draft_step']:.1f} ms/step  "
            f"verify {r['ms_per_verify']:.1f} ms  lossless {lossless}{vs_hf}  best K {r['best_k']}{ci}")


# ----------------------------------------------------------------------------- the stage

def run(recipe, args) -> list[Path]:
    which = getattr(args, "checkpoint", None) or recipe.eval.checkpoints
    steps = select_checkpoints(recipe.run_dir, which)
    for step_dir in steps:  # before minutes of loading: a corrupt checkpoint is refused with one line
        integrity.check_checkpoint(step_dir, only=DRAFT_FILES)
    # loaded straight in the runtime's dtype: target.dtype is what the cache pass ran in, and a bf16 load
    # cast up to fp32 would not be the fp32 target
    name = resolve_runtime_name(recipe.eval.runtime, load_target_config(recipe.target))
    target = load_target(recipe.target.model_copy(update={"dtype": parse_runtime(name)[1]}),
                         device=devices.resolve(recipe.device))
    runtime = make_runtime(target, name)  # the target and every decoder of it run in its dtype
    tokenizer = load_tokenizer(recipe.target)
    prompts = load_prompts(recipe.eval, tokenizer)
    reference, reference_model = None, None
    if 0 in recipe.temperatures or 0.0 in recipe.temperatures:  # transformers' greedy tokens, once per run
        eos = eos_token_ids(target, tokenizer)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos), 0)
        # the lossless reference runs in float32, loaded from disk (not the runtime's cast weights)
        reference_model = (target if target.dtype == torch.float32 else
                           load_target(recipe.target.model_copy(update={"dtype": "float32"}), device=target.device))
        reference = transformers_greedy(reference_model, prompts, recipe.eval.max_new_tokens, eos, pad_id)
    written = []
    for step_dir in steps:
        draft = kinds.load_draft(step_dir, target)
        report = evaluate_checkpoint(recipe, target, tokenizer, draft, prompts, step_dir.name, layout.step_of(step_dir),
                                     read_draft_config(step_dir)["kind"], heldout_metrics(step_dir),
                                     # assisted generation is the one comparator that reads the draft
                                     with_comparators=step_dir == steps[-1] or comparators.assistant_of(draft) is not None,
                                     reference_tokens=reference, reference_model=reference_model,
                                     fingerprint=checkpoint_fingerprint(step_dir),
                                     runtime=runtime)
        report["tokens_seen"] = checkpoint_tokens_seen(step_dir)  # kept here too: keep_last may prune the checkpoint
        out = layout.eval_dir(recipe.run_dir) / f"{step_dir.name}.json"
        write_eval(out, report)
        for r in report["results"]:
            print(summary_line(report, r), flush=True)
            if "tree" in r:
                t = r["tree"]
                print(f"{report['checkpoint']} T=0 tree {t['shape']}: tau {t['tau']:.2f}  speedup {t['speedup']:.2f}x  "
                      f"{t['nodes_per_step']:.1f} nodes/step  verify {t['ms_per_verify']:.1f} ms  "
                      f"lossless {'yes' if t['lossless'] else 'NO'}", flush=True)
        for name, c in report["comparators"].items():
            print(f"{report['checkpoint']} comparator {name}: {c['tokens_per_s']:.1f} tok/s, "
                  f"speedup {c['speedup']:.2f}x vs our baseline", flush=True)
        written.append(out)
    return written
