"""Warm start from released heads (draft.init_from): our own exports in every format come back exactly."""
from __future__ import annotations

import pytest
import torch

from specdistill.errors import SpecdistillError
from specdistill.recipe import load_recipe
from specdistill.target import load_target
from specdistill import kinds
from specdistill.target import parts_of
from specdistill.train import export
from tests.test_export import V, finish_checkpoint, make_eagle_checkpoint


def recipe_for(tmp_path, target_dir, kind: str, extra: str = ""):
    p = tmp_path / f"{kind}.yaml"
    p.write_text(f"run_name: {kind}\noutput_dir: {tmp_path / 'runs'}\ntarget: {{path: {target_dir}}}\n"
                 f"corpus: {{path: x.jsonl}}\ndraft: {{kind: {kind}}}\ntrain: {{max_steps: 1, save_every: 1}}\n{extra}")
    return load_recipe(p)


def build(recipe, target):
    return kinds.kind(recipe.draft.kind).build(recipe, parts_of(target, str(recipe.target.path)))


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_eagle_head_round_trips_through_export(tmp_path, smollm_tokenizer, model_type):
    from tests.conftest import tiny_model

    tiny_model(model_type, vocab_size=V).save_pretrained(tmp_path / "t")
    recipe = recipe_for(tmp_path, tmp_path / "t", "eagle")
    target = load_target(recipe.target)
    step_dir = make_eagle_checkpoint(recipe, target.config, seed=5)
    out = export.export_checkpoint(recipe, step_dir, "vllm-eagle")
    original = kinds.load_draft(step_dir, target).module
    recipe.draft.init_from = str(out)
    warm = build(recipe, target)
    ids = torch.randint(3, V, (1, 9))
    with torch.no_grad():
        feats = target(ids, output_hidden_states=True).hidden_states[-1]
        a = original.logits(original(ids[:, 1:], feats[:, :-1]))
        b = warm.logits(warm(ids[:, 1:], feats[:, :-1]))
    assert torch.allclose(a, b, atol=1e-5)


def make_eagle3_head(target, aux, vd=128, seed=0):
    from specdistill.kinds.eagle3.model import Eagle3Head, draft_vocab_from_counts

    torch.manual_seed(seed)
    head = Eagle3Head(target.config, vd, aux)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    head.set_draft_vocab(draft_vocab_from_counts(torch.randint(0, 1000, (V,)), vd))
    head.set_aux_scale(torch.rand(len(aux) * target.config.hidden_size) * 3 + 0.1)
    return head.bind_target(target.get_input_embeddings()).eval()


# [2, 1, 1, 0]: the export lists the ids as vLLM collects them ([0, 1, 2], the repeated block folded in);
# the warm start puts fc back in the cache's order, so the head computes what it did
@pytest.mark.parametrize("fmt,aux", [("vllm-eagle3", [0, 1, 2]), ("speculators", [0, 1, 2]),
                                     ("vllm-eagle3", [2, 1, 1, 0])])
def test_eagle3_head_round_trips_through_export(tmp_path, tiny_target_dir, fmt, aux):
    import json

    recipe = recipe_for(tmp_path, tiny_target_dir, "eagle3", f"cache: {{aux_layers: {aux}}}\n")
    target = load_target(recipe.target)
    head = make_eagle3_head(target, aux)
    step_dir = finish_checkpoint(recipe, 1, "eagle3", json.loads(head.config.to_json_string()), head.own_state_dict())
    out = export.export_checkpoint(recipe, step_dir, fmt)
    recipe.draft.init_from = str(out)
    warm = build(recipe, target).eval()
    assert warm.lm_head.weight.shape[0] == 128 and torch.equal(warm.d2t, head.d2t) and torch.equal(warm.t2d, head.t2d)
    warm.set_aux_scale(torch.rand(len(aux) * 64) + 0.5)  # what the training loop does: fc keeps its function
    ids = torch.randint(3, V, (1, 9))
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
        aux = head.target_features(hs, aux)
        pos = torch.arange(9)[None]
        a = head.logits(head(ids, head.project(aux), pos))
        b = warm.logits(warm(ids, warm.project(aux), pos))
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
    recipe.cache.aux_layers = [0, 1, 1]
    with pytest.raises(SpecdistillError, match=r"reads target layers \[0, 1, 2\].*cache.aux_layers"):
        build(recipe, target)


def test_foreign_or_misshapen_heads_stop(tmp_path, tiny_target_dir):
    recipe = recipe_for(tmp_path, tiny_target_dir, "eagle")
    target = load_target(recipe.target)
    recipe.draft.init_from = str(tmp_path)
    with pytest.raises(SpecdistillError, match="expected a directory with config.json"):
        build(recipe, target)
    out = export.export_checkpoint(recipe, make_eagle_checkpoint(recipe, target.config), "vllm-eagle")
    from safetensors.torch import load_file, save_file

    state = load_file(out / "model.safetensors")
    state["fc.bias"] = torch.zeros(64)
    save_file(state, out / "model.safetensors")
    (out / "SHA256SUMS").unlink()  # a foreign head: no checksums of ours (with them, the edit is refused as corrupt)
    recipe.draft.init_from = str(out)
    with pytest.raises(SpecdistillError, match="fc.bias"):
        build(recipe, target)
