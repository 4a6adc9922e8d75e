import json

import pytest
import torch
from transformers import DynamicCache

from specdistill.kinds.eagle3.model import Eagle3Head, draft_vocab_from_counts, vocab_maps
from specdistill.kinds.eagle3.objective import ttt_forward
from specdistill.target import default_aux_layers
from tests.conftest import tiny_model


def make_head(vocab=300, draft_vocab=64, seed=0):
    target = tiny_model("llama", vocab_size=vocab, layers=4, seed=seed)
    torch.manual_seed(seed + 1)
    head = Eagle3Head(target.config, draft_vocab, default_aux_layers(4)).bind_target(target.get_input_embeddings())
    counts = torch.randint(0, 1000, (vocab,))
    head.set_draft_vocab(draft_vocab_from_counts(counts, draft_vocab))
    return target, head.eval()


def test_vocab_maps_follow_the_d2t_t2d_conventions():
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 3])
    ids = draft_vocab_from_counts(counts, 4)
    assert ids.tolist() == [0, 2, 3, 5]  # the four most frequent, ascending
    d2t, t2d = vocab_maps(ids, 8)
    assert (torch.arange(4) + d2t).tolist() == ids.tolist()
    assert t2d.nonzero().flatten().tolist() == ids.tolist()


def test_weight_names_are_vllms():
    _, head = make_head()
    names = set(head.own_state_dict())
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "layers.0.hidden_norm.weight",
            "layers.0.input_layernorm.weight", "layers.0.self_attn.q_proj.weight"} <= names
    assert not any("embed" in n or "rotary" in n for n in names)
    sd = head.own_state_dict()
    assert sd["fc.weight"].shape == (64, 3 * 64) and sd["layers.0.self_attn.q_proj.weight"].shape[1] == 128
    assert sd["lm_head.weight"].shape == (64, 64)


@torch.no_grad()
def test_training_time_test_matches_drafting_with_a_cache():
    """Step s of the unrolled training forward equals what the head computes when it drafts s tokens
    ahead from position t with its KV cache, as the engine runs it (real prefix, then its own states)."""
    target, head = make_head()
    T, steps = 12, 3
    ids = torch.randint(0, 300, (1, T))
    hs = target(ids, output_hidden_states=True).hidden_states
    aux = Eagle3Head.target_features(hs, head.aux_layers)
    unrolled = ttt_forward(head, ids, aux, torch.ones(1, T, dtype=torch.long), steps)
    for t in [0, 4, 7]:
        cache = DynamicCache(config=head.config)
        pos = torch.arange(t + 1)[None]
        state = head(ids[:, 1:t + 2], head.project(aux[:, :t + 1]), pos, past_key_values=cache)[:, -1:]
        torch.testing.assert_close(head.logits(state)[0, 0], unrolled[0][0, t], atol=1e-4, rtol=1e-4)
        for s in range(1, steps):
            state = head(ids[:, t + 1 + s:t + 2 + s], state, torch.tensor([[t + s]]), past_key_values=cache)
            torch.testing.assert_close(head.logits(state)[0, 0], unrolled[s][0, t], atol=1e-4, rtol=1e-4)


def test_padding_does_not_change_real_positions():
    target, head = make_head()
    ids = torch.randint(0, 300, (1, 10))
    padded = torch.cat([ids, torch.zeros(1, 4, dtype=torch.long)], 1)
    mask = torch.cat([torch.ones(1, 10), torch.zeros(1, 4)], 1).long()
    with torch.no_grad():
        aux = Eagle3Head.target_features(target(padded, output_hidden_states=True).hidden_states, head.aux_layers)
        a = ttt_forward(head, ids, aux[:, :10], torch.ones(1, 10, dtype=torch.long), 2)
        b = ttt_forward(head, padded, aux, mask, 2)
    for s in range(2):
        torch.testing.assert_close(a[s][0, :8 - s], b[s][0, :8 - s], atol=1e-4, rtol=1e-4)


def add_aux_states(run_dir, target_dir, aux_layers):
    """Extend a test cache (tests/test_train.write_cache) with hidden_aux, as the cache stage stores it."""
    from transformers import AutoModelForCausalLM

    from specdistill import layout
    from specdistill.formats import read_manifest, read_shard, write_manifest, write_shard

    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    cache = layout.cache_dir(run_dir)
    manifest = read_manifest(cache)
    for shard in sorted(cache.glob("*/shard-*.safetensors")):
        tensors = read_shard(shard)
        aux = []
        for ids in tensors["input_ids"].long().split(tensors["seq_lens"].tolist()):
            with torch.no_grad():
                hs = model(ids[None], output_hidden_states=True).hidden_states
            aux.append(torch.stack([hs[i][0] for i in aux_layers], dim=1))
        tensors["hidden_aux"] = torch.cat(aux).contiguous()
        entry = write_shard(shard, tensors)
        shards = manifest["splits"][shard.parent.name]["shards"]
        shards[[s["file"] for s in shards].index(shard.name)] = entry  # its new size and checksums
    write_manifest(cache, {**manifest, "store": manifest["store"] + ["hidden_aux"], "aux_layers": list(aux_layers)})


def test_eagle3_trains_checkpoints_reloads_and_measures(tmp_path, tiny_target_dir, monkeypatch):
    from tests.test_train import make_recipe, write_cache

    import specdistill.recipe as recipe_mod
    from specdistill import layout
    from specdistill.target import load_target
    from specdistill.kinds import load_draft
    from specdistill.train.loop import train

    monkeypatch.setattr(recipe_mod, "CHECKPOINTS", tmp_path / "checkpoints")
    recipe = make_recipe(tmp_path, tiny_target_dir, "e3", kind="eagle3", max_steps=6, save_every=3)
    recipe.draft.draft_vocab_size = 128
    recipe.draft.ttt_steps = 3
    recipe.cache.aux_layers = [0, 1, 2]
    write_cache(recipe.run_dir, tiny_target_dir, n_train=8)
    add_aux_states(recipe.run_dir, tiny_target_dir, [0, 1, 2])
    history = train(recipe)
    assert history[-1]["loss"] < history[0]["loss"]
    assert {"step0", "step1", "step2"} <= set(history[0])
    steps = layout.checkpoints(recipe.run_dir)
    assert [p.name for p in steps] == ["step-0000003", "step-0000006"]
    metrics = json.loads((steps[-1] / "metrics.json").read_text())["heldout"]
    assert 0 < metrics["vocab_coverage"] <= 1 and 0 <= metrics["predicted_alpha"] <= 1
    assert len(metrics["top1_at"]) == 3
    tokens = [r["tokens"] for r in history]
    assert json.loads((steps[0] / "metrics.json").read_text())["tokens_seen"] == sum(tokens[:3])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(layout.tb_dir(recipe.run_dir)))
    tb.Reload()
    sim = tb.Scalars("heldout/simulated_tau/T0")
    assert [e.step for e in sim] == [3, 6] and sim[-1].value == pytest.approx(metrics["simulated_tau"]["0"])
    chain = tb.Scalars("heldout/chain_tau/T0")  # the chain replayed as decoding drafts it (eval/chain_tau.py)
    assert [e.step for e in chain] == [3, 6] and chain[-1].value == pytest.approx(metrics["chain_tau"]["0"])
    assert metrics["chain_k"] == recipe.eval.k and metrics["chain_positions"] > 0
    assert 1.0 <= metrics["chain_tau"]["0"] <= 1 + recipe.eval.k
    target = load_target(recipe.target)
    head = load_draft(steps[-1], target).module
    assert isinstance(head, Eagle3Head) and head.t2d.dtype == torch.bool and int(head.t2d.sum()) == 128
    from specdistill.data.cache_reader import CacheDataset
    from specdistill.kinds.eagle3.model import aux_feature_std

    std = aux_feature_std(CacheDataset(layout.cache_dir(recipe.run_dir), "train"))
    assert torch.allclose(head.aux_scale, 1 / std) and not torch.allclose(std, torch.ones_like(std))
    ids = head.draft_ids
    assert bool((ids[1:] > ids[:-1]).all()) and head.lm_head.weight.shape[0] == 128


LLAMA_HEAD_NAMES = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "aux_scale",
                    "layers.0.hidden_norm.weight", "layers.0.input_layernorm.weight",
                    "layers.0.post_attention_layernorm.weight", "layers.0.mlp.gate_proj.weight",
                    "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight"} | \
                   {f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"}


def test_llama_head_keeps_its_config_and_names():
    """A Llama target's head is built from the target's own config cut to one layer: checkpoints of runs made
    before any other target was supported load unchanged."""
    from specdistill.kinds.common.llama_layer import llama_layer_config, one_layer_config

    target = tiny_model("llama", vocab_size=300, layers=4)
    assert llama_layer_config(target.config).to_dict() == one_layer_config(target.config).to_dict()
    assert set(Eagle3Head(target.config, 64, [1, 2, 3]).own_state_dict()) == LLAMA_HEAD_NAMES


@torch.no_grad()
def test_other_targets_get_a_llama_layer_initialised_from_their_last_layer(tmp_path):
    from specdistill.kinds.common.llama_layer import init_layer_from_target
    from specdistill.kinds.eagle.model import EagleHead

    for model_type in ("qwen3", "gemma3_text"):
        target = tiny_model(model_type, vocab_size=300, layers=3)
        target.save_pretrained(tmp_path / model_type)
        head = Eagle3Head(target.config, 64, [1, 2, 3])
        assert head.config.model_type == "llama" and set(head.own_state_dict()) == LLAMA_HEAD_NAMES
        assert head.config.head_dim == target.config.head_dim and head.config.hidden_act == "silu"
        with torch.no_grad():  # move the target's norms off 1 / 0 so the copy is visible
            for p in target.parameters():
                p.add_(0.1 * torch.randn_like(p))
        target.save_pretrained(tmp_path / model_type)
        copied = init_layer_from_target(head.layers[0], tmp_path / model_type, target.config)
        last = target.model.layers[2]
        assert "self_attn.q_proj.weight" not in copied  # 2H wide in EAGLE-3: shapes do not allow
        assert torch.equal(head.layers[0].mlp.down_proj.weight, last.mlp.down_proj.weight)
        assert torch.equal(head.layers[0].self_attn.o_proj.weight, last.self_attn.o_proj.weight)
        if model_type == "gemma3_text":  # Gemma norms hold w - 1; the pre-MLP norm is pre_feedforward_layernorm
            assert torch.allclose(head.layers[0].post_attention_layernorm.weight,
                                  last.pre_feedforward_layernorm.weight + 1)
        else:
            assert torch.equal(head.layers[0].input_layernorm.weight, last.input_layernorm.weight)
        eagle = EagleHead(target.config)
        copied = init_layer_from_target(eagle.body.layers[0], tmp_path / model_type, target.config)
        assert "self_attn.q_proj.weight" in copied
        assert torch.equal(eagle.body.layers[0].self_attn.q_proj.weight, last.self_attn.q_proj.weight)
        # the head runs (Gemma's rotary embedding needs a layer_type; the Llama layer does not)
        head.bind_target(target.get_input_embeddings())
        state = torch.randn(1, 5, 64)
        assert head(torch.randint(0, 300, (1, 5)), state, torch.arange(5)[None]).shape == (1, 5, 64)


def test_frozen_readout_stays_the_targets_rows(tmp_path, tiny_target_dir, monkeypatch):
    """draft.freeze_lm_head: the readout keeps the target's LM-head rows of the draft vocabulary; the rest trains."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import specdistill.recipe as recipe_mod
    from specdistill import layout
    from specdistill.train.loop import train
    from tests.test_train import make_recipe, write_cache

    monkeypatch.setattr(recipe_mod, "CHECKPOINTS", tmp_path / "checkpoints")
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    moved = {}
    for frozen in (True, False):
        recipe = make_recipe(tmp_path, tiny_target_dir, f"e3-{frozen}", kind="eagle3", max_steps=2, save_every=2)
        recipe.draft.draft_vocab_size, recipe.draft.ttt_steps, recipe.draft.freeze_lm_head = 128, 2, frozen
        recipe.cache.aux_layers = [0, 1, 2]
        recipe.train.heldout_chain_positions = 0
        write_cache(recipe.run_dir, tiny_target_dir, n_train=4)
        add_aux_states(recipe.run_dir, tiny_target_dir, [0, 1, 2])
        train(recipe)
        w = load_file(str(layout.checkpoints(recipe.run_dir)[-1] / "draft.safetensors"))
        start = target.lm_head.weight[w["t2d"].bool()]  # the readout's start: the target's rows, in id order
        moved[frozen] = (w["lm_head.weight"] - start).abs().max().item()
    assert moved[True] == 0.0 and moved[False] > 0  # frozen: exactly the target's rows; else trained
