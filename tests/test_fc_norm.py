"""draft.fc_norm (EAGLE 3.1, speculators --fc-norm): one RMSNorm per aux state before fc, as vLLM 0.32's
llama_eagle3.py computes it (`combine_hidden_states`: cat(fc_norm[i](chunk i)), then fc) and loads it (the
config's top-level key `fc_norm`; tensors `fc_norm.{i}.weight` -> `model.fc_norm.{i}.weight`)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from specdistill import kinds, vllm_env
from specdistill.errors import SpecdistillError
from specdistill.kinds.eagle3.model import Eagle3Head, draft_vocab_from_counts
from specdistill.target import load_target
from specdistill.train import export
from tests.test_export import EAGLE3_TENSORS, V, VLLM_EAGLE3_PARAMS, finish_checkpoint, vllm_eagle3_param_name
from tests.test_warm_start import build, recipe_for

H = 64  # the tiny target's hidden size


def rms_normed(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """vLLM's RMSNorm (layernorm.py forward_native), in float32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def vllm_combine(states: list[torch.Tensor], norm_weights: list[torch.Tensor], fc: torch.Tensor, eps: float):
    """vLLM's combine_hidden_states with fc_norm: each aux state through its own norm, side by side, then fc."""
    return torch.cat([rms_normed(s, w, eps) for s, w in zip(states, norm_weights)], dim=-1) @ fc.float().T


def random_head(target_config, aux: list[int], fc_norm: bool = True, vd: int = 128, seed: int = 0) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(target_config, vd, aux, fc_norm)
    with torch.no_grad():
        for name, p in head.named_parameters():  # the norms far from their ones, so a lost weight shows
            p.add_((0.5 if name.startswith("fc_norm.") else 0.05) * torch.randn_like(p))
    head.set_draft_vocab(draft_vocab_from_counts(torch.randint(0, 1000, (target_config.vocab_size,)), vd))
    head.set_aux_scale(torch.rand(len(aux) * target_config.hidden_size) + 0.5)  # what training does (no effect with fc_norm)
    return head


@torch.no_grad()
def test_project_is_vllms_formula_per_aux_state():
    from tests.conftest import tiny_config

    config = tiny_config(layers=4)
    head = random_head(config, [2, 2, 1])
    assert torch.equal(head.aux_scale, torch.ones(3 * H))  # a scale before the norms could not be exported
    # aux states of very different sizes (as a target's layers are), so that per chunk and over all differ
    states = [torch.randn(2, 5, H) * scale for scale in (1.0, 30.0, 1000.0)]
    weights = [norm.weight for norm in head.fc_norm]
    expected = vllm_combine(states, weights, head.fc.weight, config.rms_norm_eps)
    torch.testing.assert_close(head.project(torch.cat(states, dim=-1)), expected, rtol=1e-5, atol=1e-5)
    # the inputs tell the per-chunk norm from one over the whole concatenation (vLLM's norm_before_fc)
    whole = rms_normed(torch.cat(states, dim=-1), torch.cat(weights), config.rms_norm_eps) @ head.fc.weight.T
    assert not torch.allclose(whole, expected, rtol=1e-2, atol=1e-2)


def test_a_default_head_has_no_norms_and_exports_as_before(tmp_path, tiny_target_dir):
    recipe = recipe_for(tmp_path, tiny_target_dir, "eagle3")
    target = load_target(recipe.target)
    head = random_head(target.config, [0, 1, 2], fc_norm=False)
    assert head.fc_norm is None and not hasattr(head.config, "fc_norm")
    assert not any(n.startswith("fc_norm.") for n in head.own_state_dict())
    step_dir = finish_checkpoint(recipe, 1, "eagle3", json.loads(head.config.to_json_string()), head.own_state_dict())
    out = export.export_checkpoint(recipe, step_dir, "vllm-eagle3")
    assert "fc_norm" not in json.loads((out / "config.json").read_text())
    assert not any(n.startswith("fc_norm.") for n in load_file(out / "model.safetensors"))


# [2, 2, 1]: vLLM collects the states of layers 1 and 2 once each, so the export holds 2 norms (the repeated
# state's two norm weights folded into its two fc blocks); reloaded, the head computes what it did
@pytest.mark.parametrize("fmt,aux", [("vllm-eagle3", [0, 1, 2]), ("speculators", [0, 1, 2]),
                                     ("vllm-eagle3", [2, 2, 1]), ("speculators", [2, 2, 1])])
def test_fc_norm_export_is_what_vllm_loads_and_computes(tmp_path, tiny_target_dir, fmt, aux):
    recipe = recipe_for(tmp_path, tiny_target_dir, "eagle3", f"cache: {{aux_layers: {aux}}}\n")
    recipe.draft.fc_norm = True
    target = load_target(recipe.target)
    head = random_head(target.config, aux).bind_target(target.get_input_embeddings()).eval()
    step_dir = finish_checkpoint(recipe, 1, "eagle3", json.loads(head.config.to_json_string()), head.own_state_dict())
    out = export.export_checkpoint(recipe, step_dir, fmt)

    config = json.loads((out / "config.json").read_text())
    assert config["fc_norm"] is True  # top level in both formats (speculators: algos.update_eagle3 copies it)
    ids = sorted(set(aux))
    layer = config.get("transformer_layer_config", config)  # vLLM's count of aux states sizes its fc_norm list
    num_aux = layer.get("num_aux_hidden_states") or len((config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids") or [0] * 3)
    assert num_aux == len(ids) and config["eagle_aux_hidden_state_layer_ids"] == ids
    tensors = load_file(out / "model.safetensors")
    norm_names = [f"fc_norm.{i}.weight" for i in range(len(ids))]
    assert set(tensors) == set(EAGLE3_TENSORS) | {"d2t", "t2d"} | set(norm_names)
    assert all(tuple(tensors[n].shape) == (H,) for n in norm_names)
    vllm_norms = {f"model.fc_norm.{i}.weight" for i in range(len(ids))}  # LlamaModel.fc_norm, an nn.ModuleList
    loaded = {vllm_eagle3_param_name(n) for n in tensors} - {None}
    assert vllm_norms <= loaded <= VLLM_EAGLE3_PARAMS | vllm_norms

    ids_in = torch.randint(3, V, (1, 9))
    with torch.no_grad():
        hs = target(ids_in, output_hidden_states=True).hidden_states
        features = head.target_features(hs, aux)
        ours = head.project(features)
        theirs = vllm_combine([hs[i] for i in ids], [tensors[n] for n in norm_names], tensors["fc.weight"],
                              target.config.rms_norm_eps)
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)

        pos = torch.arange(9)[None]
        logits = head.logits(head(ids_in, ours, pos))
        reloaded = kinds.load_draft(step_dir, target).module  # our checkpoint reader
        assert torch.equal(reloaded.logits(reloaded(ids_in, reloaded.project(features), pos)), logits)
        recipe.draft.init_from = str(out)
        warm = build(recipe, target).eval()  # the export read back (draft.init_from)
        torch.testing.assert_close(warm.logits(warm(ids_in, warm.project(features), pos)), logits,
                                   rtol=1e-4, atol=1e-4)
    recipe.draft.fc_norm = False
    with pytest.raises(SpecdistillError, match="fc_norm: true; set draft.fc_norm: true"):
        build(recipe, target)


def test_a_fc_norm_head_trains_its_norms_and_checkpoints_them(tmp_path, tiny_target_dir, monkeypatch):
    from specdistill import layout
    from specdistill.train.loop import train
    from tests.test_eagle3 import add_aux_states
    from tests.test_train import make_recipe, write_cache

    monkeypatch.setattr("specdistill.recipe.CHECKPOINTS", tmp_path / "checkpoints")
    recipe = make_recipe(tmp_path, tiny_target_dir, "fcn", kind="eagle3", max_steps=2, save_every=2)
    recipe.draft.draft_vocab_size, recipe.draft.ttt_steps, recipe.draft.fc_norm = 128, 2, True
    recipe.cache.aux_layers = [0, 1, 2]
    write_cache(recipe.run_dir, tiny_target_dir, n_train=4)
    add_aux_states(recipe.run_dir, tiny_target_dir, [0, 1, 2])
    history = train(recipe)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in history)
    step_dir = layout.checkpoints(recipe.run_dir)[-1]
    head = kinds.load_draft(step_dir, load_target(recipe.target)).module
    assert head.config.fc_norm is True and len(head.fc_norm) == 3
    assert not all(torch.equal(n.weight, torch.ones(H)) for n in head.fc_norm)  # trained: off their init
    assert torch.equal(head.aux_scale, torch.ones(3 * H))  # the cache's std was not applied


def test_vllm_reads_the_key_and_names_pinned_here():
    """Where .venv-vllm is installed: its source still reads the config key and builds the modules these tests
    pin (read as text: vLLM is not importable in our environment)."""
    site = sorted(vllm_env.VLLM_VENV.glob("lib/python*/site-packages/vllm"))
    if not site:
        pytest.skip(f"no vLLM under {vllm_env.VLLM_VENV}")
    model = (site[0] / "model_executor" / "models" / "llama_eagle3.py").read_text()
    assert 'getattr(self.config, "fc_norm", False)' in model
    assert "self.fc_norm = nn.ModuleList(" in model and "RMSNorm(target_hidden_size, eps=self.config.rms_norm_eps)" in model
    assert 'name = "model." + name' in model  # load_weights: fc_norm.{i}.weight -> model.fc_norm.{i}.weight
    algos = (site[0] / "transformers_utils" / "configs" / "speculators" / "algos.py").read_text()
    assert 'pre_trained_config["fc_norm"] = config_dict.get("fc_norm", False)' in algos
