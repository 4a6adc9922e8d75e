"""Runtimes (eval/runtime.py): the static runtime computes what transformers computes, trees included; in
bf16, and in fp32 on the CPU, a position's logits do not depend on how many positions share its forward (batch
invariance), so speculative decoding stays token-identical to the same runtime's plain decoding."""
from __future__ import annotations

import pytest
import torch

from specdistill.errors import SpecdistillError
from specdistill.eval.engine import SpeculativeDecoder
from specdistill.decoding.kv import tree_mask
from specdistill.decoding.linear import plain
from specdistill.eval.runtime import make_runtime, parse_runtime
from tests.conftest import tiny_model
from tests.test_engine import eagle3_for

pytestmark = pytest.mark.usefixtures("one_thread")

V = 512
PREFIX = torch.tensor([5, 9, 100, 42, 7, 300])


def target(model_type="llama", seed=0, **sizes):
    torch.manual_seed(seed)
    if not sizes:
        return tiny_model(model_type, vocab_size=V, seed=seed, layers=4)
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, vocab_size=V, max_position_embeddings=2048, tie_word_embeddings=True,
                               bos_token_id=1, eos_token_id=2, pad_token_id=2, **sizes)
    return AutoModelForCausalLM.from_config(cfg).eval()


def full_logits(model, ids):
    with torch.no_grad():
        return model(ids[None]).logits[0]


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("name", ["eager-fp32", "static-fp32"])
def test_chain_forward_matches_a_full_forward(model_type, name):
    """Prefill, then 4 tokens after the cache: the same logits as one uncached forward (fp32)."""
    model = target(model_type)
    chain = torch.tensor([7, 300, 11, 12])
    want = full_logits(model, torch.cat([PREFIX, chain]))
    rt = make_runtime(model, name)
    rt.reset(64)
    with torch.no_grad():
        rt.forward(PREFIX, 0, logits_to_keep=1)
        got, hidden = rt.forward(chain, len(PREFIX), hidden=True)
    torch.testing.assert_close(got, want[len(PREFIX):], atol=1e-4, rtol=1e-4)
    assert len(hidden) == model.config.num_hidden_layers + 1


@pytest.mark.parametrize("name", ["eager-fp32", "static-fp32", "static-bf16"])
def test_tree_forward_matches_plain_forward(name):
    """Each node's logits equal a plain causal forward of prefix + its own root-to-node path."""
    model = target()
    tokens = [11, 12, 13, 14, 21, 22, 31]  # root 0; chain 0-1-2-3 and branches 0-4-5, 1-6
    parents = [-1, 0, 1, 2, 0, 4, 1]
    depths = [0, 1, 2, 3, 1, 2, 2]
    anc = tree_mask(parents, "cpu")
    rt = make_runtime(model, name)
    rt.reset(64)
    with torch.no_grad():
        rt.forward(PREFIX, 0, logits_to_keep=1)
        got, _ = rt.forward(torch.tensor(tokens), len(PREFIX), parents=parents, depths=depths)
        for i in range(len(tokens)):
            path = torch.tensor([tokens[j] for j in range(len(tokens)) if anc[i, j]])
            rt.reset(64)
            want, _ = rt.forward(torch.cat([PREFIX, path]), 0, logits_to_keep=1)
            tol = 1e-4 if name.endswith("fp32") else 2e-2
            torch.testing.assert_close(got[i].float(), want[0].float(), atol=tol, rtol=tol)


def test_keep_path_moves_the_accepted_entries():
    """After a tree verify, keeping nodes 0, 1, 2 leaves the cache as if that chain had been run."""
    model = target()
    rt = make_runtime(model, "static-fp32")
    rt.reset(64)
    with torch.no_grad():
        rt.forward(PREFIX, 0)
        rt.forward(torch.tensor([11, 21, 12, 13]), len(PREFIX), parents=[-1, 0, 0, 2], depths=[0, 1, 1, 2])
        rt.keep_path(len(PREFIX), [len(PREFIX) + i for i in (0, 2, 3)])  # root, 12, 13
        got, _ = rt.forward(torch.tensor([99]), len(PREFIX) + 3)
    want = full_logits(model, torch.cat([PREFIX, torch.tensor([11, 12, 13, 99])]))[-1]
    torch.testing.assert_close(got[0], want, atol=1e-4, rtol=1e-4)


# The target's own widths (SmolLM2-135M: hidden 576, MLP 1536, 9 heads over 3 KV heads), 2 layers: at these
# sizes oneDNN's 1-row bf16 kernel rounds differently from its multi-row one, which the runtime must hide.
WIDE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9,
            num_key_value_heads=3)


def rows_equal_single_token_forwards(rt):
    """Every row of M-token forwards (M = 2..9) equals the same token's 1-token forward, bit for bit."""
    torch.manual_seed(1)
    ids = torch.randint(0, V, (100 + 64,))
    with torch.no_grad():
        rt.reset(256)
        rt.forward(ids[:100], 0, logits_to_keep=1)
        singles = [rt.forward(ids[100 + i:101 + i], 100 + i)[0][0] for i in range(64)]
        for start, m in zip(range(0, 64, 8), (2, 3, 5, 8, 9, 4, 6, 7)):
            batch, _ = rt.forward(ids[100 + start:100 + start + m], 100 + start)
            for i in range(m):
                assert torch.equal(batch[i], singles[start + i]), f"row {i} of a {m}-token forward differs"


def test_static_bf16_is_batch_invariant():
    """Every row of a multi-token forward equals the same token's 1-token forward, bit for bit (64 tokens:
    the 1-row kernel's rounding differs on a few outputs in 10^4, so fewer rows could miss it)."""
    rows_equal_single_token_forwards(make_runtime(target(**WIDE, initializer_range=0.1), "static-bf16"))


def test_static_fp32_is_batch_invariant():
    """fp32 through packed weights (specdistill/decoding/linear.py): the same bit-for-bit rows as bf16's."""
    rt = make_runtime(target(**WIDE, initializer_range=0.1), "static-fp32")
    assert rt.linear is not plain  # packed on this CPU: the check below is the packed path's
    rows_equal_single_token_forwards(rt)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_fused_products_give_the_separate_products_bits(model_type):
    """q|k|v and gate|up packed as one weight each (decoding/linear.py): the same logits, bit for bit, as each product
    packed apart, biases (Qwen2's q, k, v) included."""
    chain = torch.tensor([7, 300, 11])
    logits = {}
    for fuse in (True, False):
        model = target(model_type)
        with torch.no_grad():  # transformers initialises biases to zero: make their order matter
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.copy_(torch.randn_like(p, generator=torch.Generator().manual_seed(len(name))))
        rt = make_runtime(model, "static-fp32", fuse=fuse)
        assert len(rt.linear.groups) == (2 * rt.model.config.num_hidden_layers if fuse else 0)
        rt.reset(64)
        with torch.no_grad():
            rt.forward(PREFIX, 0, logits_to_keep=1)
            logits[fuse] = rt.forward(chain, len(PREFIX))[0]
    assert torch.equal(logits[True], logits[False])


@pytest.mark.parametrize("name", ["static-fp32", "static-bf16"])
def test_static_speculative_decoding_is_lossless(name):
    """EAGLE-3 chain on the static runtime: token-identical to the same runtime's plain decoding."""
    model = target(**WIDE)
    head = eagle3_for(model, list(range(0, V, 4)))
    rt = make_runtime(model, name)
    for prompt in ([5, 9, 100, 42], [7]):
        want = SpeculativeDecoder(rt, None).decode(prompt, 24)
        for k in (1, 3, 5):
            got = SpeculativeDecoder(rt, head, k=k).decode(prompt, 24)
            assert got.tokens == want.tokens, (name, prompt, k)


@pytest.mark.slow  # torch.compile: about a CPU-minute even for this tiny target
def test_compiled_bf16_is_batch_invariant_and_lossless():
    """compiled-bf16 (the static forward under torch.compile, one graph for every M): its own rows agree
    bit for bit across M, so a chain and a tree are token-identical to its plain decoding, though inductor's
    kernels round otherwise than eager's."""
    from specdistill.eval.tree import TreeDecoder

    model = target(**WIDE, initializer_range=0.1)
    head = eagle3_for(model, list(range(0, V, 4)))
    rt = make_runtime(model, "compiled-bf16")
    rows_equal_single_token_forwards(rt)
    prompt = [5, 9, 100, 42]
    want = SpeculativeDecoder(rt, None).decode(prompt, 24).tokens
    assert SpeculativeDecoder(rt, head, k=3).decode(prompt, 24).tokens == want
    assert TreeDecoder(rt, head, {"kind": "static", "depth": 2, "top_k": 2}).decode(prompt, 24).tokens == want


def test_static_fp32_decodes_like_transformers():
    """Greedy plain decoding on the static runtime = transformers' eager forward, token for token."""
    a, b = target(), target()
    for prompt in ([5, 9, 100, 42], [7]):
        want = SpeculativeDecoder(make_runtime(a, "eager-fp32"), None).decode(prompt, 30).tokens
        got = SpeculativeDecoder(make_runtime(b, "static-fp32"), None).decode(prompt, 30).tokens
        assert got == want


def test_runtime_names_and_unsupported_targets():
    assert parse_runtime("static-bf16") == ("static", "bfloat16")
    with pytest.raises(SpecdistillError, match="eval.runtime 'compiled-int4'"):
        parse_runtime("compiled-int4")
    with pytest.raises(SpecdistillError, match="static runtime supports"):
        make_runtime(tiny_model("gemma2", vocab_size=V), "static-bf16")


def test_static_eagle3_head_computes_what_the_head_computes():
    """The static drafting forward = Eagle3Head.forward over a DynamicCache: real-feature positions, then
    drafted positions one at a time, each after a rollback of one drafted entry (fp32)."""
    from transformers import DynamicCache

    from specdistill.kinds.eagle3.drafter import StaticEagle3Head

    model = target()
    head = eagle3_for(model, list(range(0, V, 4)))
    static = StaticEagle3Head(head)
    static.reset(64)
    cache = DynamicCache(config=head.config)
    torch.manual_seed(3)
    ids, state = torch.randint(0, V, (6,)), torch.randn(1, 6, head.config.hidden_size)
    with torch.no_grad():
        want = head(ids[None], state, torch.arange(6)[None], past_key_values=cache)
        got = static.forward(ids, state, 0)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for start, tok in ((6, 17), (7, 33), (6, 99)):  # the last one rolls back over a drafted entry
            cache.crop(start)
            step = torch.tensor([tok])
            want = head(step[None], want[:, -1:], torch.tensor([[start]]), past_key_values=cache)
            got = static.forward(step, got[:, -1:], start)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_static_eagle3_drafter_projects_and_scores_as_the_head_through_packed_weights():
    """In fp32 on the CPU the static drafter multiplies through packed weights (fc and lm_head too): the same
    numbers as the head's own nn.Linear products, within fp32 rounding."""
    from specdistill.decoding.linear import PackedLinears
    from specdistill.kinds.eagle3.drafter import drafter

    model = target()
    head = eagle3_for(model, list(range(0, V, 4)))
    static = drafter(head, model, static=True)
    assert isinstance(static.linear, PackedLinears) and static.static.cache.linear is static.linear
    torch.manual_seed(5)
    features = torch.randn(1, 4, len(head.aux_layers) * model.config.hidden_size)
    with torch.no_grad():
        state = static.project(features)
        torch.testing.assert_close(state, head.project(features), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(static.head.logits(state, static.linear), head.logits(state), atol=1e-5, rtol=1e-5)
