"""Exactness on the path the eval measures by default: the `static-bf16` runtime (and the static EAGLE-3
drafter it makes), every draft kind, T = 1 and T = 0.7.

The reference is the target as that runtime computes it: p(t1, t2, t3 | prompt) from one forward of the
runtime per context. The engine's first 3 sampled tokens at K = 2 (depth 2 and the bonus after it are
reached) must follow it (chi-square over the joint), and the same test must reject the engine when the
engine's own rule is made wrong (a monkeypatch of the function `verify_chain` calls, or of the engine's
temperature scaling): a wrong acceptance test, a wrong residual, a wrong temperature.

T = 0 is checked bit for bit at the real target's shape (SmolLM2-135M: 30 layers, 49k vocabulary, random
weights) with the thread count a fresh process (the eval) gets, in `static-bf16` and in `static-fp32`.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from specdistill import kinds
from specdistill.decoding import sampling
from specdistill.eval import engine
from specdistill.eval.engine import SpeculativeDecoder
from specdistill.eval.runtime import StaticRuntime, make_runtime
from specdistill.eval.tree import TreeDecoder
from tests.test_engine import JOINT_K, JOINT_TOKENS, JOINT_VOCAB, joint_case, sampled_joint_pvalue, wrong_verify_chain

RUNTIME = "static-bf16"  # what eval.runtime `auto` resolves to for the default target
RUNS = 1000  # a wrong temperature (the subtlest wrong rule here) gives p ~ 5e-4 already at 500
PROMPT = [1, 4, 2, 3]


@torch.inference_mode()
def runtime_joint(runtime, prompt, vocab: int, temperature: float, length: int) -> torch.Tensor:
    """p(t1..t_length | prompt) [V ** length] from the runtime's own forward, one per context."""
    joint = torch.ones(1, dtype=torch.float64)
    contexts = [list(prompt)]
    for _ in range(length):
        rows = []
        for c in contexts:
            runtime.reset(len(c) + 8)
            logits, _ = runtime.forward(torch.tensor(c), 0, logits_to_keep=1)
            rows.append(torch.softmax(logits[-1].double() / temperature, -1))
        joint = (joint[:, None] * torch.stack(rows)).flatten()
        contexts = [c + [t] for c in contexts for t in range(vocab)]
    return joint


def joint_test(kind: str, temperature: float, runs: int = RUNS, tree: bool = False) -> tuple[float, list[int]]:
    """Chi-square p-value of the engine's 3-token joint through the default runtime, and accepted per depth.
    tree: decode with the tree decoder (depth K) instead of the chain, as the eval does with eval.tree."""
    tgt, draft = joint_case(kind)
    runtime = make_runtime(tgt, RUNTIME)
    if tree:
        decoder = TreeDecoder(runtime, draft, {"kind": "static", "depth": JOINT_K, "top_k": 2})
    else:
        decoder = SpeculativeDecoder(runtime, draft, k=JOINT_K)
    assert isinstance(runtime, StaticRuntime) and runtime.dtype == torch.bfloat16
    joint = runtime_joint(runtime, PROMPT, JOINT_VOCAB, temperature, JOINT_TOKENS)
    return sampled_joint_pvalue(decoder, PROMPT, temperature, joint, runs)


KINDS = kinds.KIND_NAMES
TEMPERATURES = [1.0, 0.7]
DEFAULT = "eagle3"  # the default path (the module docstring): EAGLE-3, the one kind with a static drafting forward


def test_the_default_kind_drafts_with_its_static_forward_in_the_static_runtime():
    """The joint tests below run the default kind through the static drafting forward, as the eval does."""
    tgt, draft = joint_case(DEFAULT)
    assert SpeculativeDecoder(make_runtime(tgt, RUNTIME), draft, k=JOINT_K).drafter.static is not None
    assert SpeculativeDecoder(tgt, draft, k=JOINT_K).drafter.static is None  # eager: the head's own forward


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("kind", KINDS)
def test_joint_output_follows_the_target_on_the_default_runtime(kind, temperature):
    pvalue, accepted = joint_test(kind, temperature)
    assert 0 < accepted[0] < RUNS and 0 < accepted[1] < accepted[0], accepted  # depth 2 drafted, judged, mixed
    assert pvalue > 1e-3, (kind, temperature, pvalue)


# Deliberately wrong rules, injected where the engine's own verify_chain / decode loop looks them up.
def accept_by_p_only(p_of_draft, q_of_draft, uniforms):
    """Accept with probability p(d) instead of min(1, p(d)/q(d))."""
    return uniforms < p_of_draft


def residual_is_p(p, q):
    """Resample a rejected position from p instead of norm(max(p - q, 0))."""
    return p


def temperature_ignored(logits, temperature):
    """The target's probabilities at T = 1 whatever the temperature."""
    return torch.softmax(logits.float(), dim=-1)


WRONG = {"acceptance": (sampling, "accept_mask", accept_by_p_only),
         "residual": (sampling, "residual", residual_is_p),
         "temperature": (engine, "probs_from_logits", temperature_ignored),
         "bonus": (engine, "verify_chain", wrong_verify_chain)}
RULES = ["acceptance", "residual", "temperature"]
# The default path (EAGLE-3, static drafter) with every wrong rule at both temperatures (at T = 1 an ignored
# temperature is the right one); the other kinds with each wrong rule at T = 0.7; a bonus token drawn from the
# wrong position (it only shows after two acceptances: more runs) on the default path.
CASES = [(DEFAULT, t, wrong) for t in TEMPERATURES for wrong in RULES if not (wrong == "temperature" and t == 1.0)]
CASES += [(kind, 0.7, wrong) for kind in KINDS if kind != DEFAULT for wrong in RULES]
CASES += [(DEFAULT, 1.0, "bonus")]
RUNS_FOR = {"bonus": 2500}


@pytest.mark.parametrize("kind, temperature, wrong", CASES)
def test_the_same_test_rejects_a_wrong_rule(monkeypatch, kind, temperature, wrong):
    module, name, rule = WRONG[wrong]
    monkeypatch.setattr(module, name, rule)
    pvalue, _ = joint_test(kind, temperature, runs=RUNS_FOR.get(wrong, RUNS))
    assert pvalue < 1e-3, (kind, temperature, wrong, pvalue)


def test_tree_decoder_at_t07_follows_the_target():
    """The tree decoder at T = 0.7 (it samples through the exact chain) on the default runtime."""
    pvalue, accepted = joint_test(DEFAULT, 0.7, tree=True)
    assert accepted[1] > 0
    assert pvalue > 1e-3, pvalue


# ----------------------------------------------------------------------------- T = 0, the real target's shape

SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=2048, rms_norm_eps=1e-5,
                    rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)


def eval_threads() -> int:
    """The intra-op thread count a fresh process gets (the eval sets none); the test suite pins its own."""
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                         capture_output=True, text=True, check=True)
    return int(out.stdout)


@pytest.fixture(scope="module", params=[RUNTIME, "static-fp32"])  # fp32: what `auto` gives a CPU without bf16
def smollm2_shaped(request):
    """A randomly initialised Llama of SmolLM2-135M's config, in a static runtime, at the eval's threads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    before = torch.get_num_threads()
    torch.set_num_threads(eval_threads())
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M, initializer_range=0.05)).eval().requires_grad_(False)
    yield make_runtime(model, request.param)
    torch.set_num_threads(before)


def test_verify_rows_equal_one_token_forwards_at_the_real_shape(smollm2_shaped):
    """What T = 0 losslessness rests on: each row of a K+1-token verify equals that token's 1-token forward, bit
    for bit, for the K of the default recipe's sweep (the rows a verify holds: 2..6)."""
    from specdistill.eval.exactness import verify_rows_match

    torch.manual_seed(1)
    prompt = torch.randint(0, SMOLLM2_135M["vocab_size"], (16,)).tolist()
    check = verify_rows_match(smollm2_shaped, prompt, [1, 2, 3, 4, 5])
    assert [c["k"] for c in check["checks"]] == [1, 2, 3, 4, 5]
    assert check["exact"], check


def test_greedy_speculative_decode_identical_at_the_real_shape(smollm2_shaped):
    """Greedy decoding with drafts that are mostly accepted (the target drafting for itself through the
    draft-LM kind, eagerly) is token-identical to the same runtime's plain decoding."""
    torch.manual_seed(2)
    prompt = torch.randint(0, SMOLLM2_135M["vocab_size"], (16,)).tolist()
    with torch.inference_mode():
        want = SpeculativeDecoder(smollm2_shaped, None).decode(prompt, 12)
        got = SpeculativeDecoder(smollm2_shaped, smollm2_shaped.model, k=3).decode(prompt, 12)
    assert sum(got.accepted) >= 4, got.accepted  # multi-row verifies with accepted drafts were exercised
    assert got.tokens == want.tokens
