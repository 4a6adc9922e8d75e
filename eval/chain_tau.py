"""Simulated tau that matches decoding: the chain replayed along a fixed text as the engine runs it.

At a step that starts with n committed tokens, the drafter (the engine's own, specdistill/kinds/) reads the
target's features of the positions it has not seen, drafts K tokens from its own states and its own drafted
tokens, and depth i is accepted only where depths < i were: draft i must equal the target's greedy token
after the text's first n + i - 1 tokens. A draft outside a reduced draft vocabulary never equals it, so it
is a rejection. The text's target forward runs once, not once per step.

- Along the target's own greedy continuation of a prompt (`on_continuations`), the text IS what T=0
  decoding commits, so the replayed steps are decoding's own steps: the simulated tau equals the measured
  tau at T=0 (exactly where one forward over the text gives the step-by-step logits, e.g. fp32).
- Along held-out corpus text (`on_heldout`), a chain starts at every trained position; the target's
  greedy token there is conditioned on the corpus prefix, not on the drafts, which decoding would have
  committed instead: labelled "held-out corpus text".

Only T=0 (greedy acceptance). The old held-out figure (`simulated_tau`: a product of per-depth rates taken
unconditionally along teacher-forced corpus tokens) is kept under its name for comparison.
"""
from __future__ import annotations

import torch

from specdistill.eval.engine import SLACK
from specdistill.objective.base import counted
from specdistill.target import target_logits_from_hidden

HELDOUT_NOTE = ("T=0 chains of K drafts replayed by the engine's drafter at every trained position of held-out "
                "corpus text (own states, own drafted tokens, depth i counted only after depths < i were "
                "accepted, a draft outside the draft vocabulary rejected); the target's greedy token is "
                "conditioned on the corpus prefix, not on the drafts: held-out corpus text, not decoding")
CONTINUATIONS_NOTE = ("T=0 decoding replayed along the target's own greedy continuations of the eval prompts: the "
                      "steps decoding takes, drafts by the engine's drafter, one target forward per prompt; "
                      "equals the measured tau at T=0 up to the runtime's rounding")


def replay(drafter, ids: torch.Tensor, features: torch.Tensor | None, greedy: torch.Tensor, start: int, k: int,
           budget: int | None = None, every_position: bool = False) -> list[tuple[int, int, int]]:
    """Steps of a T=0 chain along `ids` [L]: (n, drafted, accepted) per step, the step starting with n committed.

    features [L, F]: what the drafter reads of each position (None: it reads none); greedy [L]: the target's
    choice after ids[:t+1]. The first step starts at `start` (>= 1). every_position: a step starts at every n
    (the held-out chains); else where decoding would (n + accepted + 1). budget: decoding's max_new_tokens
    (the last steps draft fewer, as the engine's `room`). A depth whose token lies past the text is not
    judged (decoding would have cut at the EOS there)."""
    L = ids.numel()
    seq = torch.zeros(L + k + 1, dtype=torch.long, device=ids.device)
    seq[:L] = ids
    drafter.reset(L + SLACK)
    steps, seen, n = [], 0, start
    while n < L:
        kk = k if budget is None else min(k, budget - (n - start) - 1)
        new = features[seen:n - 1] if features is not None else None
        seen = n - 1
        drafts, _ = drafter.propose(seq, n, new, max(kk, 0), 0.0, None)
        a = 0
        while a < drafts.numel() and n + a < L and int(drafts[a]) == int(greedy[n - 1 + a]):
            a += 1
        steps.append((n, drafts.numel(), a))
        n += 1 if every_position else a + 1
    return steps


@torch.inference_mode()
def on_continuations(decoder, prompts: list[list[int]], continuations: list[list[int]], k: int,
                     max_new_tokens: int) -> dict:
    """The simulated tau of `decoder` (an engine SpeculativeDecoder: its target runtime and drafter) at K,
    pooled over prompts as the measured tau is (committed tokens / steps)."""
    target, drafter = decoder.target, decoder.drafter
    tokens = steps = 0
    for prompt, cont in zip(prompts, continuations):
        if not cont:
            continue
        ids = torch.tensor(prompt + cont, device=target.device)
        target.reset(ids.numel() + SLACK)
        logits, features = target.forward(ids, 0)
        replayed = replay(drafter, ids, features, logits.argmax(-1), len(prompt), k, budget=max_new_tokens)
        tokens += len(cont)
        steps += len(replayed)
    return {"tau": tokens / steps if steps else 0.0, "k": k, "tokens": tokens, "steps": steps,
            "temperature": 0.0, "note": CONTINUATIONS_NOTE}


@torch.no_grad()
def on_heldout(drafter, sequences, k: int, max_positions: int) -> dict:
    """The chain's mean committed tokens per step (1 + accepted depths) over held-out corpus text, at every
    trained position whose K drafted tokens all lie in the text, up to `max_positions` (sequences in order).

    sequences: (ids [L], features [L, F] or None, greedy [L], trained [L] bool) per sequence."""
    accepted, positions = [0] * k, 0
    for ids, features, greedy, trained in sequences:
        if positions >= max_positions:
            break
        L = ids.numel()
        first = next((t for t in range(1, L) if trained[t]), None)
        if first is None:
            continue
        for n, drafted, a in replay(drafter, ids, features, greedy, first, k, every_position=True):
            if n + k > L or not trained[n] or positions >= max_positions:
                continue
            positions += 1
            for i in range(a):
                accepted[i] += 1
    if positions == 0:
        return {}
    return {"chain_tau": {"0": 1.0 + sum(accepted) / positions},
            "chain_accepted_at": [a / positions for a in accepted], "chain_k": k, "chain_positions": positions,
            "chain_tau_note": HELDOUT_NOTE}


def heldout_sequences(batches, reads: str | None, parts):
    """(ids, features, greedy, trained) per held-out sequence of cached `batches` (data/cache_reader.py):
    features = the cached `reads` (the kind's DRAFTER_READS: hidden_last, hidden_aux, or None), greedy =
    the target's argmax from its cached final state, else from its cached top-k (sorted, first = argmax)."""
    dtype = parts.lm_head.weight.dtype if parts.lm_head is not None else None
    for batch in batches:
        trained, real = counted(batch), batch["attention_mask"].bool()
        for b in range(batch["input_ids"].shape[0]):
            L = int(real[b].sum())
            if "hidden_last" in batch and parts.lm_head is not None:
                h = batch["hidden_last"][b, :L].to(dtype)
                greedy = target_logits_from_hidden(parts.config, parts.lm_head, h).argmax(-1)
            else:
                greedy = batch["topk_ids"][b, :L, 0]
            features = None
            if reads is not None:
                features = batch[reads][b, :L].flatten(1)
                features = features.to(dtype) if dtype is not None else features
            yield batch["input_ids"][b, :L], features, greedy, trained[b, :L]


def heldout_chain_tau(draft_kind, head, parts, batches, k: int, max_positions: int) -> dict:
    """`on_heldout` for a head in training (the train loop's checkpoint metrics): its kind's drafter over the
    cached held-out batches; the head's train mode and requires_grad flags are restored after."""
    flags = [(p, p.requires_grad) for p in head.parameters()]
    was_training = head.training
    try:
        drafter = draft_kind.drafter(head)
        return on_heldout(drafter, heldout_sequences(batches, draft_kind.DRAFTER_READS, parts), k, max_positions)
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
        head.train(was_training)
