"""The `export` stage: write a checkpoint in a format vLLM loads, with the exact `vllm serve` command.

Formats (see ../shared/docs/vllm-formats.md; names and shapes checked against vLLM 0.33.0's
`llama_eagle.py`, `configs/eagle.py` and `config/speculative.py`):

  vllm-eagle   EAGLE-1 head -> vLLM `EagleLlamaForCausalLM` (`"method": "eagle"`).
               config.json: the head's Llama layer config (a Llama target's own config; for any other
               target a Llama config with its sizes: train/eagle.py llama_layer_config) with
               num_hidden_layers 1 and
               architectures ["LlamaForCausalLM"] (vLLM's EAGLEConfig renames it to
               EagleLlamaForCausalLM for method eagle; the same file is what EAGLE's own released
               heads ship, it parses with plain transformers, and a serve command without "method"
               fails loudly as a draft_model with missing weights instead of running a wrong class).
               model.safetensors: exactly fc.weight [H,2H] and layers.0.* without input_layernorm;
               no fc.bias, norm, lm_head or embed_tokens (vLLM shares the target's). Gemma targets:
               vLLM shares the raw embedding table, Gemma scales it by sqrt(H) inside its model, so
               sqrt(H) is folded into fc's embedding half (EAGLE-3 needs nothing: its input_layernorm
               normalises the embedding).
  hf           a draft_lm checkpoint as an ordinary HF model dir + the target's tokenizer
               (`"method": "draft_model"`, same vocab size as the target).
  vllm-eagle3  EAGLE-3 head -> vLLM `Eagle3LlamaForCausalLM` (`"method": "eagle3"`), plain layout.
  speculators  the same tensors with a speculators-format config.json (speculators_config, verifier).
               Both are written from the contract in `write_eagle3` (vLLM's own tensor names) and checked
               against vLLM's loader tables and, for speculators, the speculators 0.9.0 library's own
               config and model classes (tests/test_export.py).

Which kind offers which formats is the kind's (specdistill/kinds/, `EXPORT_FORMATS`, the default first).

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

from transformers import PretrainedConfig

from specdistill import formats, integrity, kinds, layout
from specdistill.errors import SpecdistillError
from specdistill.formats import DRAFT_FILES, checkpoint_fingerprint
from specdistill.target import fingerprint_target, load_target, load_target_config, load_tokenizer, resolve_target
from specdistill.train.eagle import EagleHead, llama_layer_config

VLLM_METHOD = {"vllm-eagle": "eagle", "vllm-eagle3": "eagle3", "speculators": "eagle3", "hf": "draft_model"}
# Config keys of the target that make no sense in a one-layer head's config.json.
DROPPED_CONFIG_KEYS = ("_name_or_path", "_model_name_or_path", "transformers_version", "dtype",
                       "pretraining_tp", "quantization_config", "auto_map", "target_model_type")


# ---------------------------------------------------------------------------------------------- run

def run(recipe, args) -> None:
    run_dir = recipe.run_dir
    step_dir = pick_checkpoint(run_dir, getattr(args, "checkpoint", None))
    kind = read_draft_config(step_dir)["kind"]
    formats = [args.format] if getattr(args, "format", None) else (recipe.export.formats
                                                                   or [kinds.kind(kind).EXPORT_FORMATS[0]])
    for fmt in formats:
        out = export_checkpoint(recipe, step_dir, fmt)
        print(f"exported {step_dir.name} ({kind}) as {fmt}: {out}")
        print("serve it with:", serve_command(recipe, fmt, out, speculative_tokens(recipe, step_dir)))


def pick_checkpoint(run_dir: Path, name: str | None) -> Path:
    """`step-N`, `N`, `best` (the train.best_metric link) or None (the last complete checkpoint)."""
    done = layout.checkpoints(run_dir)
    if name == "best":
        link = layout.best_link(run_dir)
        if not link.is_symlink() or not (link.resolve() / "COMPLETE").exists():
            raise SpecdistillError(f"{link}: no best checkpoint (train links it after each save)")
        return link.resolve()
    if name in (None, "last"):
        if not done:
            raise SpecdistillError(f"{run_dir}: no complete checkpoint (step-*/COMPLETE); run `specdistill train` first")
        return done[-1]
    step = layout.parse_step(name)
    if step is None:
        raise SpecdistillError(f"--checkpoint {name!r}: expected step-N or N")
    step_dir = layout.step_dir(run_dir, step)
    if step_dir not in done:
        have = ", ".join(p.name for p in done) or "none"
        raise SpecdistillError(f"--checkpoint {name}: {step_dir} is not a complete checkpoint (complete: {have})")
    return step_dir


def read_draft_config(step_dir: Path) -> dict:
    """The checkpoint's draft_config.json, its kind one that is implemented."""
    cfg = formats.read_draft_config(step_dir)
    kinds.kind(cfg["kind"])
    return cfg


def export_checkpoint(recipe, step_dir: Path, fmt: str) -> Path:
    """Write checkpoints/<run>/export/<fmt>/ atomically; return it."""
    fmt_kind = kinds.kind_of_format(fmt)
    draft_cfg = read_draft_config(step_dir)
    kind = kinds.kind(draft_cfg["kind"])
    if fmt_kind is not kind:
        raise SpecdistillError(f"{step_dir}: format {fmt} exports '{fmt_kind.NAME}' drafts ({fmt_kind.LABEL}), "
                               f"this checkpoint is a '{kind.NAME}' draft (use --format {kind.EXPORT_FORMATS[0]})")
    check_same_target(recipe, step_dir, draft_cfg)
    integrity.check_checkpoint(step_dir, only=DRAFT_FILES)  # a corrupt checkpoint is refused, not exported
    target_config = load_target_config(recipe.target)

    out = layout.export_dir(recipe.run_dir, fmt)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if hasattr(kind, "write_export"):  # a kind package that writes its own formats (specdistill/kinds/medusa/)
            kind.write_export(fmt, step_dir, draft_cfg, target_config, tmp, speculative_tokens(recipe, step_dir))
        elif fmt == "vllm-eagle":
            write_vllm_eagle(step_dir, draft_cfg, target_config, tmp)
        elif fmt in ("vllm-eagle3", "speculators"):
            write_eagle3(step_dir, draft_cfg, recipe, target_config, fmt, tmp, speculative_tokens(recipe, step_dir))
        else:
            write_hf(step_dir, draft_cfg, recipe, target_config, tmp)
        write_readme(recipe, step_dir, draft_cfg, fmt, tmp, final_dir=out)
        integrity.write_checksums(tmp)  # SHA256SUMS, read back by `specdistill verify` and by draft.init_from
        for f in tmp.iterdir():  # safetensors writes 0600; a serving process may run as another user
            f.chmod(0o644)
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
    """config.json for vLLM's EAGLE heads: the head's Llama layer config (train/eagle.py llama_layer_config:
    a Llama target's own config cut to one layer, or a Llama config with any other target's sizes)."""
    cfg = llama_layer_config(target_config).to_dict()
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
    with torch.device("meta"):
        head = EagleHead(target_config)
    return {k: tuple(v.shape) for k, v in head.own_state_dict().items()}


def check_eagle_weights(path: Path, state: dict, expected: dict) -> None:
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or extra:
        raise SpecdistillError(f"{path}: tensors do not match an EAGLE head of this target: "
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
    state["fc.weight"] = scale_embedding_half(state["fc.weight"], target_config, fold=True)
    dtype = next(iter(state.values())).dtype
    (out / "config.json").write_text(json.dumps(vllm_eagle_config(target_config, dtype), indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in sorted(state.items())}, out / "model.safetensors",
              metadata={"format": "pt"})


def scale_embedding_half(fc: torch.Tensor, target_config, fold: bool) -> torch.Tensor:
    """Gemma scales its embeddings by sqrt(H) inside its model, not in the embedding table that vLLM shares
    with the head; our EAGLE-1 fc was trained on the scaled embeddings, so the export folds sqrt(H) into the
    embedding half of fc.weight (fold=False undoes it). Other targets: unchanged."""
    if not target_config.model_type.startswith("gemma"):
        return fc
    h = target_config.hidden_size
    scale = torch.tensor(h ** 0.5, dtype=fc.dtype, device=fc.device).float()
    out = fc.float().clone()
    out[:, :h] = out[:, :h] * scale if fold else out[:, :h] / scale
    return out.to(fc.dtype)


# ------------------------------------------------------------------------------ vllm-eagle3, speculators
# Contract for an eagle3 checkpoint (vLLM 0.33 llama_eagle3.py names; `midlayer.` is read as `layers.0.`):
#   draft_config.json config: the head's Llama config (num_hidden_layers 1, vocab_size = target V) plus
#     draft_vocab_size Vd, eagle_aux_hidden_state_layer_ids (hidden_states indices = vLLM's convention,
#     docs/DESIGN.md), norm_before_residual, optional target_hidden_size Ht.
#   draft.safetensors: fc.weight [H, A*Ht]; layers.0.self_attn.{q,k,v}_proj.weight [*, 2H], o_proj,
#     layers.0.mlp.*, layers.0.{input_layernorm,hidden_norm,post_attention_layernorm}.weight [H];
#     norm.weight [H]; lm_head.weight [Vd, H]; d2t int64 [Vd] when Vd < V (target id = i + d2t[i]);
#     t2d optional. No embed_tokens (vLLM shares the target's).
SPECULATORS_VERSION = "0.9.0"


def eagle3_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, i, nh, nkv = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // nh
    aux = len(cfg.get("eagle_aux_hidden_state_layer_ids") or [0, 0, 0])
    ht = cfg.get("target_hidden_size") or h
    vd = cfg.get("draft_vocab_size") or cfg["vocab_size"]
    layer = "layers.0."
    shapes = {"fc.weight": (h, aux * ht), "norm.weight": (h,), "lm_head.weight": (vd, h),
              layer + "self_attn.q_proj.weight": (nh * d, 2 * h), layer + "self_attn.k_proj.weight": (nkv * d, 2 * h),
              layer + "self_attn.v_proj.weight": (nkv * d, 2 * h), layer + "self_attn.o_proj.weight": (h, nh * d),
              layer + "mlp.gate_proj.weight": (i, h), layer + "mlp.up_proj.weight": (i, h),
              layer + "mlp.down_proj.weight": (h, i)}
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        shapes[layer + norm + ".weight"] = (h,)
    if vd != cfg["vocab_size"]:
        shapes["d2t"] = (vd,)
    return shapes


def check_d2t(path: Path, d2t: torch.Tensor, vocab: int) -> torch.Tensor:
    """d2t[i] = target id of draft token i minus i; the target ids must be sorted, distinct, in [0, V)."""
    ids = torch.arange(len(d2t), device=d2t.device) + d2t.long()
    if len(ids) and (ids.min() < 0 or ids.max() >= vocab or not bool((ids[1:] > ids[:-1]).all())):
        raise SpecdistillError(f"{path}: d2t does not map draft ids to sorted, distinct target ids in [0, {vocab})")
    return ids


def eagle3_tensors(step_dir: Path, cfg: dict, target_config) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under vLLM's names, checked against the target; d2t/t2d as vLLM wants them."""
    weights = step_dir / "draft.safetensors"
    state = {k.replace("midlayer.", "layers.0."): v for k, v in load_file(weights).items()}
    t2d = state.pop("t2d", None)  # vLLM ignores it; rebuilt from d2t below
    aux_scale = state.pop("aux_scale", None)  # vLLM's fc reads the raw aux states: fold the scaling in
    if aux_scale is not None and "fc.weight" in state:
        state["fc.weight"] = (state["fc.weight"].float() * aux_scale.float()[None, :]).to(state["fc.weight"].dtype)
    vocab, vd = target_config.vocab_size, cfg.get("draft_vocab_size") or cfg["vocab_size"]
    if vd == vocab:
        state.pop("d2t", None)  # vLLM 0.33 has no draft_id_to_target_id then: a d2t would fail to load
    expected = eagle3_shapes(cfg)
    check_eagle_weights(weights, state, expected)
    if "d2t" not in state:
        return state
    state["d2t"] = state["d2t"].long()
    ids = check_d2t(weights, state["d2t"], vocab)
    mask = torch.zeros(vocab, dtype=torch.bool, device=ids.device)
    mask[ids] = True
    if t2d is not None and not torch.equal(t2d.bool(), mask):
        raise SpecdistillError(f"{weights}: t2d disagrees with d2t")
    state["t2d"] = mask  # kept for SGLang / EAGLE readers
    return state


def eagle3_layer_config(cfg: dict, target_config, dtype: torch.dtype) -> dict:
    """The head's Llama config as vLLM reads it: target's rope/eps, one layer, no tied head."""
    base = vllm_eagle_config(target_config, dtype)  # same Llama-only rule and rope handling as EAGLE-1
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
        if cfg.get(key) is not None:
            base[key] = cfg[key]
    base.pop("bias", None)
    return base


def write_eagle3(step_dir: Path, draft_cfg: dict, recipe, target_config, fmt: str, out: Path, k: int) -> None:
    cfg = draft_cfg["config"]
    path = step_dir / "draft_config.json"
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads"):
        if key not in cfg:
            raise SpecdistillError(f"{path}: config has no {key}")
    if cfg["vocab_size"] != target_config.vocab_size:
        raise SpecdistillError(f"{path}: config.vocab_size = {cfg['vocab_size']} but the target has "
                               f"{target_config.vocab_size}; this head was not trained for this target")
    ht = cfg.get("target_hidden_size") or cfg["hidden_size"]
    if ht != target_config.hidden_size:
        raise SpecdistillError(f"{path}: the head reads target states of width {ht}, the target's hidden_size "
                               f"is {target_config.hidden_size}")
    aux = cfg.get("eagle_aux_hidden_state_layer_ids")
    if aux and not all(0 <= a <= target_config.num_hidden_layers for a in aux):
        raise SpecdistillError(f"{path}: eagle_aux_hidden_state_layer_ids {aux} outside the target's "
                               f"0..{target_config.num_hidden_layers}")
    state = eagle3_tensors(step_dir, cfg, target_config)
    dtype = state["fc.weight"].dtype
    layer = eagle3_layer_config(cfg, target_config, dtype)
    vd = cfg.get("draft_vocab_size") or cfg["vocab_size"]
    head = dict(draft_vocab_size=vd, target_hidden_size=ht,
                norm_before_residual=bool(cfg.get("norm_before_residual", False)))  # explicit: defaults differ
    if fmt == "vllm-eagle3":
        config = {**layer, **head}
        if aux:  # top level for the runner, in eagle_config for the fc width (vLLM reads both places)
            config["eagle_aux_hidden_state_layer_ids"] = list(aux)
        config["eagle_config"] = {"use_aux_hidden_state": True, **({"eagle_aux_hidden_state_layer_ids": list(aux)} if aux else {})}
    else:
        config = speculators_config(recipe, target_config, layer, head, aux, dtype, k)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in sorted(state.items())}, out / "model.safetensors",
              metadata={"format": "pt"})


def speculators_config(recipe, target_config, layer: dict, head: dict, aux, dtype, k: int) -> dict:
    """speculators' Eagle3SpeculatorConfig as saved: no top-level model_type, the layer config nested."""
    layer = {k: v for k, v in layer.items() if k not in ("architectures", "torch_dtype", "use_cache")}
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        **head,
        "norm_before_fc": False, "fc_norm": False, "norm_output": False,
        "eagle_aux_hidden_state_layer_ids": list(aux) if aux else None,
        "embed_requires_grad": False,
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": resolve_target(recipe.target),
                         "architectures": list(target_config.architectures or [])},
        },
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


# ------------------------------------------------------------------------------------------------- hf

def write_hf(step_dir: Path, draft_cfg: dict, recipe, target_config, out: Path) -> None:
    draft_vocab = draft_cfg["config"].get("vocab_size")
    if draft_vocab != target_config.vocab_size:
        raise SpecdistillError(f"{step_dir}/draft_config.json: draft vocab_size {draft_vocab} != target vocab_size "
                               f"{target_config.vocab_size}; vLLM's draft_model method needs the same vocabulary")
    target = load_target(recipe.target)
    config, state = formats.read_checkpoint(step_dir)
    model = kinds.kind(config["kind"]).load(config["config"], state, target)  # in the checkpoint's dtype
    model.save_pretrained(out)
    load_tokenizer(recipe.target).save_pretrained(out)


# --------------------------------------------------------------------------------------------- README

def eval_summary(run_dir: Path, checkpoint: str) -> tuple[dict | None, str]:
    path = layout.eval_dir(run_dir) / f"{checkpoint}.json"
    if not path.exists():
        return None, "not evaluated"
    data = formats.read_json(path)
    recorded, current = data.get("checkpoint_fingerprint"), checkpoint_fingerprint(run_dir / checkpoint)
    if recorded and recorded != current:  # measured on other weights: refuse it (and its best K)
        return None, (f"not shown: {path.name} measured another version of this checkpoint (fingerprint "
                      f"{recorded} ≠ {current}); rerun `specdistill eval`")
    lines = [] if recorded else [f"- ⚠ unverified: {path.name} records no checkpoint fingerprint (an older eval)"]
    for r in data.get("results", []):
        t = float(r.get("temperature", 0))
        lossless = {True: "yes", False: "NO", None: "n/a (T>0)" if t > 0 else "—"}.get(r.get("lossless"))
        lines.append(f"- T={t:g}, K={data.get('k')}: tau {fmt_num(r.get('tau'))}, alpha {fmt_num(r.get('alpha'))}, "
                     f"speedup {fmt_num(r.get('speedup'), 2)}x, lossless {lossless}, best K {r.get('best_k', '—')}")
    hw = data.get("hardware") or {}
    where = (f"measured by `specdistill eval` ({path.name}) on {data.get('num_prompts')} prompts of "
             f"{data.get('prompts')}, max_new_tokens {data.get('max_new_tokens')}, on "
             f"{hw.get('cpu', '?')} ({hw.get('device', '?')}, {hw.get('threads', '?')} threads); "
             "speedup is against plain decoding of the target in the same run, by specdistill's own engine.")
    return data, "\n".join(lines + ["", where]) if lines else "not evaluated"


def fmt_num(x, digits: int = 3) -> str:
    return "—" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def speculative_tokens(recipe, step_dir: Path, why: bool = False):
    """export.num_speculative_tokens, else the measured best K at T=0, else eval.k (and why, if asked)."""
    k, reason = recipe.export.num_speculative_tokens, "export.num_speculative_tokens"
    if not k:
        data, _ = eval_summary(recipe.run_dir, step_dir.name)
        best = [r for r in (data or {}).get("results", []) if r.get("temperature") == 0 and r.get("best_k")]
        k, reason = (int(best[0]["best_k"]), "the best K measured at T=0 by `specdistill eval`: "
                     + best[0].get("best_k_from", "")) if best else (recipe.eval.k, "eval.k (no measured best K)")
    return (k, reason) if why else k


def serve_command(recipe, fmt: str, export_dir: Path, k: int) -> str:
    method = VLLM_METHOD.get(fmt) or kinds.kind_of_format(fmt).VLLM_METHODS[fmt]  # a kind package names its own
    spec = {"method": method, "model": str(Path(export_dir).resolve()), "num_speculative_tokens": k}
    return f"vllm serve {resolve_target(recipe.target)} --speculative-config '{json.dumps(spec)}'"


def write_readme(recipe, step_dir: Path, draft_cfg: dict, fmt: str, out: Path, final_dir: Path) -> None:
    fingerprint = (draft_cfg.get("target") or {}).get("fingerprint")
    _, measured = eval_summary(recipe.run_dir, step_dir.name)
    k, k_reason = speculative_tokens(recipe, step_dir, why=True)
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
"method" is explicit: vLLM guesses it from the path only (`eagle-` -> eagle, `eagle3` -> eagle3,
else draft_model), and an export directory may be moved or renamed.
num_speculative_tokens {k}: {k_reason}.

## Measured
{measured}
"""
    (out / "README.md").write_text(text)
