"""The eval's own exactness check, run before anything is measured.

Greedy speculative decoding is token-identical to plain decoding only if a token's logits do not depend on
how many tokens share its forward: 1 in plain decoding, K+1 in a verify. That is a property of the kernels
on the machine the eval runs on (docs/DESIGN.md, Exactness), so the eval observes it there: K+1-row
verifies of the first prompt's greedy continuation against the same tokens' 1-token forwards.
"""
from __future__ import annotations

import torch

METHOD = ("each row of a K+1-token verify of the first prompt's greedy continuation against that token's "
          "1-token forward (plain decoding's path), bit for bit, on this machine, before any decode is timed")


@torch.inference_mode()
def verify_rows_match(runtime, prompt_ids: list[int], ks: list[int]) -> dict:
    """Prefill prompt[:-1], decode max(ks) + 1 tokens greedily by 1-token forwards; then, after the same
    prefill, run [pending, t1..tK] as one K+1-row forward for each K and compare it row by row.
    `exact` only if every row of every K is bit-identical."""
    ks = sorted({k for k in ks if k > 0})
    ids = torch.tensor(prompt_ids, dtype=torch.long, device=runtime.device)
    past = ids.numel() - 1
    runtime.reset(past + max(ks, default=0) + 1 + 64)
    if past:
        runtime.forward(ids[:past], 0, logits_to_keep=1)
    tokens, singles = [ids[-1]], []
    for i in range(max(ks, default=0) + 1):
        logits, _ = runtime.forward(tokens[-1].view(1), past + i)
        singles.append(logits[0])
        tokens.append(logits[0].argmax())
    checks = []
    for k in ks:
        runtime.crop(past)
        block, _ = runtime.forward(torch.stack(tokens[:k + 1]), past)
        want = torch.stack(singles[:k + 1])
        checks.append({"k": k, "rows": k + 1, "bitwise_identical": bool(torch.equal(block, want)),
                       "argmax_identical": bool(torch.equal(block.argmax(-1), want.argmax(-1))),
                       "max_abs_logit_diff": (block.float() - want.float()).abs().max().item()})
    return {"exact": all(c["bitwise_identical"] for c in checks), "runtime": runtime.name, "prompt": 0,
            "checks": checks, "method": METHOD}
