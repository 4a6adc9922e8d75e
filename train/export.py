"""The `export` stage: write a checkpoint in a format vLLM loads, with the exact `vllm serve` command.

Formats (see ../shared/docs/vllm-formats.md; names and shapes checked against vLLM 0.33.0's
`llama_eagle.py`, `configs/eagle.py` and `config/speculative.py`):

  vllm-eagle   EAGLE-1 head -> vLLM `EagleLlamaForCausalLM` (`"method": "eagle"`).
               config.json: the target's Llama config with num_hidden_layers 1 and
               architectures ["LlamaForCausalLM"] (vLLM's EAGLEConfig renames it to
               EagleLlamaForCausalLM for method eagle; the same file is what EAGLE's own released
               heads ship, it parses with plain transformers, and a serve command without "method"
               fails loudly as a draft_model with missing weights instead of running a wrong class).
               model.safetensors: exactly fc.weight [H,2H] and layers.0.* without input_layernorm;
               no fc.bias, norm, lm_head or embed_tokens (vLLM shares the target's).
  hf           a draft_lm checkpoint as an ordinary HF model dir + the target's tokenizer
               (`"method": "draft_model"`, same vocab size as the target).
  vllm-eagle3, speculators   EAGLE-3 heads: not yet (they arrive with issue 6).

The export directory name ("vllm-eagle") does not contain "eagle-", so vLLM cannot guess the method
from the path: the README's serve command always passes "method".
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specdistill import layout
from specdistill.errors import SpecdistillError

DEFAULT_FORMAT = {"eagle": "vllm-eagle", "eagle3": "vllm-eagle3", "draft_lm": "hf"}
FORMAT_KIND = {"vllm-eagle": "eagle", "vllm-eagle3": "eagle3", "speculators": "eagle3", "hf": "draft_lm"}
VLLM_METHOD = {"vllm-eagle": "eagle", "vllm-eagle3": "eagle3", "speculators": "eagle3", "hf": "draft_model"}
# Config keys of the target that make no sense in a one-layer head's config.json.
DROPPED_CONFIG_KEYS = ("_name_or_path", "_model_name_or_path", "transformers_version", "dtype",
                       "pretraining_tp", "quantization_config", "auto_map")


# ---------------------------------------------------------------------------------------------- run

def run(recipe, args) -> None:
    run_dir = recipe.run_dir
    step_dir = pick_checkpoint(run_dir, getattr(args, "checkpoint", None))
    kind = read_draft_config(step_dir)["kind"]
    formats = [args.format] if getattr(args, "format", None) else (recipe.export.formats or [DEFAULT_FORMAT[kind]])
    for fmt in formats:
        out = export_checkpoint(recipe, step_dir, fmt)
        print(f"exported {step_dir.name} ({kind}) as {fmt}: {out}")
        print("serve it with:", serve_command(recipe, fmt, out, speculative_tokens(recipe, step_dir)))


def pick_checkpoint(run_dir: Path, name: str | None) -> Path:
    """`step-N`, `N` or None (the last complete checkpoint)."""
    done = layout.checkpoints(run_dir)
    if name in (None, "last"):
        if not done:
            raise SpecdistillError(f"{run_dir}: no complete checkpoint (step-*/COMPLETE); run `specdistill train` first")
        return done[-1]
    digits = name.removeprefix("step-")
    if not digits.isdigit():
        raise SpecdistillError(f"--checkpoint {name!r}: expected step-N or N")
    step_dir = layout.step_dir(run_dir, int(digits))
    if step_dir not in done:
        have = ", ".join(p.name for p in done) or "none"
        raise SpecdistillError(f"--checkpoint {name}: {step_dir} is not a complete checkpoint (complete: {have})")
    return step_dir


def read_draft_config(step_dir: Path) -> dict:
    path = step_dir / "draft_config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SpecdistillError(f"{path}: cannot read ({e})") from None
    for key in ("kind", "config"):
        if key not in cfg:
            raise SpecdistillError(f"{path}: missing key '{key}'")
    if cfg["kind"] not in DEFAULT_FORMAT:
        raise SpecdistillError(f"{path}: unknown draft kind {cfg['kind']!r}")
    return cfg


def export_checkpoint(recipe, step_dir: Path, fmt: str) -> Path:
    """Write checkpoints/<run>/export/<fmt>/ atomically; return it."""
    from specdistill.target import load_target_config

    if fmt not in FORMAT_KIND:
        raise SpecdistillError(f"--format {fmt!r}: expected one of {', '.join(FORMAT_KIND)}")
    draft_cfg = read_draft_config(step_dir)
    kind = draft_cfg["kind"]
    if FORMAT_KIND[fmt] == "eagle3" or kind == "eagle3":
        if kind != "eagle3":
            raise SpecdistillError(f"{step_dir}: format {fmt} is for EAGLE-3 heads, this checkpoint is a "
                                   f"'{kind}' draft (use {DEFAULT_FORMAT[kind]}); EAGLE-3 heads arrive with issue 6")
        raise SpecdistillError(f"{step_dir}: exporting EAGLE-3 heads ({fmt}) is not implemented yet; "
                               "EAGLE-3 heads arrive with issue 6")
    if kind != FORMAT_KIND[fmt]:
        raise SpecdistillError(f"{step_dir}: format {fmt} exports '{FORMAT_KIND[fmt]}' drafts, this checkpoint "
                               f"is a '{kind}' draft (use --format {DEFAULT_FORMAT[kind]})")
    check_same_target(recipe, step_dir, draft_cfg)
    target_config = load_target_config(recipe.target)

    out = layout.export_dir(recipe.run_dir, fmt)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if fmt == "vllm-eagle":
            write_vllm_eagle(step_dir, draft_cfg, target_config, tmp)
        else:
            write_hf(step_dir, draft_cfg, recipe, target_config, tmp)
        write_readme(recipe, step_dir, draft_cfg, fmt, tmp, final_dir=out)
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def replace_dir(tmp: Path, out: Path) -> None:
    """Swap a finished temp dir into place; a crash never leaves a half-written export at `out`."""
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def check_same_target(recipe, step_dir: Path, draft_cfg: dict) -> None:
    """A head is only valid for the target it was trained on."""
    from specdistill.target import fingerprint_target

    saved = (draft_cfg.get("target") or {}).get("fingerprint")
    if not saved or "error" in saved:  # training could not fingerprint (e.g. a hub target offline)
        return
    try:
        now = fingerprint_target(recipe.target)
    except Exception as e:  # same reason now: say so, do not block the export
        print(f"warning: cannot fingerprint target {recipe.target.path} to check the checkpoint against it: "
              f"{str(e).splitlines()[0][:200]}")
        return
    for key in ("config", "weights"):
        if key in saved and saved[key] != now[key]:
            raise SpecdistillError(f"{step_dir}/draft_config.json: trained against a different target "
                                   f"({key} fingerprint {saved[key]} != {now[key]} of target.path {recipe.target.path})")


# ----------------------------------------------------------------------------------------- vllm-eagle

def vllm_eagle_config(target_config, dtype: torch.dtype) -> dict:
    """config.json for vLLM's EAGLE-1 head: the target's Llama config cut to one layer."""
    if target_config.model_type != "llama":
        raise SpecdistillError(f"format vllm-eagle: vLLM's EAGLE-1 head (EagleLlamaForCausalLM) implements Llama-"
                               f"architecture targets only; this target is '{target_config.model_type}'")
    from transformers import PretrainedConfig

    cfg = target_config.to_dict()
    generic = PretrainedConfig().to_dict()  # output_attentions, id2label, ...: noise in a head's config
    cfg = {k: v for k, v in cfg.items()
           if k not in DROPPED_CONFIG_KEYS and not (k in generic and json.dumps(v) == json.dumps(generic[k]))}
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1,
               tie_word_embeddings=False,  # the head has no LM head of its own; vLLM uses the target's
               use_cache=True, torch_dtype=str(dtype).removeprefix("torch."),
               bias=False)  # EAGLE research key (fc bias off); vLLM's Llama layer reads `bias` as attention bias
    if cfg.get("layer_types"):
        cfg["layer_types"] = cfg["layer_types"][:1]
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" in rope:  # also top level, for readers that predate transformers 5's rope_parameters
        cfg["rope_theta"] = rope["rope_theta"]
    return cfg


def expected_eagle_shapes(target_config) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor the EAGLE-1 head of this target owns (built on the meta device)."""
    from specdistill.train.eagle import EagleHead

    with torch.device("meta"):
        head = EagleHead(target_config)
    return {k: tuple(v.shape) for k, v in head.own_state_dict().items()}


def check_eagle_weights(path: Path, state: dict, expected: dict) -> None:
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or extra:
        raise SpecdistillError(f"{path}: tensors do not match an EAGLE-1 head of this target: "
                               f"missing {missing}, unexpected {extra}")
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise SpecdistillError(f"{path}: tensor {name} has shape {list(state[name].shape)}, the target "
                                   f"needs {list(shape)} (hidden/vocab of the head and target differ)")


def check_config_fits(path: Path, draft_config: dict, target_config) -> None:
    for key in ("hidden_size", "vocab_size", "intermediate_size", "num_attention_heads", "num_key_value_heads"):
        have, want = draft_config.get(key), getattr(target_config, key, None)
        if have is not None and want is not None and have != want:
            raise SpecdistillError(f"{path}: config.{key} = {have} but the target has {want}; "
                                   "this head was not trained for this target")


def write_vllm_eagle(step_dir: Path, draft_cfg: dict, target_config, out: Path) -> None:
    weights = step_dir / "draft.safetensors"
    check_config_fits(step_dir / "draft_config.json", draft_cfg["config"], target_config)
    state = load_file(weights)
    check_eagle_weights(weights, state, expected_eagle_shapes(target_config))
    dtype = next(iter(state.values())).dtype
    (out / "config.json").write_text(json.dumps(vllm_eagle_config(target_config, dtype), indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in sorted(state.items())}, out / "model.safetensors",
              metadata={"format": "pt"})


def load_vllm_eagle(export_dir: Path, target_model):
    """Our own reader of a vllm-eagle export: an EagleHead bound to the target's embedding and LM head."""
    from transformers import AutoConfig

    from specdistill.train.eagle import EagleHead

    export_dir = Path(export_dir)
    config = AutoConfig.from_pretrained(export_dir)
    check_config_fits(export_dir / "config.json", config.to_dict(), target_model.config)
    head = EagleHead(config)
    state = load_file(export_dir / "model.safetensors")
    check_eagle_weights(export_dir / "model.safetensors", state, {k: tuple(v.shape) for k, v in head.own_state_dict().items()})
    head.load_own_state_dict(state)
    head.bind_target(target_model.get_input_embeddings(), target_model.get_output_embeddings())
    return head.eval()


# ------------------------------------------------------------------------------------------------- hf

def load_draft_lm(step_dir: Path, draft_cfg: dict, target_model):
    """A draft_lm checkpoint as a plain transformers causal LM.

    draft.safetensors holds the draft's own weights; parts it shares frozen with the target (the
    embedding, the LM head) are absent there and are taken from the target, shape permitting.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config_dict = dict(draft_cfg["config"])
    model_type = config_dict.pop("model_type", None)
    if model_type is None:
        raise SpecdistillError(f"{step_dir}/draft_config.json: config has no model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    weights = step_dir / "draft.safetensors"
    state = load_file(weights)
    if any("lora_" in k for k in state):
        raise SpecdistillError(f"{weights}: holds LoRA adapter tensors; checkpoints store LoRA merged into "
                               "the base weights (train/draft_lm.py own_state_dict), this one does not")
    model = AutoModelForCausalLM.from_config(config, dtype=next(iter(state.values())).dtype)
    own = model.state_dict()
    extra = sorted(set(state) - set(own))
    if extra:
        raise SpecdistillError(f"{weights}: unexpected tensors for a {model_type} draft: {extra[:5]}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise SpecdistillError(f"{weights}: tensor {name} has shape {list(tensor.shape)}, "
                                   f"the draft config needs {list(own[name].shape)}")
    model.load_state_dict(state, strict=False)
    module_name = {m: n for n, m in model.named_modules()}
    embed_name = module_name[model.get_input_embeddings()] + ".weight"
    head_name = module_name[model.get_output_embeddings()] + ".weight"
    for name in sorted(set(own) - set(state)):  # the frozen parts shared with the target
        if name == embed_name:
            source = target_model.get_input_embeddings().weight
        elif name == head_name and not config.tie_word_embeddings:
            source = target_model.get_output_embeddings().weight
        elif name == head_name:
            continue  # tied: filled with the embedding
        else:
            raise SpecdistillError(f"{weights}: missing tensor {name}")
        target_param = model.get_parameter(name)
        if target_param.shape != source.shape:
            raise SpecdistillError(f"{weights}: has no {name} and the target's {list(source.shape)} does not "
                                   f"fit the draft's {list(target_param.shape)}")
        target_param.data.copy_(source.data)
    return model.eval()


def write_hf(step_dir: Path, draft_cfg: dict, recipe, target_config, out: Path) -> None:
    from specdistill.target import load_target, load_tokenizer

    draft_vocab = draft_cfg["config"].get("vocab_size")
    if draft_vocab != target_config.vocab_size:
        raise SpecdistillError(f"{step_dir}/draft_config.json: draft vocab_size {draft_vocab} != target vocab_size "
                               f"{target_config.vocab_size}; vLLM's draft_model method needs the same vocabulary")
    target = load_target(recipe.target)
    model = load_draft_lm(step_dir, draft_cfg, target)
    model.save_pretrained(out)
    load_tokenizer(recipe.target).save_pretrained(out)


# --------------------------------------------------------------------------------------------- README

def eval_summary(run_dir: Path, checkpoint: str) -> tuple[dict | None, str]:
    path = layout.eval_dir(run_dir) / f"{checkpoint}.json"
    if not path.exists():
        return None, "not evaluated"
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SpecdistillError(f"{path}: not valid JSON ({e})") from None
    lines = []
    for r in data.get("results", []):
        lines.append(f"- T={r.get('temperature')}: tau {fmt_num(r.get('tau'))}, alpha {fmt_num(r.get('alpha'))}, "
                     f"speedup {fmt_num(r.get('speedup'))}x, lossless {r.get('lossless')}, K={data.get('k')}")
    where = (f"measured by `specdistill eval` on {data.get('num_prompts')} prompts of {data.get('prompts')}, "
             f"max_new_tokens {data.get('max_new_tokens')}, hardware {data.get('hardware')}")
    return data, "\n".join(lines + ["", where]) if lines else "not evaluated"


def fmt_num(x) -> str:
    return "—" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)


def speculative_tokens(recipe, step_dir: Path) -> int:
    """export.num_speculative_tokens, else the measured best K at T=0, else eval.k."""
    if recipe.export.num_speculative_tokens:
        return recipe.export.num_speculative_tokens
    data, _ = eval_summary(recipe.run_dir, step_dir.name)
    for r in (data or {}).get("results", []):
        if r.get("temperature") == 0 and r.get("best_k"):
            return int(r["best_k"])
    return recipe.eval.k


def serve_command(recipe, fmt: str, export_dir: Path, k: int) -> str:
    from specdistill.target import resolve_target

    spec = {"method": VLLM_METHOD[fmt], "model": str(Path(export_dir).resolve()), "num_speculative_tokens": k}
    return f"vllm serve {resolve_target(recipe.target)} --speculative-config '{json.dumps(spec)}'"


def write_readme(recipe, step_dir: Path, draft_cfg: dict, fmt: str, out: Path, final_dir: Path) -> None:
    fingerprint = (draft_cfg.get("target") or {}).get("fingerprint")
    _, measured = eval_summary(recipe.run_dir, step_dir.name)
    k = speculative_tokens(recipe, step_dir)
    text = f"""# {recipe.run_name} / {step_dir.name} — {fmt}

Draft kind `{draft_cfg['kind']}`, step {draft_cfg.get('step')}, exported by
`specdistill export --recipe {recipe.source} --checkpoint {step_dir.name} --format {fmt}`.

## Target it belongs to
- target.path: `{recipe.target.path}` (dtype {recipe.target.dtype})
- served from: `{serve_command(recipe, fmt, final_dir, k).split()[2]}`
- fingerprint: `{json.dumps(fingerprint) if fingerprint else 'not recorded in the checkpoint'}`

The head is only valid with this exact target.

## Serve with vLLM
```sh
{serve_command(recipe, fmt, final_dir, k)}
```
"method" is explicit: this directory's name does not contain "eagle-", so vLLM would not guess it.

## Measured
{measured}
"""
    (out / "README.md").write_text(text)
