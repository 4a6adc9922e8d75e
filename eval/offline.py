"""Offline metrics on the eval prompts: the first draft's fkl, tvd, predicted α and top-1, teacher-forced over
the target's own continuations, and the draft vocabulary's coverage of the target's greedy tokens."""
from __future__ import annotations

import torch

from specdistill import kinds, metrics
from specdistill.objective.offline_metrics import FirstDraftSums


def reduced_draft_ids(draft, vocab_size: int) -> torch.Tensor | None:
    """The target ids of a draft's (kinds.LoadedDraft, or a bare module) reduced draft vocabulary (EAGLE-3: draft
    id i -> target id i + d2t[i]); None for drafts over the whole vocabulary."""
    draft = kinds.loaded(draft)
    ids = draft.kind.draft_vocabulary(draft.module)
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


@torch.inference_mode()
def offline_on_prompts(target, draft, prompt_ids: list[list[int]], continuations: list[list[int]],
                       temperature: float = 1.0, continuations_label: str | None = None) -> dict:
    """fkl, tvd, predicted_alpha, top1 at `temperature` over the continuation positions, teacher-forced:
    first-draft quantities (what alpha_at[0] measures), not pooled over depths.

    The continuation is the target's own output: greedy for the T=0 comparison (top-1), sampled at T for
    the T>0 one (predicted alpha). EAGLE heads read the target's real features (position t: token t+1 and
    f[t]), one step ahead, exactly as in training.
    """
    draft = kinds.loaded(draft)
    draft_kind = draft.kind
    reduced = reduced_draft_ids(draft, target.config.vocab_size)
    sums = FirstDraftSums(("fkl", "tvd", "top1") + (("vocab_coverage",) if reduced is not None else ()))
    for prompt, cont in zip(prompt_ids, continuations):
        if not cont or len(prompt) < 2:
            continue
        seq = torch.tensor([prompt + cont], device=target.device)
        p_logits, q_logits = draft_kind.prompt_logits(draft.module, target, seq)  # row j predicts token j+1
        rows = slice(len(prompt) - 1, seq.shape[1] - 1)  # predictions of the continuation tokens
        log_p = torch.log_softmax(p_logits[rows].float() / temperature, -1)
        log_q = torch.log_softmax(q_logits[rows].float() / temperature, -1)
        per = metrics.divergences(log_p, log_q, ("fkl", "tvd"))
        extra = {}
        if reduced is not None:  # the target's probability mass inside the draft vocabulary (held-out's definition)
            extra["vocab_coverage"] = log_p.exp()[:, reduced.to(log_p.device)].sum(-1)
        sums.add(log_p.shape[0], fkl=per["fkl"], tvd=per["tvd"], top1=metrics.top1_match(log_p, log_q), **extra)
    if sums.positions == 0:
        return {"positions": 0}
    out = sums.means()
    out["distribution"] = "full vocabulary"
    if draft_kind.PROMPTS_FKL_NOTE:  # q is zero outside a reduced draft vocabulary: KL(p||q) is infinite there
        out["fkl"] = None
        out["note"] = draft_kind.PROMPTS_FKL_NOTE
        out["distribution"] = f"full vocabulary (q zero outside the {draft_kind.LABEL} draft vocabulary)"
    return {**out, "positions": sums.positions, "temperature": temperature,
            "continuations": continuations_label or "the target's own greedy outputs (baseline, T=0)"}
