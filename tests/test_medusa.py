"""Medusa heads (specdistill/kinds/medusa/): the training targets line up with the target's own distributions,
decoding is lossless at T=0 (chain and tree) and exact at T>0 (the chi-square joint test at depth 2), the
drafter reads the state it should, and the export is what vLLM's Medusa loader reads (names, shapes, config).

The vLLM tables are written from vLLM 0.32's `vllm/model_executor/models/medusa.py` (the last release with
Medusa; removed in 0.33): `Medusa.__init__` builds `blocks.{k}.layers.{l}` (nn.Linear(H, H), bias only with
`medusa_fc_bias`) and `lm_heads.{k}` (ParallelLMHead(truncated_vocab_size, H)); `load_weights` strips a
`medusa_heads.` prefix, keeps names found in its parameters and drops the rest silently; and from
`vllm/transformers_utils/configs/medusa.py`: `MedusaConfig.from_pretrained` renames any key holding "num" and
"heads" to num_heads, "num" and "layers" to num_hidden_layers; truncated_vocab_size defaults to vocab_size.
"""
from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from specdistill import kinds, layout
from specdistill.errors import SpecdistillError
from specdistill.eval.engine import SpeculativeDecoder
from specdistill.eval.tree import TreeDecoder
from specdistill.kinds.medusa.model import MedusaConfig, MedusaHeads, tiny_heads
from specdistill.kinds.medusa.objective import Objective
from specdistill.target import load_target, parts_of
from specdistill.train import export
from tests.helpers import decode_baseline, tiny_recipe
from tests.test_engine import joint_pvalue, llama, wrong_verify_chain
from tests.test_export import finish_checkpoint
from tests.test_tree import TREES

pytestmark = pytest.mark.usefixtures("one_thread")
medusa = kinds.kind("medusa")

V = 512
PROMPTS = [list(range(5, 25)), [7, 300, 11], [3]]


medusa_for = tiny_heads  # (target, heads, layers, std): heads with random blocks, not the identity init


def fit(head: MedusaHeads, target, steps: int = 60) -> MedusaHeads:
    """A few Adam steps on the target's own greedy text (head k at t learns token t+2+k): heads that draft well,
    so long accepted chains and tree paths are exercised."""
    head.train().requires_grad_(True)
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    texts = [torch.tensor(p + decode_baseline(target, p, 40).tokens) for p in PROMPTS[:2]]
    with torch.no_grad():
        feats = [target(t[None], output_hidden_states=True).hidden_states[-1][0] for t in texts]
    for _ in range(steps):
        loss = 0.0
        for ids, f in zip(texts, feats):
            for k in range(head.config.num_heads):
                loss = loss + torch.nn.functional.cross_entropy(head.head_logits(f[:len(ids) - 2 - k], k), ids[2 + k:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def target():
    return llama(V, seed=0)


@pytest.fixture(scope="module")
def heads(target):
    return {"random": medusa_for(target), "fit": fit(medusa_for(target, std=0.0), target)}


# ----------------------------------------------------------------------------- training targets

def test_objective_pairs_head_k_with_the_targets_distribution_k_positions_on(target):
    """Head k at position t: q = head k over f[t], p = the target's own logits at row t+1+k (its forward, not
    lm_head(f) recomputed), counted where token t+2+k is trained and real (padding and prompt excluded)."""
    head = medusa_for(target)
    ids = torch.randint(3, V, (2, 12), generator=torch.Generator().manual_seed(0))
    attention = torch.ones_like(ids)
    attention[1, 9:] = 0  # row 1 is 9 tokens long
    loss_mask = torch.ones_like(ids)
    loss_mask[:, :4] = 0  # a 4-token prompt
    with torch.no_grad():
        out = target(ids, attention_mask=attention, output_hidden_states=True)
    batch = {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask,
             "hidden_last": out.hidden_states[-1]}
    objective = Objective(head, parts_of(target), medusa.Loss())
    pred = objective(batch)
    for k, step in enumerate(pred["steps"]):
        rows = [(b, t) for b in range(2) for t in range(12)
                if t + 2 + k < (12 if b == 0 else 9) and t + 2 + k >= 4]
        assert step["q_logits"].shape[0] == len(rows) > 0, k
        want_p = torch.stack([out.logits[b, t + 1 + k] for b, t in rows])
        want_q = torch.stack([head.head_logits(out.hidden_states[-1][b, t], k) for b, t in rows])
        torch.testing.assert_close(step["p_logits"], want_p, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(step["q_logits"], want_q)
    loss, components = objective.loss(pred)  # head k weighted head_decay**k = 0.8**k, normalised
    assert set(components) == {"head0", "head1", "head2"}
    weights = [0.8 ** k for k in range(3)]
    want = sum(w * components[f"head{k}"] for k, w in enumerate(weights)) / sum(weights)
    torch.testing.assert_close(loss, want)


def test_offline_metrics_per_head(target, heads):
    """top1_at[k]: head k's argmax against the target's at t+1+k, over the counted positions; the fitted heads
    predict their own training text far better than random ones."""
    text = torch.tensor([PROMPTS[0] + decode_baseline(target, PROMPTS[0], 40).tokens])
    with torch.no_grad():
        out = target(text, output_hidden_states=True)
    batch = {"input_ids": text, "attention_mask": torch.ones_like(text), "loss_mask": torch.ones_like(text),
             "hidden_last": out.hidden_states[-1]}
    got = {name: Objective(h, parts_of(target), medusa.Loss()).offline_metrics([batch]) for name, h in heads.items()}
    T = text.shape[1]
    for name, h in heads.items():
        want = [float((h.head_logits(out.hidden_states[-1][0, :T - 2 - k], k).argmax(-1)
                       == out.logits[0, 1 + k:T - 1].argmax(-1)).float().mean()) for k in range(3)]
        assert got[name]["top1_at"] == pytest.approx(want), name
        assert got[name]["positions_at"] == [T - 2 - k for k in range(3)]
        assert got[name]["top1"] == pytest.approx(want[0])
    fit_, rand = got["fit"], got["random"]
    assert min(fit_["top1_at"]) > 0.5 > max(rand["top1_at"])  # ~0.7 (the prompt rows are not the target's text)
    assert fit_["simulated_tau"]["0"] > rand["simulated_tau"]["0"] + 1


# ----------------------------------------------------------------------------- decoding

def test_drafter_reads_the_last_committed_state(target, heads):
    """Every chain the engine drafts is, head by head, the argmax of head k over the target's final-norm state
    at position n-2 (the last position before the pending token), computed from scratch."""
    head = heads["fit"]
    decoder = SpeculativeDecoder(target, head, k=3)
    seen = []
    propose = decoder.drafter.propose

    def recording(seq, n, new_features, k, temperature, generator):
        tokens, q = propose(seq, n, new_features, k, temperature, generator)
        seen.append((seq[:n].tolist(), tokens.tolist()))
        return tokens, q

    decoder.drafter.propose = recording
    decoder.decode(PROMPTS[0], 24)
    assert len(seen) > 3
    for prefix, tokens in seen:
        with torch.no_grad():
            f = target(torch.tensor([prefix[:-1]]), output_hidden_states=True).hidden_states[-1][0, -1]
        assert tokens == [int(head.head_logits(f, k).argmax()) for k in range(len(tokens))]


@pytest.mark.parametrize("head_name", ["random", "fit"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_chain_identical_to_baseline(target, heads, head_name, k):
    accepted = 0
    for p in PROMPTS:
        got = SpeculativeDecoder(target, heads[head_name], k=k).decode(p, 30)
        assert got.tokens == decode_baseline(target, p, 30).tokens, (head_name, k, p)
        assert len(got.drafted) == k and got.drafted[min(k, 3):] == [0] * max(0, k - 3)  # one token per head
        accepted += sum(got.accepted)
    if head_name == "fit":
        assert accepted > 20  # long accepted chains were exercised


@pytest.mark.parametrize("head_name", ["random", "fit"])
@pytest.mark.parametrize("tree_name", list(TREES))
def test_greedy_tree_identical_to_baseline(target, heads, head_name, tree_name):
    accepted = 0
    for p in PROMPTS:
        got = TreeDecoder(target, heads[head_name], TREES[tree_name]).decode(p, 30)
        assert got.tokens == decode_baseline(target, p, 30).tokens, (head_name, tree_name, p)
        accepted += sum(got.accepted)
    if head_name == "fit":
        assert accepted > 20


def test_tree_nodes_are_each_heads_top_k(target, heads):
    """A node at depth d holds one of head d-1's best tokens whatever its parent: Medusa's tree."""
    head = heads["fit"]
    decoder = TreeDecoder(target, head, {"kind": "static", "depth": 3, "top_k": 2})
    with torch.no_grad():
        hs = target(torch.tensor([PROMPTS[0]]), output_hidden_states=True).hidden_states[-1][0]
    n = len(PROMPTS[0]) + 1
    tree = decoder.stepper.drafter.draft(torch.tensor(PROMPTS[0] + [0]), n, hs, decoder.shape, 3)
    top = [head.head_logits(hs[-1], d).topk(2).indices.tolist() for d in range(3)]
    assert len(tree.tokens) == 2 + 4 + 8
    for token, depth in zip(tree.tokens, tree.depths):
        assert token in top[depth - 1]
    assert [tree.tokens[i] for i in range(2)] == top[0]


# The chain engine with Medusa heads at T=1, K=2 follows the target's joint: tests/test_engine.py
# test_sampling_distribution_matches_target[medusa]; the same test fails with a rule wrong only at depth 2:
def test_sampling_distribution_test_catches_a_wrong_rule(monkeypatch):
    import specdistill.eval.engine as engine_mod

    monkeypatch.setattr(engine_mod, "verify_chain", wrong_verify_chain)
    pvalue, _ = joint_pvalue("medusa", runs=2500)
    assert pvalue < 1e-3, pvalue


# ----------------------------------------------------------------------------- checkpoint and export

H, K, L = 64, 3, 1  # tiny_config's hidden size; 3 heads of one block each; V = the SmolLM2 tokenizer's
VOCAB = 49152
VLLM_MEDUSA_TENSORS = {  # checkpoint name -> (shape, vLLM Medusa parameter it loads into)
    **{f"blocks.{k}.layers.0.weight": ((H, H), f"blocks.{k}.layers.0.weight") for k in range(K)},
    **{f"lm_heads.{k}.weight": ((VOCAB, H), f"lm_heads.{k}.weight") for k in range(K)},
}
VLLM_MEDUSA_CONFIG = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": H,
                      "vocab_size": VOCAB, "truncated_vocab_size": VOCAB, "medusa_fc_bias": False}


def vllm_medusa_config(config: dict) -> dict:
    """What vLLM's MedusaConfig.from_pretrained makes of a config.json (its key renaming and defaults)."""
    cfg = dict(config)
    for key in list(cfg):
        if "num" in key and "heads" in key:
            cfg["num_heads"] = cfg.pop(key)
        elif "num" in key and "layers" in key:
            cfg["num_hidden_layers"] = cfg.pop(key)
    cfg.setdefault("truncated_vocab_size", cfg["vocab_size"])
    return cfg


@pytest.fixture()
def medusa_checkpoint(tmp_path, tiny_target_dir, monkeypatch):
    monkeypatch.setattr("specdistill.recipe.CHECKPOINTS", tmp_path / "checkpoints")
    recipe = tiny_recipe(tmp_path, tiny_target_dir)  # eval.k = 3 = K: the serve command's num_speculative_tokens
    target = load_target(recipe.target)
    head = medusa_for(target, heads=K, layers=L)
    step_dir = finish_checkpoint(recipe, 1, "medusa", medusa.checkpoint_config(head), medusa.own_state_dict(head))
    return recipe, target, head, step_dir


def test_vllm_medusa_matches_vllm_loader_table(medusa_checkpoint, capsys):
    recipe, target, head, step_dir = medusa_checkpoint
    export.run(recipe, argparse.Namespace(checkpoint=None, format=None))  # the kind's default format
    out = layout.export_dir(recipe.run_dir, "vllm-medusa")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "SHA256SUMS", "config.json", "model.safetensors"]
    with safe_open(out / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert names == set(VLLM_MEDUSA_TENSORS), (names ^ set(VLLM_MEDUSA_TENSORS))
        for name, (shape, _) in VLLM_MEDUSA_TENSORS.items():
            assert tuple(f.get_tensor(name).shape) == shape, name
    loaded = {n.removeprefix("medusa_heads.") for n in names}  # vLLM's load_weights
    assert loaded == {p for _, p in VLLM_MEDUSA_TENSORS.values()}  # every parameter of vLLM's Medusa, nothing else
    config = vllm_medusa_config(json.loads((out / "config.json").read_text()))
    for key, value in {**VLLM_MEDUSA_CONFIG, "num_heads": K, "num_hidden_layers": L}.items():
        assert config[key] == value, key
    spec = {"method": "medusa", "model": str(out.resolve()), "num_speculative_tokens": K}
    assert f"--speculative-config '{json.dumps(spec)}'" in (out / "README.md").read_text()
    assert "--speculative-config" in capsys.readouterr().out

    # read back as vLLM would build it: the same heads, the same logits
    state = load_file(out / "model.safetensors")
    again = MedusaHeads(MedusaConfig(config["hidden_size"], config["vocab_size"], config["num_heads"],
                                     config["num_hidden_layers"]))
    again.load_own_state_dict(state)
    f = torch.randn(5, H)
    torch.testing.assert_close(again.logits(f), head.logits(f))


def test_export_refuses_a_speculative_k_other_than_the_number_of_heads(medusa_checkpoint):
    recipe, _, _, _ = medusa_checkpoint
    recipe.export.num_speculative_tokens = K - 1
    with pytest.raises(SpecdistillError, match=f"num_speculative_tokens: {K}"):
        export.run(recipe, argparse.Namespace(checkpoint=None, format=None))
    with pytest.raises(SpecdistillError, match="format vllm-eagle exports 'eagle'"):
        export.run(recipe, argparse.Namespace(checkpoint=None, format="vllm-eagle"))


def test_checkpoint_round_trip_and_wrong_tensors(medusa_checkpoint):
    recipe, target, head, step_dir = medusa_checkpoint
    draft = kinds.load_draft(step_dir, target)
    loaded = draft.module
    assert draft.kind is medusa and kinds.kind_of(loaded) is medusa
    f = torch.randn(2, H)
    torch.testing.assert_close(loaded.logits(f), head.logits(f))
    state = medusa.own_state_dict(head)
    state.pop("blocks.2.layers.0.weight")
    with pytest.raises(SpecdistillError, match="missing \\['blocks.2.layers.0.weight'\\]"):
        medusa.load(medusa.checkpoint_config(head), state, target)


@pytest.mark.parametrize("runtime_name", ["eager-fp32", "static-bf16"])
def test_decoding_is_device_clean(runtime_name):
    """Chain (T=0 and T=1) and tree drafting under device.strict_device(): every tensor the Medusa drafter makes
    names its device (as tests/test_strict_device_eval.py checks for the other kinds)."""
    from specdistill import device
    from specdistill.eval.runtime import make_runtime

    runtime = make_runtime(llama(V, seed=0), runtime_name)
    head = medusa_for(runtime.model)
    with device.strict_device():
        chain = SpeculativeDecoder(runtime, head, k=3)
        greedy = chain.decode(PROMPTS[0], 10)
        sampled = chain.decode(PROMPTS[0], 10, 1.0, device.generator(runtime.device, 0))
        tree = TreeDecoder(runtime, head, TREES["dynamic"]).decode(PROMPTS[0], 10)
        plain = SpeculativeDecoder(runtime, None).decode(PROMPTS[0], 10)
    assert greedy.tokens == tree.tokens == plain.tokens and len(sampled.tokens) == 10
