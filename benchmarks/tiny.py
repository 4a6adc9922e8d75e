"""What train_bench runs on and the training tests use: a tiny randomly initialised real model built from a
config, a cache written by running it (in the docs/DESIGN.md format, with no dependency on the cache stage's
writer; read back through specdistill.data.cache_reader like a real run's), a small training recipe, and the
training log read back."""
from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml

from specdistill import layout
from specdistill.formats import shard_name, write_manifest, write_shard
from specdistill.recipe import load_recipe


def tiny_config(model_type: str = "llama", vocab_size: int = 49152, layers: int = 2):
    from transformers import AutoConfig

    kwargs = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=2048,
                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if model_type.startswith("gemma"):
        kwargs["head_dim"] = 16
    return AutoConfig.for_model(model_type, **kwargs)


def tiny_model(model_type: str = "llama", vocab_size: int = 49152, seed: int = 0, layers: int = 2):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(model_type, vocab_size, layers)).eval()


def write_cache(run_dir: Path, target_dir: Path, n_train=6, n_heldout=3, k=8, seed=0, nan_sequence=None):
    """A cache with hidden_last and top-k for both splits, one shard each, per docs/DESIGN.md."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    g = torch.Generator().manual_seed(seed)
    cache = layout.cache_dir(run_dir)
    manifest = {"version": 1, "store": ["hidden_last", "topk"], "k": k, "dtype": "float32", "complete": True,
                "hidden_size": model.config.hidden_size, "vocab_size": model.config.vocab_size, "splits": {}}
    for split, n in (("train", n_train), ("heldout", n_heldout)):
        cols = {key: [] for key in ("input_ids", "loss_mask", "hidden_last", "topk_logprobs", "topk_ids", "tail_mass")}
        lens = []
        for s in range(n):
            T = int(torch.randint(10, 20, (1,), generator=g))
            ids = torch.randint(3, 400, (1, T), generator=g)
            with torch.no_grad():
                out = model(ids, output_hidden_states=True)
            h = out.hidden_states[-1][0]
            if split == "train" and s == nan_sequence:
                h = h.clone()
                h[T // 2] = float("nan")
            lp = out.logits[0].float().log_softmax(-1)
            top = lp.topk(k)
            mask = torch.ones(T, dtype=torch.uint8)
            mask[:3] = 0  # a "prompt" that is not trained
            cols["input_ids"].append(ids[0].int())
            cols["loss_mask"].append(mask)
            cols["hidden_last"].append(h)
            cols["topk_logprobs"].append(top.values)
            cols["topk_ids"].append(top.indices.int())
            cols["tail_mass"].append((1 - top.values.exp().sum(-1)).clamp(min=0))
            lens.append(T)
        tensors = {key: torch.cat(v).contiguous() for key, v in cols.items()}
        tensors["seq_lens"] = torch.tensor(lens, dtype=torch.int64)
        (cache / split).mkdir(parents=True, exist_ok=True)
        shard = write_shard(cache / split / shard_name(0), tensors)
        manifest["splits"][split] = {"sequences": n, "tokens": sum(lens), "shards": [shard]}
    write_manifest(cache, manifest)


def make_recipe(tmp_path, target_dir, run_name, kind="eagle", **train):
    tree = {
        "run_name": run_name,
        "target": {"path": str(target_dir)},
        "corpus": {"path": "unused.jsonl"},
        "draft": {"kind": kind},
        "loss": {"terms": {"fkl": 1.0, "tvd": 0.5}},
        "train": {"max_steps": 4, "save_every": 2, "micro_batch_size": 2, "lr": 0.003, "warmup_steps": 1,
                  "log_every": 1, "heldout_batches": 2, **train},
    }
    if kind == "draft_lm":
        tree["draft"].update(num_layers=1)
    path = tmp_path / f"{run_name}.yaml"
    path.write_text(yaml.safe_dump(tree))
    return load_recipe(path)


def read_log(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
