"""Speculative decoding in one file (gpt-fast style): a target, a drafter, two KV caches, one loop.

Conventions (docs/DESIGN.md): `seq[0..n-1]` are the committed tokens, prompt included. The target's
KV cache always holds seq[0..n-2]; the last committed token is *pending*: it is the first input of
the next verification forward. Prefill therefore runs the prompt minus its last token, and every
generated token, the first one included, comes out of a verification step.

One step of `decode_loop`, whatever is drafted:
  1. the stepper drafts from seq[:n] (a chain of K tokens here, a tree in eval/tree.py);
  2. it has the target verify them in ONE forward and says what is accepted (greedy match at T=0,
     min(1, p/q) at T>0 for a chain), then the target adds one token of its own (correction or bonus);
  3. the loop cuts at an EOS, commits, keeps the accepted rows of the target's cache and drops the rest,
     and counts per draft depth.

Plain autoregressive decoding is the same loop with `NoDraft` (K = 0), so the baseline shares every
line of cache and sampling code with speculative decoding.

Drafters (made by each draft kind, specdistill/kinds/) are specdistill/contracts.py `Drafter`s: `reset()` and
`propose(seq, n, new_features, k, temperature, generator) -> (tokens [k'], q [k', V] or None)` with
k' <= k; `new_features` are what the drafter's `features(hidden_states)` picks from the target's forward
(EAGLE: the last hidden state, post final norm; EAGLE-3: the aux-layer states) for the positions the
target cached since the previous call, or None when it reads none (`needs_features = False`).
A draft (a torch module) is wrapped by its kind's `drafter`; anything else handed over as a draft is a drafter.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdistill import device as devices
from specdistill import kinds
from specdistill.contracts import Drafter
from specdistill.errors import SpecdistillError
from specdistill.target import cut_at_eos, eos_token_ids  # noqa: F401  (eos_token_ids: re-exported for callers)
from specdistill.eval.runtime import EagerRuntime, StaticRuntime, runtime_name
from specdistill.decoding.sampling import probs_from_logits, stack_draws, verify_chain, verify_greedy


# ----------------------------------------------------------------------------- results

@dataclass
class DecodeResult:
    """One prompt decoded. Counts are per draft depth (index 0 = the first drafted token)."""
    tokens: list[int]
    steps: int = 0  # target verification forwards (prefill excluded)
    drafted: list[int] = field(default_factory=list)
    tested: list[int] = field(default_factory=list)  # drafted tokens the target actually judged
    accepted: list[int] = field(default_factory=list)
    draft_forwards: int = 0
    prefill_s: float = 0.0
    nodes: int = 0  # drafted tokens the target verified (a chain's drafts, a tree's nodes)
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0  # prefill + every step, overheads included
    stop: str = "length"  # "length" or "eos"

    @property
    def tau(self) -> float:
        return len(self.tokens) / self.steps if self.steps else 0.0


def merge_counts(results: list[DecodeResult]) -> dict:
    """Pool several decodes: tau, alpha, alpha_at and the time split, as defined in docs/METRICS.md."""
    depth = max((len(r.drafted) for r in results), default=0)
    tested = [sum(r.tested[i] for r in results if i < len(r.tested)) for i in range(depth)]
    accepted = [sum(r.accepted[i] for r in results if i < len(r.accepted)) for i in range(depth)]
    tokens = sum(len(r.tokens) for r in results)
    steps = sum(r.steps for r in results)
    total_s = sum(r.total_s for r in results)
    draft_forwards = sum(r.draft_forwards for r in results)
    return {
        "tokens": tokens,
        "steps": steps,
        "tau": tokens / steps if steps else 0.0,
        "alpha": sum(accepted) / sum(tested) if sum(tested) else 0.0,
        "alpha_at": [a / t if t else 0.0 for a, t in zip(accepted, tested)],
        "tested_at": tested,
        "tokens_per_s": tokens / total_s if total_s else 0.0,
        "ms_per_token": 1000 * total_s / tokens if tokens else 0.0,
        # one draft step = one draft forward that yields one drafted token
        "ms_per_draft_step": 1000 * sum(r.draft_s for r in results) / draft_forwards if draft_forwards else 0.0,
        "ms_per_verify": 1000 * sum(r.verify_s for r in results) / steps if steps else 0.0,
        "total_s": total_s,
    }


# ----------------------------------------------------------------------------- helpers

# ----------------------------------------------------------------------------- target

def as_runtime(target):
    """A runtime (eval/runtime.py) as it is; a bare transformers model runs eagerly in its own dtype."""
    if isinstance(target, (EagerRuntime, StaticRuntime)):
        return target
    return EagerRuntime(target, runtime_name("eager", str(target.dtype).removeprefix("torch.")))


class Target:
    """The target in its runtime. `feature_fn(hidden_states) -> [n, F]` picks what the draft reads from
    each forward (None: the draft reads nothing, hidden states are not kept)."""

    def __init__(self, runtime, feature_fn=None):
        self.runtime = as_runtime(runtime)
        self.model = self.runtime.model
        self.feature_fn = feature_fn

    @property
    def device(self) -> torch.device:
        return self.runtime.device

    def reset(self, capacity: int) -> None:
        self.runtime.reset(capacity)

    def forward(self, ids: torch.Tensor, past: int, logits_to_keep: int = 0, parents=None, depths=None):
        """Run ids [n] after `past` cached slots -> (logits [n, V], the draft's features [n, F] or None).

        logits_to_keep=1 skips the LM head on all but the last position (prefill needs none).
        """
        logits, hidden = self.runtime.forward(ids, past, hidden=self.feature_fn is not None,
                                              logits_to_keep=logits_to_keep, parents=parents, depths=depths)
        return logits, (self.feature_fn(hidden) if self.feature_fn is not None else None)

    def keep(self, start: int, path: list[int]) -> None:
        """Keep the verified rows `path` of the block that started at slot `start` (row 0 = the pending
        token) as the committed slots start, start+1, ...; drop the rest."""
        if path == list(range(len(path))):  # a chain: the rows are where they belong, cut after them
            self.runtime.crop(start + len(path))
        else:
            self.runtime.keep_path(start, [start + i for i in path])


# ----------------------------------------------------------------------------- drafts

class NoDraft:
    """K = 0: the engine then decodes plain autoregressively (the baseline)."""
    needs_features = False

    def features(self, hidden_states):
        return None  # it reads nothing (the engine never asks: needs_features is False)

    def reset(self, capacity: int = 0) -> None:
        pass

    def propose(self, seq, n, new_features, k, temperature, generator):
        return stack_draws([], [], seq.device)


def make_drafter(draft, target=None, static: bool = False) -> Drafter:
    """What the decode loop calls to draft: a draft (kinds.LoadedDraft, or a bare module: EAGLE head, Medusa
    heads, causal LM) wrapped by its kind, checked against the target's vocabulary; None -> NoDraft; a drafter
    (any other object, a specdistill/contracts.py Drafter) as it is.
    static: the target runs in the static runtime (an EAGLE-3 head then drafts over a slot cache too)."""
    if draft is None:
        return NoDraft()
    if isinstance(draft, (kinds.LoadedDraft, torch.nn.Module)):
        draft = kinds.loaded(draft)
        return draft.kind.drafter(draft.module, target, static)
    return draft


# ----------------------------------------------------------------------------- the loop

# Cache slots a decode may need beyond prompt + new tokens: the widest verify (K + 1 or a tree) and the
# 1-token padding of reduced-precision runtimes. Independent of K, so that the baseline and every K
# attend over caches of one size (a static runtime's attention shape, hence its exactness, depends on it).
SLACK = 64


@dataclass
class Verified:
    """One step as verified by the target: what it commits and what it counts (per draft depth)."""
    new: list[int]  # accepted drafted tokens + the target's own one, before the EOS cut
    path: list[int]  # rows of the verified block to keep in the target's cache (0 = the pending token)
    features: torch.Tensor | None  # the draft's features of the verified block (all rows)
    drafted: int  # draft depths the step reached
    tested: int  # depths at which the target judged a drafted token
    accepted: int  # depths accepted
    draft_forwards: int
    nodes: int  # drafted tokens the target verified


class ChainStepper:
    """A chain of K drafted tokens; the target verifies [pending, d1..dK] in one forward and accepts a
    prefix (greedy match at T=0, the exact accept/residual rule at T>0)."""

    def __init__(self, drafter):
        self.drafter = drafter

    def reset(self, capacity: int) -> None:
        self.drafter.reset(capacity)

    def draft(self, seq, n, new_features, depth, temperature, generator):
        return self.drafter.propose(seq, n, new_features, depth, temperature, generator)

    def verify(self, target, seq, n, proposal, temperature, generator) -> Verified:
        drafts, q = proposal
        kk = drafts.numel()
        seq[n:n + kk] = drafts
        logits, features = target.forward(seq[n - 1:n + kk], n - 1)
        if temperature == 0:
            a, nxt = verify_greedy(logits, drafts)
        else:
            a, nxt = verify_chain(probs_from_logits(logits, temperature), q, drafts, generator)
        return Verified(drafts[:a].tolist() + [nxt], list(range(a + 1)), features, drafted=kk,
                        tested=min(a + 1, kk), accepted=a, draft_forwards=kk, nodes=kk)


def decode_loop(target: Target, stepper, prompt_ids, max_new_tokens: int, depth: int, eos_ids,
                temperature: float = 0.0, generator: torch.Generator | None = None,
                result: DecodeResult | None = None) -> DecodeResult:
    """Prefill, then steps of draft -> verify -> commit until the token budget or an EOS; the stepper
    drafts and verifies (a chain, a tree), this loop owns everything else: the budget, the EOS cut, the
    target's cache (cropped, or the accepted path kept), timing and the per-depth counters."""
    dev = target.device
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long, device=dev).flatten()
    p_len = prompt.numel()
    if p_len == 0:
        raise SpecdistillError("decode: empty prompt")
    seq = torch.empty(p_len + max_new_tokens + depth + 1, dtype=torch.long, device=dev)  # preallocated once
    seq[:p_len] = prompt
    n = p_len
    res = result if result is not None else DecodeResult(tokens=[])
    res.drafted, res.tested, res.accepted = [0] * depth, [0] * depth, [0] * depth

    now = devices.clock(dev)  # waits for the device before it reads the time
    start = now()
    target.reset(p_len + max_new_tokens + SLACK)
    stepper.reset(p_len + max_new_tokens + SLACK)
    new_features = None
    if p_len > 1:  # prefill everything but the pending last prompt token
        _, new_features = target.forward(seq[:p_len - 1], 0, logits_to_keep=1)
    res.prefill_s = now() - start

    while n - p_len < max_new_tokens:
        room = max_new_tokens - (n - p_len) - 1  # the target adds one token itself
        t0 = now()
        proposal = stepper.draft(seq, n, new_features, min(depth, room), temperature, generator)
        t1 = now()
        v = stepper.verify(target, seq, n, proposal, temperature, generator)
        t2 = now()

        new, hit_eos = cut_at_eos(v.new, eos_ids)
        seq[n:n + len(new)] = torch.tensor(new, device=dev)
        target.keep(n - 1, v.path[:len(new)])
        n += len(new)
        new_features = v.features[v.path] if v.features is not None else None

        res.steps += 1
        res.draft_forwards += v.draft_forwards
        res.nodes += v.nodes
        res.draft_s += t1 - t0
        res.verify_s += t2 - t1
        for i in range(v.drafted):
            res.drafted[i] += 1
        for i in range(min(v.tested, len(new))):  # past an EOS nothing is committed, so nothing counts
            res.tested[i] += 1
        for i in range(min(v.accepted, len(new))):
            res.accepted[i] += 1
        if hit_eos:
            res.stop = "eos"
            break
    res.total_s = now() - start
    res.tokens = seq[p_len:n].tolist()
    return res


class SpeculativeDecoder:
    """Chain speculative decoding. target: a runtime (eval/runtime.py) or a transformers model (run eagerly
    in its own dtype); draft: None (plain decoding), a draft (kinds.LoadedDraft or a bare module: its kind makes
    the drafter) or a drafter. The draft runs on the target runtime's device, in its dtype."""

    def __init__(self, target, draft=None, k: int = 4, eos_ids=()):
        runtime = as_runtime(target)
        if isinstance(draft, (kinds.LoadedDraft, torch.nn.Module)):  # a draft, not a drafter: runs where the target runs
            draft = kinds.loaded(draft)
            draft.module.to(device=runtime.device, dtype=runtime.dtype)
        self.drafter = make_drafter(draft, runtime.model, static=isinstance(runtime, StaticRuntime))
        self.target = Target(runtime, self.drafter.features if self.drafter.needs_features else None)
        self.k = k if not isinstance(self.drafter, NoDraft) else 0
        self.eos_ids = set(eos_ids)

    @torch.inference_mode()
    def decode(self, prompt_ids, max_new_tokens: int, temperature: float = 0.0,
               generator: torch.Generator | None = None, k: int | None = None) -> DecodeResult:
        k = self.k if k is None or isinstance(self.drafter, NoDraft) else k
        return decode_loop(self.target, ChainStepper(self.drafter), prompt_ids, max_new_tokens, k, self.eos_ids,
                           temperature, generator)
