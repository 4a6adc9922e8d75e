"""What one checkpoint's decodes add up to: τ, α, speedup per temperature and per K, bootstrap intervals over
prompts, the best K, the tree's numbers, and the runtime's cost curve with the speedups it predicts."""
from __future__ import annotations

import random

import torch

from specdistill import metrics
from specdistill.eval.engine import merge_counts
from specdistill.eval.runtime import forward_costs


def speedup_over(spec: dict, base: dict) -> float:
    """Tokens/s of merged decodes `spec` over those of `base` (engine.merge_counts)."""
    return spec["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else 0.0


def best_k(speedup_by_k: dict[str, float]) -> int:
    """The K whose measured speedup was highest (eval.k and every K of eval.k_sweep, same prompts and run)."""
    return int(max(speedup_by_k, key=lambda k: (speedup_by_k[k], -int(k))))


def predicted_speedup(tau: float, k: int, d: float, v: dict[str, float]) -> float | None:
    """tau / (K d + v(K+1)): the per-step speedup the measured costs predict (docs/DESIGN.md, Costs)."""
    vk = v.get(str(k + 1))
    return tau / (k * d + vk) if vk else None


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
    """Tree drafting at T=0 against the same baseline runs: tau, alpha per depth, speedup, lossless, the 95%
    intervals and the per-prompt records they are recomputed from."""
    t, base = merge_counts(tree_runs), merge_counts(base_runs)
    records = per_prompt(tree_runs, base_runs)
    return {"shape": tree_cfg.model_dump(exclude_none=True), "tau": t["tau"], "alpha": t["alpha"], "alpha_at": t["alpha_at"],
            "speedup": speedup_over(t, base), "tokens_per_s": t["tokens_per_s"], "ms_per_verify": t["ms_per_verify"],
            "ms_per_draft_step": t["ms_per_draft_step"], "ms_per_token": t["ms_per_token"],
            "nodes_per_step": sum(r.nodes for r in tree_runs) / max(1, t["steps"]),
            "lossless": all(a.tokens == b.tokens for a, b in zip(tree_runs, base_runs)),
            **bootstrap_per_prompt(records), "per_prompt": records}


BOOTSTRAP_SAMPLES = 2000


CI_NOTE = (f"95% percentile bootstrap over prompts ({BOOTSTRAP_SAMPLES} resamples of the prompt set, seed 0): "
           "tau, alpha and speedup recomputed from the pooled counts and times of each resample")


def per_prompt(spec_runs, base_runs) -> list[dict]:
    """Each prompt's counts and times, speculative and baseline side by side: what every interval of a result is
    recomputed from (`bootstrap_per_prompt`), kept in the eval JSON."""
    first = lambda counts: counts[0] if counts else 0  # noqa: E731  (depth 0: the first drafted token)
    return [{"tokens": len(s.tokens), "steps": s.steps, "accepted": sum(s.accepted), "tested": sum(s.tested),
             "accepted_first": first(s.accepted), "tested_first": first(s.tested), "seconds": s.total_s,
             "baseline_tokens": len(b.tokens), "baseline_seconds": b.total_s} for s, b in zip(spec_runs, base_runs)]


def timed_per_prompt(tokens_seconds) -> list[dict]:
    """A plain or comparator decoder's per-prompt record: [{tokens, seconds}] from (tokens, seconds) pairs."""
    return [{"tokens": int(n), "seconds": float(s)} for n, s in tokens_seconds]


def resamples(n: int, samples: int = BOOTSTRAP_SAMPLES, seed: int = 0):
    """The bootstrap's prompt picks: `samples` lists of n indices drawn with replacement, the same for every
    interval of one result (seed 0), so intervals over the same prompts are paired."""
    rng = random.Random(seed)
    for _ in range(samples):
        yield [rng.randrange(n) for _ in range(n)]


def interval(xs, level: float = 0.95) -> list[float]:
    """The percentile interval holding `level` of xs (95% unless a family of tests asks for more)."""
    xs, tail = sorted(xs), (1 - level) / 2
    return [xs[int(tail * (len(xs) - 1))], xs[int(round((1 - tail) * (len(xs) - 1)))]]


def bootstrap_per_prompt(records: list[dict], samples: int = BOOTSTRAP_SAMPLES, seed: int = 0) -> dict:
    """[low, high] 95% percentile intervals of tau, alpha and speedup from per-prompt records (`per_prompt`),
    resampling prompts with replacement; each resample pools its prompts exactly as the point estimates do."""
    keys = ("tokens", "steps", "accepted", "tested", "seconds", "baseline_tokens", "baseline_seconds",
            "accepted_first", "tested_first")
    per = [tuple(r[k] for k in keys) for r in records]
    if not per:
        return {"tau_ci95": None, "alpha_ci95": None, "speedup_ci95": None, "alpha_first_ci95": None}
    taus, alphas, firsts = [], [], []
    for pick in resamples(len(per), samples, seed):
        tok, steps, acc, tested, secs, btok, bsecs, acc0, tested0 = (sum(x) for x in zip(*(per[i] for i in pick)))
        taus.append(tok / steps if steps else 0.0)
        alphas.append(acc / tested if tested else 0.0)
        firsts.append(acc0 / tested0 if tested0 else 0.0)
    return {"tau_ci95": interval(taus), "alpha_ci95": interval(alphas),
            "speedup_ci95": ratio_ci95(spec_timed(records), baseline_timed(records), samples, seed),
            "alpha_first_ci95": interval(firsts)}


def bootstrap_ci95(base_runs, spec_runs, samples: int = BOOTSTRAP_SAMPLES, seed: int = 0) -> dict:
    """[low, high] 95% percentile intervals of tau, alpha and speedup, resampling prompts with replacement."""
    return bootstrap_per_prompt(per_prompt(spec_runs, base_runs), samples, seed)


def ratio_ci95(num: list[dict], den: list[dict], samples: int = BOOTSTRAP_SAMPLES, seed: int = 0) -> list[float] | None:
    """The 95% interval of one decoder's pooled tokens/s over another's on the same prompts (per-prompt
    [{tokens, seconds}] each), by the same resamples as `bootstrap_per_prompt`: with `den` the baseline it is
    speedup_ci95 itself; with the fastest plain decoder, the interval of the speedup over it."""
    per = [(a["tokens"], a["seconds"], b["tokens"], b["seconds"]) for a, b in zip(num, den)]
    if not per or len(num) != len(den):
        return None
    ratios = []
    for pick in resamples(len(per), samples, seed):
        tok, secs, btok, bsecs = (sum(x) for x in zip(*(per[i] for i in pick)))
        ratios.append((tok / secs) / (btok / bsecs) if secs and bsecs and btok else 0.0)
    return interval(ratios)


def spec_timed(records: list[dict]) -> list[dict]:
    """The speculative side of per-prompt records as [{tokens, seconds}] (for `ratio_ci95`)."""
    return [{"tokens": r["tokens"], "seconds": r["seconds"]} for r in records]


def baseline_timed(records: list[dict]) -> list[dict]:
    """The baseline side of per-prompt records as [{tokens, seconds}] (for `ratio_ci95`)."""
    return [{"tokens": r["baseline_tokens"], "seconds": r["baseline_seconds"]} for r in records]


def summarise_temperature(temperature, prompts, base_runs, spec_runs, main_k, costs: dict | None = None) -> dict:
    """costs: the runtime's measured forward cost curve (`measure_costs`), for d and the predicted speedups."""
    base, spec = merge_counts(base_runs), merge_counts(spec_runs[main_k])
    speedup_by_k = {str(k): speedup_over(merge_counts(runs), base) for k, runs in sorted(spec_runs.items())}
    tau_by_k = {str(k): merge_counts(runs)["tau"] for k, runs in sorted(spec_runs.items())}
    k_best = best_k(speedup_by_k)
    records = per_prompt(spec_runs[main_k], base_runs)
    lossless = None
    if temperature == 0:
        lossless = all(s.tokens == b.tokens for runs in spec_runs.values() for s, b in zip(runs, base_runs))
    per_category = {}
    for cat in sorted({p.category for p in prompts}):
        idx = [i for i, p in enumerate(prompts) if p.category == cat]
        s = merge_counts([spec_runs[main_k][i] for i in idx])
        b = merge_counts([base_runs[i] for i in idx])
        per_category[cat] = {"tau": s["tau"], "alpha": s["alpha"], "speedup": speedup_over(s, b), "num_prompts": len(idx)}
    return {
        "temperature": temperature,
        "tau": spec["tau"],
        "alpha": spec["alpha"],
        "alpha_at": spec["alpha_at"],
        "tested_at": spec["tested_at"],
        "speedup": speedup_over(spec, base),
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
        **bootstrap_per_prompt(records),
        "ci95_by_k": {str(k): bootstrap_ci95(base_runs, runs) for k, runs in sorted(spec_runs.items())},
        "ci_method": CI_NOTE,
        "tokens": spec["tokens"],
        "steps": spec["steps"],
        "per_category": per_category,
        "per_prompt": records,
    }
