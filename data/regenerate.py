"""Self-distillation data (`cache.regenerate: true`): the target answers the corpus prompts itself.

Kept simple on purpose: each conversation is cut before its first assistant turn and the target
writes that one turn (batched `generate`, left padding, `cache.regenerate_temperature`,
`cache.regenerate_max_new_tokens`); later turns of multi-turn conversations are dropped. Prompts
longer than corpus.max_length are skipped and counted. The result is saved as a prepared corpus
under checkpoints/<run>/corpus-regenerated/ and reused on rerun while its inputs are unchanged.
Rows keep the split they had, so held-out prompts stay held out.
"""
from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from specdistill.data.prepare import SPLITS, fingerprint, load_prepared, split_stats, write_prepared
from specdistill.data.tokenize import encode_chats, has_chat_template, prompt_ids
from specdistill.errors import SpecdistillError
from specdistill.target import fingerprint_target, fingerprint_tokenizer, load_tokenizer


def prompt_messages(messages: list[dict]) -> list[dict]:
    """The conversation up to (not including) its first assistant turn."""
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            return messages[:i]
    return messages


@torch.inference_mode()
def generate_replies(model, tokenizer, prompts: list[list[int]], cfg, desc: str) -> list[str]:
    """Batched generation with left padding; prompts sorted by length so batches pad little."""
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    replies = [""] * len(prompts)
    sampling = cfg.regenerate_temperature > 0
    options = dict(do_sample=True, temperature=cfg.regenerate_temperature, top_k=0, top_p=1.0) if sampling \
        else dict(do_sample=False)
    torch.manual_seed(0)  # sampled regeneration is reproducible
    bs = cfg.regenerate_batch_size
    for b in tqdm(range(0, len(order), bs), desc=desc, unit="batch"):
        idx = order[b:b + bs]
        longest = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), longest), pad, dtype=torch.long)
        mask = torch.zeros(len(idx), longest, dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, longest - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, longest - len(prompts[i]):] = 1
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), pad_token_id=pad,
                             max_new_tokens=cfg.regenerate_max_new_tokens, **options)
        for r, i in enumerate(idx):
            replies[i] = tokenizer.decode(out[r, longest:], skip_special_tokens=True).strip()
    return replies


def template_kwargs(recipe) -> dict:
    """What the chat template gets while regenerating: corpus.chat_template_kwargs + the thinking switch."""
    kw = dict(recipe.corpus.chat_template_kwargs)
    if recipe.cache.regenerate_thinking is not None:
        kw["enable_thinking"] = recipe.cache.regenerate_thinking
    return kw


def regenerate_split(model, tokenizer, ds, recipe, skipped: Counter, name: str) -> list[dict]:
    rows, prompts, convs = [], [], []
    kw = template_kwargs(recipe)
    for row, messages in zip(ds["row"], ds["messages"]):
        if not messages:
            raise SpecdistillError(f"cache.regenerate: row {row} of the prepared corpus is plain text; "
                                   f"regeneration needs a chat corpus (prompts to answer)")
        prompt = prompt_messages(list(messages))
        if not prompt or prompt[-1]["role"] != "user":
            skipped["no_user_prompt"] += 1
            continue
        ids = prompt_ids(tokenizer, prompt, **kw)
        if len(ids) >= recipe.corpus.max_length:
            skipped["prompt_too_long"] += 1
            continue
        rows.append(row), prompts.append(ids), convs.append(prompt)
    replies = generate_replies(model, tokenizer, prompts, recipe.cache, f"regenerating {name}") if prompts else []
    convs = [c + [{"role": "assistant", "content": r}] for c, r in zip(convs, replies)]
    out = []
    encoded = encode_chats(tokenizer, convs, [f"row {r}" for r in rows], "skip", kw) if convs else []
    for row, conv, got in zip(rows, convs, encoded):
        if got is None:
            skipped["unmaskable_chat"] += 1
            continue
        ids, mask = got
        ids, mask = ids[:recipe.corpus.max_length], mask[:recipe.corpus.max_length]
        if sum(mask) < recipe.corpus.min_assistant_tokens:
            skipped["too_few_assistant_tokens"] += 1
            continue
        out.append({"row": row, "input_ids": ids, "loss_mask": mask, "messages": conv})
    return out


def regenerated_corpus(recipe, source: Path, out_dir: Path, model, tokenizer=None) -> Path:
    """Regenerate the assistant turns of the prepared corpus at `source` into `out_dir` (or reuse it)."""

    tokenizer = tokenizer or load_tokenizer(recipe.target)
    if not has_chat_template(tokenizer):
        raise SpecdistillError(f"cache.regenerate: target {recipe.target.path} has no chat template to prompt it with")
    dd, summary = load_prepared(source)
    inputs = {"corpus": summary["fingerprint"], "target": fingerprint_target(recipe.target),
              "temperature": recipe.cache.regenerate_temperature,
              "max_new_tokens": recipe.cache.regenerate_max_new_tokens, "max_length": recipe.corpus.max_length,
              "min_assistant_tokens": recipe.corpus.min_assistant_tokens}
    if template_kwargs(recipe):  # only when set, so regenerated corpora made before the switch stay reusable
        inputs["template_kwargs"] = template_kwargs(recipe)
    done = Path(out_dir) / "summary.json"
    if done.exists() and json.loads(done.read_text()).get("regenerated_from") == inputs:
        print(f"reusing regenerated corpus {out_dir}")
        return Path(out_dir)
    t0 = time.time()
    skipped = Counter()
    splits = {name: regenerate_split(model, tokenizer, dd[name], recipe, skipped, name) for name in SPLITS}
    if not any(splits.values()):
        raise SpecdistillError(f"cache.regenerate: no usable prompts in {source} (skipped: {dict(skipped)})")
    per_split = {name: split_stats(v) for name, v in splits.items()}
    new_summary = {
        "sources": [str(source)], "format": "messages", "tokenizer": fingerprint_tokenizer(tokenizer),
        "rows_read": sum(len(dd[n]) for n in SPLITS), "rows_skipped": dict(skipped),
        "sequences": sum(p["sequences"] for p in per_split.values()),
        "tokens": sum(p["tokens"] for p in per_split.values()),
        "assistant_tokens": sum(p["assistant_tokens"] for p in per_split.values()),
        "splits": per_split, "fingerprint": fingerprint(splits), "cut": summary.get("cut"),
        "cut_message": summary.get("cut_message"), "seconds": round(time.time() - t0, 2),
        "regenerated_from": inputs,
        "note": "first assistant turn regenerated by the target; later turns dropped",
    }
    write_prepared(Path(out_dir), splits, new_summary)
    print(f"regenerated {new_summary['sequences']:,} conversations into {out_dir} "
          f"({new_summary['assistant_tokens']:,} assistant tokens, {new_summary['seconds']} s)")
    return Path(out_dir)
