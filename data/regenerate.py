"""Self-distillation data (`cache.regenerate: true`): the target answers the corpus prompts itself.

Each conversation is cut before its first assistant turn and the target writes that one turn (batched
`generate`, left padding, prompts sorted by length, `cache.regenerate_temperature`,
`cache.regenerate_max_new_tokens`); later turns of multi-turn conversations are dropped. The training
row is the prompt's ids followed by exactly the ids the target produced (up to and including its EOS;
no EOS is added when it ran out of tokens), so the text is never re-tokenized and the row is what greedy
decoding would emit. `cache.regenerate_fraction` < 1 regenerates that share of the rows (chosen by a
hash of the row number) and keeps the corpus's own conversations for the rest: a mix.

`cache.regenerate_engine: vllm` hands the prompts to vLLM's batched generation in vLLM's own environment
(data/vllm_generate.py): the same rows, replies cut at the same ids, with vLLM's numerics (so the engine and
dtype are part of the reuse key). Both splits' prompts go to the engine as one list (one vLLM start-up, not one per
split). Replies are appended to `<dir>.partial/replies.jsonl` batch by batch, so a killed run resumes where it
stopped. The result is a prepared corpus in the shared cache directory, keyed by a hash of everything that shapes it
(corpus, target, sampling settings), so every run with the same inputs reuses it.
Prompts longer than corpus.max_length are skipped and counted. Rows keep their split (held out stays held out).
"""
from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from specdistill.data.prepare import SPLITS, fingerprint, load_prepared, select_rows, split_stats, write_prepared
from specdistill.data.tokenize import has_chat_template, prompt_ids
from specdistill.errors import SpecdistillError
from specdistill.formats import append_jsonl, read_corpus_summary, read_jsonl, write_json_atomic
from specdistill.processes import last_error
from specdistill.target import (cut_at_eos, eos_token_ids, fingerprint_target, fingerprint_tokenizer, load_tokenizer,
                                resolve_target, target_eos_token_ids)
from specdistill.vllm_env import run_script, vllm_python

VLLM_GENERATE = Path(__file__).with_name("vllm_generate.py")
PARTIAL_REPLIES = "replies.jsonl"  # in <dir>.partial/: every split's replies as they come, numbered across splits
VLLM_CHUNK = 256  # prompts per call of vLLM's generate: what a killed run can lose; vLLM batches within it


def prompt_messages(messages: list[dict]) -> list[dict]:
    """The conversation up to (not including) the first assistant turn that answers a user's. A conversation that
    opens with the assistant (ShareGPT's split conversations: 102 of 429 train rows in data-ab) keeps that turn as
    context, and the target answers the user's turn after it."""
    asked = False
    for i, m in enumerate(messages):
        if m["role"] == "assistant" and asked:
            return messages[:i]
        asked = asked or m["role"] == "user"
    return messages


@torch.inference_mode()
def generate_replies(model, prompts: list[list[int]], cfg, pad: int, desc: str,
                     partial: Path | None = None, eos: set[int] | None = None) -> list[list[int]]:
    """Reply ids per prompt; batched with left padding, shortest prompts first, stopping on `eos` (default:
    every id that ends a reply for the eval's decoders, so a reply ends where plain decoding would). Each
    finished batch is appended to `partial` (JSON lines {"i": prompt index, "ids": [...]}) and skipped
    when resuming."""
    device = model.get_input_embeddings().weight.device  # the target's (first) device: the prompts go there
    eos = eos if eos is not None else eos_token_ids(model)
    replies, todo = resumed(prompts, partial)
    sampling = cfg.regenerate_temperature > 0
    options = dict(do_sample=True, temperature=cfg.regenerate_temperature, top_k=0, top_p=1.0) if sampling \
        else dict(do_sample=False)
    bs = cfg.regenerate_batch_size
    for b in tqdm(range(0, len(todo), bs), desc=desc, unit="batch"):
        idx = todo[b:b + bs]
        torch.manual_seed(idx[0])  # sampled regeneration is reproducible, also after a resume
        longest = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), longest), pad, dtype=torch.long, device="cpu")  # built on the host, one copy over
        mask = torch.zeros(len(idx), longest, dtype=torch.long, device="cpu")
        for r, i in enumerate(idx):
            ids[r, longest - len(prompts[i]):] = torch.tensor(prompts[i], dtype=torch.long, device="cpu")
            mask[r, longest - len(prompts[i]):] = 1
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), pad_token_id=pad,
                             max_new_tokens=cfg.regenerate_max_new_tokens, eos_token_id=sorted(eos), **options)
        done = {i: cut_at_eos(out[r, longest:].tolist(), eos)[0] for r, i in enumerate(idx)}
        replies.update(done)
        if partial is not None:
            append_jsonl(partial, [{"i": i, "ids": v} for i, v in done.items()])
    return [replies[i] for i in range(len(prompts))]


def resumed(prompts: list[list[int]], partial: Path | None) -> tuple[dict[int, list[int]], list[int]]:
    """The replies already in `partial` (a line cut by a kill is left out: that reply is simply redone) and the
    prompts still to answer, shortest first."""
    replies = {rec["i"]: rec["ids"] for rec in read_jsonl(partial)} if partial is not None else {}
    return replies, sorted((i for i in range(len(prompts)) if i not in replies), key=lambda i: len(prompts[i]))


def vllm_replies(recipe, prompts: list[list[int]], partial: Path, eos: set[int]) -> list[list[int]]:
    """generate_replies' result, generated by vLLM in its own environment (data/vllm_generate.py), which appends
    each chunk's replies to `partial` as it goes; replies already there are not asked for again."""
    replies, todo = resumed(prompts, partial)
    if todo:
        append_jsonl(partial, [])  # ends a line a kill cut, so the worker's first reply does not join it
        python = vllm_python(recipe.served.python, "cache.regenerate_engine=vllm")
        job_file, result_file, log = (partial.with_suffix(ext) for ext in (".vllm-job.json", ".vllm-result.json", ".vllm.log"))
        write_json_atomic(job_file, {
            "target": resolve_target(recipe.target), "dtype": recipe.target.dtype,
            "max_model_len": recipe.corpus.max_length + recipe.cache.regenerate_max_new_tokens,
            "prompts": [{"i": i, "ids": prompts[i]} for i in todo], "max_new_tokens": recipe.cache.regenerate_max_new_tokens,
            "temperature": recipe.cache.regenerate_temperature, "stop_token_ids": sorted(eos), "chunk": VLLM_CHUNK,
            "partial": str(partial), "engine_args": recipe.cache.regenerate_vllm_args})
        result_file.unlink(missing_ok=True)
        print(f"regenerating {len(todo):,} prompts with vLLM ({python}; log: {log})", flush=True)
        rc, wall = run_script(python, VLLM_GENERATE, [str(job_file), str(result_file)], log, timeout_s=None)
        if rc != 0 or not result_file.exists():
            raise SpecdistillError(f"cache.regenerate_engine=vllm: vLLM exited {rc} after {wall:.0f} s: "
                                   f"{last_error(log)} (log: {log}); rerun `specdistill cache` to resume")
        done = json.loads(result_file.read_text())
        print(f"vLLM generated {done['generated_tokens']:,} tokens in {done['generate_s']:.1f} s "
              f"({done['generated_tokens'] / max(done['generate_s'], 1e-9):.1f} tokens/s; start-up "
              f"{done['startup_s']:.0f} s)", flush=True)
        replies.update({rec["i"]: rec["ids"] for rec in read_jsonl(partial)})
    return [cut_at_eos(replies[i], eos)[0] for i in range(len(prompts))]


def regenerated(row: int, fraction: float) -> bool:
    """Whether row `row` is answered by the target: a fixed hash, so a larger fraction keeps the smaller one's rows."""
    if fraction >= 1.0:
        return True
    h = int.from_bytes(hashlib.sha256(f"regenerate:{row}".encode()).digest()[:8], "big")
    return h / 2**64 < fraction


def template_kwargs(recipe) -> dict:
    """What the chat template gets while regenerating: corpus.chat_template_kwargs + the thinking switch."""
    kw = dict(recipe.corpus.chat_template_kwargs)
    if recipe.cache.regenerate_thinking is not None:
        kw["enable_thinking"] = recipe.cache.regenerate_thinking
    return kw


def split_prompts(tokenizer, ds, recipe, skipped: Counter) -> dict:
    """One split's rows the mix keeps as they are (`kept`) and the prompts the target answers, with their rows and
    conversations."""
    kept, rows, prompts, convs = [], [], [], []
    kw = template_kwargs(recipe)
    for row, messages, ids, mask in zip(ds["row"], ds["messages"], ds["input_ids"], ds["loss_mask"]):
        if not messages:
            raise SpecdistillError(f"cache.regenerate: row {row} of the prepared corpus is plain text; "
                                   f"regeneration needs a chat corpus (prompts to answer)")
        if not regenerated(row, recipe.cache.regenerate_fraction):  # the mix keeps this row as the corpus has it
            kept.append({"row": row, "input_ids": list(ids), "loss_mask": list(mask), "messages": list(messages)})
            continue
        prompt = prompt_messages(list(messages))
        if not prompt or prompt[-1]["role"] != "user":
            skipped["no_user_prompt"] += 1
            continue
        p_ids = prompt_ids(tokenizer, prompt, **kw)
        if len(p_ids) >= recipe.corpus.max_length:
            skipped["prompt_too_long"] += 1
            continue
        rows.append(row), prompts.append(p_ids), convs.append(prompt)
    return {"kept": kept, "rows": rows, "prompts": prompts, "convs": convs}


def regenerate_splits(model, tokenizer, dd, recipe, skipped: Counter, partial: Path) -> dict[str, list[dict]]:
    """Every split's rows with the target's replies. The prompts of all splits go to the engine at once (one vLLM
    start-up, not one per split); `partial` numbers them across the splits in SPLITS order."""
    todo = {name: split_prompts(tokenizer, dd[name], recipe, skipped) for name in SPLITS}
    prompts = [p for name in SPLITS for p in todo[name]["prompts"]]
    replies = []
    if prompts and recipe.cache.regenerate_engine == "vllm":
        replies = vllm_replies(recipe, prompts, partial, target_eos_token_ids(recipe.target, tokenizer))
    elif prompts:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        replies = generate_replies(model, prompts, recipe.cache, pad, "regenerating", partial,
                                   eos_token_ids(model, tokenizer))
    out, at = {}, 0
    for name in SPLITS:
        t = todo[name]
        mine, at = replies[at:at + len(t["prompts"])], at + len(t["prompts"])
        out[name] = answered_rows(t, mine, tokenizer, recipe, skipped)
    return out


def answered_rows(todo: dict, replies: list[list[int]], tokenizer, recipe, skipped: Counter) -> list[dict]:
    """A split's training rows: each prompt followed by exactly the ids of its reply, and the rows the mix kept."""
    out = []
    for row, prompt, p_ids, reply in zip(todo["rows"], todo["convs"], todo["prompts"], replies):
        ids = (p_ids + reply)[:recipe.corpus.max_length]
        mask = ([0] * len(p_ids) + [1] * len(reply))[:recipe.corpus.max_length]
        if sum(mask) < recipe.corpus.min_assistant_tokens:
            skipped["too_few_assistant_tokens"] += 1
            continue
        text = tokenizer.decode(reply, skip_special_tokens=True).strip()
        out.append({"row": row, "input_ids": ids, "loss_mask": mask,
                    "messages": prompt + [{"role": "assistant", "content": text}]})
    return sorted(out + todo["kept"], key=lambda r: r["row"])


def regeneration_inputs(recipe, summary: dict) -> dict:
    """Everything that shapes a regenerated corpus (its reuse key)."""
    inputs = {"corpus": summary["fingerprint"], "target": fingerprint_target(recipe.target),
              "temperature": recipe.cache.regenerate_temperature,
              "max_new_tokens": recipe.cache.regenerate_max_new_tokens, "max_length": recipe.corpus.max_length,
              "min_assistant_tokens": recipe.corpus.min_assistant_tokens, "format": "exact-ids",
              "prompt": "to-the-first-answered-user-turn"}  # was: to the first assistant turn (rows opening with one dropped)
    if recipe.cache.regenerate_engine != "transformers":  # another engine's numerics: another corpus
        inputs["engine"] = {"name": recipe.cache.regenerate_engine, "dtype": recipe.target.dtype}
    if recipe.cache.regenerate_fraction < 1.0:
        inputs["fraction"] = recipe.cache.regenerate_fraction
    if template_kwargs(recipe):
        inputs["template_kwargs"] = template_kwargs(recipe)
    return inputs


def regenerated_dir(root: Path, inputs: dict) -> Path:
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]
    return Path(root) / f"regenerated-{key}"


def regenerated_corpus(recipe, source: Path, root: Path, model, tokenizer=None) -> Path:
    """The prepared corpus at `source` with its first assistant turns regenerated, under `root` (reused when
    the same inputs were regenerated before, resumed when a previous run was killed)."""

    tokenizer = tokenizer or load_tokenizer(recipe.target)
    if not has_chat_template(tokenizer):
        raise SpecdistillError(f"cache.regenerate: target {recipe.target.path} has no chat template to prompt it with")
    dd, summary = select_rows(recipe, *load_prepared(source), source)  # corpus.max_rows: only the rows cached
    inputs = regeneration_inputs(recipe, summary)
    out_dir = regenerated_dir(root, inputs)
    done = read_corpus_summary(out_dir)
    if done is not None and done.get("regenerated_from") == inputs:
        print(f"reusing regenerated corpus {out_dir}")
        return out_dir
    partial = out_dir.with_name(out_dir.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    write_json_atomic(partial / "inputs.json", inputs)
    t0 = time.time()
    skipped = Counter()
    splits = regenerate_splits(model, tokenizer, dd, recipe, skipped, partial / PARTIAL_REPLIES)
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
        "note": "first assistant turn regenerated by the target (exact ids); later turns dropped"
                + ("" if recipe.cache.regenerate_fraction >= 1.0 else
                   f"; {recipe.cache.regenerate_fraction:g} of the rows, the rest as the corpus has them"),
    }
    write_prepared(out_dir, splits, new_summary)
    print(f"regenerated {new_summary['sequences']:,} conversations into {out_dir} "
          f"({new_summary['assistant_tokens']:,} assistant tokens, {new_summary['seconds']} s)")
    return out_dir
