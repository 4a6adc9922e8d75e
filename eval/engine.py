"""Speculative decoding in one file (gpt-fast style): a target, a draft, two KV caches, one loop.

Conventions (docs/DESIGN.md): `seq[0..n-1]` are the committed tokens, prompt included. The target's
KV cache always holds seq[0..n-2]; the last committed token is *pending*: it is the first input of
the next verification forward. Prefill therefore runs the prompt minus its last token, and every
generated token, the first one included, comes out of a verification step.

One step:
  1. the draft proposes K tokens d1..dK (a chain) from seq[:n];
  2. the target runs [pending, d1..dK] in ONE forward -> K+1 next-token distributions;
  3. accept left to right (greedy match at T=0, min(1, p/q) at T>0), then the target adds one
     token of its own (correction or bonus);
  4. both caches are cropped back to the committed prefix.

Plain autoregressive decoding is the same loop with `NoDraft` (K = 0), so the baseline shares every
line of cache and sampling code with speculative decoding.

Drafts implement `reset()` and `propose(seq, n, new_features, k, temperature, generator) ->
(tokens [k'], q [k', V] or None)` with k' <= k; `new_features` are what the draft's
`features(hidden_states)` picks from the target's forward (EAGLE: the last hidden state, post final
norm; EAGLE-3: the aux-layer states) for the positions the target cached since the previous call, or
None when the draft reads none (`needs_features = False`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specdistill.errors import SpecdistillError
from specdistill.eval.runtime import EagerRuntime, StaticEagle3Head, StaticRuntime, crop_cache, new_cache, runtime_name
from specdistill.eval.sampling import probs_from_logits, sample, verify_chain, verify_greedy


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
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0  # prefill + every step, overheads included
    stop: str = "length"  # "length" or "eos"

    @property
    def tau(self) -> float:
        return len(self.tokens) / self.steps if self.steps else 0.0


def merge_counts(results: list[DecodeResult]) -> dict:
    """Pool several decodes: tau, alpha, alpha_at and the time split, as defined in metrics.md."""
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

def eos_token_ids(model, tokenizer=None) -> set[int]:
    """Every id that ends a reply: the tokenizer's eos and the model's config/generation-config eos."""
    ids: set[int] = set()
    sources = [getattr(tokenizer, "eos_token_id", None), getattr(model.config, "eos_token_id", None)]
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        sources.append(gen.eos_token_id)
    for s in sources:
        if isinstance(s, int):
            ids.add(s)
        elif isinstance(s, (list, tuple)):
            ids.update(int(x) for x in s)
    return ids


def vocab_size_of(model) -> int:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        head = getattr(model, "lm_head", None)
    if head is not None and hasattr(head, "weight"):
        return int(head.weight.shape[0])
    return int(model.config.vocab_size)


def check_same_vocab(target, draft, target_tokenizer=None, draft_tokenizer=None, name: str = "draft") -> None:
    """Stop before decoding if the draft cannot speak the target's vocabulary."""
    tv, dv = vocab_size_of(target), vocab_size_of(draft)
    if tv != dv:
        raise SpecdistillError(f"{name}: vocabulary size {dv} differs from the target's {tv}; "
                               "a draft must use the target's tokenizer")
    if target_tokenizer is not None and draft_tokenizer is not None:
        from specdistill.target import fingerprint_tokenizer

        a, b = fingerprint_tokenizer(target_tokenizer), fingerprint_tokenizer(draft_tokenizer)
        if a != b:
            raise SpecdistillError(f"{name}: tokenizer fingerprint {b} differs from the target's {a}; "
                                   "a draft must use the target's tokenizer")


def _pick(logits: torch.Tensor, temperature: float, generator):
    """Greedy at T=0 (no probabilities needed), else a sample and its distribution q."""
    if temperature == 0:
        return logits.argmax(-1), None
    q = probs_from_logits(logits, temperature)
    return sample(q, generator), q


def cut_at_eos(new: list[int], eos_ids) -> tuple[list[int], bool]:
    """The tokens a step commits, up to and including the first EOS; and whether one was hit."""
    for i, tok in enumerate(new):
        if tok in eos_ids:
            return new[:i + 1], True
    return new, False


def _stack(tokens: list[torch.Tensor], qs: list[torch.Tensor | None]):
    ids = torch.stack(tokens) if tokens else torch.empty(0, dtype=torch.long)
    q = torch.stack(qs) if qs and qs[0] is not None else None
    return ids, q


# ----------------------------------------------------------------------------- target

def as_runtime(target):
    """A runtime (eval/runtime.py) as it is; a bare transformers model runs eagerly in its own dtype."""
    if hasattr(target, "forward") and hasattr(target, "keep_path"):
        return target
    return EagerRuntime(target, runtime_name("eager", str(target.dtype).removeprefix("torch.")))


class Target:
    """The target in its runtime. `feature_fn(hidden_states) -> [n, F]` picks what the draft reads from
    each forward (None: the draft reads nothing, hidden states are not kept)."""

    def __init__(self, runtime, feature_fn=None):
        self.runtime = as_runtime(runtime)
        self.model = self.runtime.model
        self.feature_fn = feature_fn

    def reset(self, capacity: int) -> None:
        self.runtime.reset(capacity)

    def forward(self, ids: torch.Tensor, past: int, logits_to_keep: int = 0, parents=None, depths=None):
        """Run ids [n] after `past` cached slots -> (logits [n, V], the draft's features [n, F] or None).

        logits_to_keep=1 skips the LM head on all but the last position (prefill needs none).
        """
        logits, hidden = self.runtime.forward(ids, past, hidden=self.feature_fn is not None,
                                              logits_to_keep=logits_to_keep, parents=parents, depths=depths)
        return logits, (self.feature_fn(hidden) if self.feature_fn is not None else None)

    def crop(self, n: int) -> None:
        self.runtime.crop(n)


# ----------------------------------------------------------------------------- drafts

class NoDraft:
    """K = 0: the engine then decodes plain autoregressively (the baseline)."""
    needs_features = False

    def reset(self, capacity: int = 0) -> None:
        pass

    def propose(self, seq, n, new_features, k, temperature, generator):
        return torch.empty(0, dtype=torch.long), None


class DraftLM:
    """A small causal LM with the target's vocabulary and its own KV cache."""
    needs_features = False

    def __init__(self, model):
        self.model = model.eval().requires_grad_(False)
        self.cache = None

    def reset(self, capacity: int = 0) -> None:
        self.cache = new_cache(self.model.config)

    def propose(self, seq, n, new_features, k, temperature, generator):
        crop_cache(self.cache, n - 1)  # drop rejected drafts; accepted ones are committed tokens now
        cached = self.cache.get_seq_length()
        feed = seq[cached:n]  # committed tokens it has not seen yet, the pending one last
        tokens, qs = [], []
        for i in range(k):
            logits = self.model(feed[None], past_key_values=self.cache, use_cache=True).logits[0, -1]
            tok, q = _pick(logits, temperature, generator)
            tokens.append(tok)
            qs.append(q)
            feed = tok.view(1)
        return _stack(tokens, qs)


class EagleDraft:
    """EAGLE-1 head: position t reads (token t+1, target feature f[t]) and predicts f[t+1].

    Its cache keeps only positions computed from the target's real features; after each verify the
    newly verified positions are run in one forward on their real features, then K tokens are drafted
    autoregressively on the head's own predicted features (EAGLE's scheme).
    """
    needs_features = True

    def __init__(self, head):
        self.head = head.eval().requires_grad_(False)
        self.cache = None

    def features(self, hidden_states):
        return hidden_states[-1]  # post final norm: the state the target's LM head reads

    def project(self, features):
        return features  # EAGLE-1 reads the feature itself

    def to_target(self, ids):
        return ids  # EAGLE-1 drafts over the target's own vocabulary

    def pick(self, h, temperature, generator):
        return _pick(self.head.logits(h), temperature, generator)

    def reset(self, capacity: int = 0) -> None:
        self.cache = new_cache(self.head.config)

    def run(self, ids: torch.Tensor, state: torch.Tensor, start: int) -> torch.Tensor:
        """The head over ids [M] and states [1, M, H] at positions start.. (its cache cut to `start` first)."""
        crop_cache(self.cache, start)
        return self.head(ids[None], state, torch.arange(start, start + ids.numel())[None], past_key_values=self.cache)

    def propose(self, seq, n, new_features, k, temperature, generator):
        m = 0 if new_features is None else new_features.shape[0]
        real = n - 1 - m  # positions [0, real) already hold real-feature entries
        if m == 0 or k == 0:
            return _stack([], [])
        h = self.run(seq[real + 1:n], self.project(new_features[None]), real)[:, -1:]
        tokens, qs = [], []
        for i in range(k):
            tok, q = self.pick(h[0, -1], temperature, generator)
            tokens.append(tok)
            qs.append(q)
            if i + 1 < k:
                h = self.run(tok.view(1), h, n - 1 + i)
        return _stack(tokens, qs)


class Eagle3Draft(EagleDraft):
    """EAGLE-3 head: reads the target's aux-layer states (fused by its fc), drafts over a reduced
    vocabulary mapped back to target ids; its own output state feeds the next drafted position.
    Same cache discipline as EagleDraft. At T>0, q is the draft-vocabulary distribution placed on
    the target ids (zero elsewhere), which keeps the accept/residual rule exact."""

    def __init__(self, head, static: bool = False):
        super().__init__(head)
        self.draft_ids = head.draft_ids
        self.vocab = head.config.vocab_size
        self.static = StaticEagle3Head(head) if static else None  # the static runtime's lean drafting forward

    def reset(self, capacity: int = 0) -> None:
        if self.static is None:
            return super().reset(capacity)
        self.static.reset(capacity)

    def run(self, ids, state, start):
        if self.static is None:
            return super().run(ids, state, start)
        return self.static.forward(ids, state, start)  # slots past `start` are masked: no crop needed

    def features(self, hidden_states):
        return self.head.target_features(hidden_states, self.head.aux_layers)

    def project(self, features):
        return self.head.project(features)

    def to_target(self, ids):
        return self.draft_ids[ids]

    def pick(self, h, temperature, generator):
        logits = self.head.logits(h)
        if temperature == 0:
            return self.to_target(logits.argmax(-1)), None
        qd = probs_from_logits(logits, temperature)
        q = torch.zeros(self.vocab, dtype=qd.dtype).index_copy_(0, self.draft_ids, qd)
        return self.to_target(sample(qd, generator)), q


def make_draft(draft, target=None, target_tokenizer=None, draft_tokenizer=None, static: bool = False):
    """Wrap a draft module (EagleHead or a causal LM) for the engine, checking its vocabulary first.
    static: the target runs in the static runtime, and an EAGLE-3 head drafts over a slot cache too."""
    if draft is None:
        return NoDraft()
    if hasattr(draft, "propose"):  # already an engine draft
        return draft
    kind = getattr(draft, "kind", None)
    if kind == "eagle3":
        if target is not None and draft.config.vocab_size != vocab_size_of(target):
            raise SpecdistillError(f"draft: EAGLE-3 head built for vocabulary size {draft.config.vocab_size}, "
                                   f"the target's is {vocab_size_of(target)}")
        return Eagle3Draft(draft, static)
    if target is not None:
        check_same_vocab(target, draft, target_tokenizer, draft_tokenizer)
    if kind == "eagle":
        return EagleDraft(draft)
    return DraftLM(draft)


# ----------------------------------------------------------------------------- the loop

# Cache slots a decode may need beyond prompt + new tokens: the widest verify (K + 1 or a tree) and the
# 1-token padding of reduced-precision runtimes. Independent of K, so that the baseline and every K
# attend over caches of one size (a static runtime's attention shape, hence its exactness, depends on it).
SLACK = 64


class SpeculativeDecoder:
    """target: a runtime (eval/runtime.py) or a transformers model (run eagerly in its own dtype).
    The draft runs in the target runtime's dtype."""

    def __init__(self, target, draft=None, k: int = 4, eos_ids=(), target_tokenizer=None):
        runtime = as_runtime(target)
        if draft is not None and not hasattr(draft, "propose"):
            draft.to(runtime.dtype)
        self.draft = make_draft(draft, runtime.model, target_tokenizer, static=isinstance(runtime, StaticRuntime))
        self.target = Target(runtime, self.draft.features if self.draft.needs_features else None)
        self.k = k if not isinstance(self.draft, NoDraft) else 0
        self.eos_ids = set(eos_ids)

    @torch.inference_mode()
    def decode(self, prompt_ids, max_new_tokens: int, temperature: float = 0.0,
               generator: torch.Generator | None = None, k: int | None = None) -> DecodeResult:
        k = self.k if k is None or isinstance(self.draft, NoDraft) else k
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()
        p_len = prompt.numel()
        if p_len == 0:
            raise SpecdistillError("decode: empty prompt")
        seq = torch.empty(p_len + max_new_tokens + k + 1, dtype=torch.long)  # preallocated once
        seq[:p_len] = prompt
        n = p_len
        res = DecodeResult(tokens=[], drafted=[0] * k, tested=[0] * k, accepted=[0] * k)
        draft, target = self.draft, self.target

        start = time.perf_counter()
        target.reset(p_len + max_new_tokens + SLACK)
        draft.reset(p_len + max_new_tokens + SLACK)
        new_features = None
        if p_len > 1:  # prefill everything but the pending last prompt token
            _, new_features = target.forward(seq[:p_len - 1], 0, logits_to_keep=1)
        res.prefill_s = time.perf_counter() - start

        while n - p_len < max_new_tokens:
            room = max_new_tokens - (n - p_len) - 1  # the target adds one token itself
            t0 = time.perf_counter()
            drafts, q = draft.propose(seq, n, new_features, min(k, room), temperature, generator)
            t1 = time.perf_counter()
            kk = drafts.numel()
            seq[n:n + kk] = drafts
            logits, features = target.forward(seq[n - 1:n + kk], n - 1)
            t2 = time.perf_counter()
            if temperature == 0:
                a, nxt = verify_greedy(logits, drafts)
            else:
                a, nxt = verify_chain(probs_from_logits(logits, temperature), q, drafts, generator)
            seq[n + a] = nxt

            new, hit_eos = cut_at_eos(seq[n:n + a + 1].tolist(), self.eos_ids)
            n += len(new)
            target.crop(n - 1)
            new_features = features[:a + 1] if features is not None else None

            res.steps += 1
            res.draft_forwards += kk
            res.draft_s += t1 - t0
            res.verify_s += t2 - t1
            for i in range(kk):
                res.drafted[i] += 1
            for i in range(min(a + 1, kk, len(new))):  # past an EOS nothing is committed, so nothing counts
                res.tested[i] += 1
            for i in range(min(a, len(new))):
                res.accepted[i] += 1
            if hit_eos:
                res.stop = "eos"
                break
        res.total_s = time.perf_counter() - start
        res.tokens = seq[p_len:n].tolist()
        return res


def decode_baseline(target_model, prompt_ids, max_new_tokens, temperature=0.0, generator=None, eos_ids=()):
    """Plain autoregressive decoding through the same engine (convenience for tests and comparators)."""
    return SpeculativeDecoder(target_model, None, 0, eos_ids).decode(prompt_ids, max_new_tokens, temperature, generator)
