"""Lossless at T=0, judged two ways: against our own plain decoding (where a decode left it, and how close a tie
the target's logits had there) and against transformers' own greedy generate() in float32 (the reference; its
float32 copy loaded only where the device holds it)."""
from __future__ import annotations

import copy

import torch

from specdistill.eval import comparators
from specdistill.eval.tables import FP32_PLAIN


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


def transformers_greedy(target, prompts, max_new_tokens: int, eos, pad_id) -> list[list[int]]:
    """transformers' own greedy generate() tokens for each prompt (untimed): the reference of lossless."""
    return [comparators.run_comparator("hf_generate", target, p.ids, max_new_tokens, eos, pad_id)[0] for p in prompts]


# The float32 copy of a reduced-precision target (the lossless reference and plain_static-fp32's weights) takes
# 4 bytes per parameter beside the target's own: 32.1 GB for Llama-3.1-8B. On CUDA it is loaded only where the
# device's free memory holds it with this margin (generate()'s activations, the allocator's slack).
FP32_REFERENCE_MARGIN = 1.1
FP32_REFERENCE_SLACK_BYTES = 2**30


def fp32_reference_skipped(target, setting: str | bool = "auto") -> str | None:
    """Why the float32 reference is not loaded (one line, for the log and the eval JSON), or None to load it.
    `setting` is eval.fp32_reference: false never loads it, true always does; auto skips it on CUDA when the
    device's free memory is short of 4 bytes per parameter (with the margin). Elsewhere (a float32 target is its
    own reference; the host's memory is not measured) auto loads it."""
    if target.dtype == torch.float32 or setting is True:
        return None
    if setting is False:
        return (f"eval.fp32_reference is false: the float32 reference is not loaded, so lossless_vs_transformers "
                f"and the {FP32_PLAIN} comparator are skipped (lossless against our own plain decoding is still checked)")
    if target.device.type != "cuda":
        return None
    params = sum(p.numel() for p in target.parameters())
    need = 4 * params * FP32_REFERENCE_MARGIN + FP32_REFERENCE_SLACK_BYTES
    free, _ = torch.cuda.mem_get_info(target.device)
    if free >= need:
        return None
    return (f"the float32 reference (4 bytes x {params / 1e9:.2f}B parameters = {4 * params / 1e9:.1f} GB) needs "
            f"{need / 1e9:.1f} GB with its margin, {free / 1e9:.1f} GB are free on {target.device}: not loaded, so "
            f"lossless_vs_transformers and the {FP32_PLAIN} comparator are skipped (lossless against our own plain "
            f"decoding is still checked; eval.fp32_reference=true loads it anyway)")


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


def judge_against_reference(result: dict, reference_model, reference: list[list[int]] | None, reference_skipped,
                            prompts, base_runs, spec_runs: dict, tree_runs, max_new_tokens: int, eos, pad_id):
    """The T=0 result judged against transformers' float32 greedy output (`reference`, computed by
    `reference_model` when not given): lossless_vs_transformers for the chain (baseline and every K) and, apart,
    the tree, with each divergence and the reference's top-2 logit gap there. Without the float32 model (too
    little device memory) the verdict is None with `reference_skipped`, said, not guessed. Returns the reference."""
    if reference_model is None:
        result["lossless_vs_transformers"] = None
        result["lossless_vs_transformers_skipped"] = reference_skipped
        if tree_runs:
            result["tree"]["lossless_vs_transformers"] = None
        return None
    if reference is None:
        reference = transformers_greedy(reference_model, prompts, max_new_tokens, eos, pad_id)
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
    return reference
