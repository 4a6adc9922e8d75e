"""`specdistill prepare`: read the corpus, apply the target's chat template, mask, split, save.

Output (docs/DESIGN.md): checkpoints/<run>/corpus/ = a datasets.DatasetDict (train, heldout) with
columns input_ids, loss_mask, row, messages, plus summary.json (counts, fingerprint, cut point).
All input checks run before tokenising; the held-out split is chosen by a hash of the row content,
so it does not move when rows are added, removed or reordered.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections import Counter
from pathlib import Path

import numpy as np
from tqdm import tqdm

from specdistill.data.corpus import read_corpus
from specdistill.data.tokenize import encode_chats, encode_texts, has_chat_template
from specdistill.errors import SpecdistillError
from specdistill.formats import read_corpus_summary, write_corpus_summary
from specdistill.layout import corpus_dir
from specdistill.target import fingerprint_tokenizer, load_tokenizer

SPLITS = ("train", "heldout")
BATCH_ROWS = 256


def heldout(content, fraction: float) -> bool:
    """Deterministic split: the first 8 bytes of sha256(row content) as a number in [0, 1)."""
    digest = hashlib.sha256(json.dumps(content, sort_keys=True, ensure_ascii=False).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def truncate(ids: list[int], mask: list[int], max_length: int, side: str = "right") -> tuple[list[int], list[int]]:
    """A row cut to max_length tokens. right: its first max_length. left: where its first trained token lies
    past half the window, the prompt is cut from the left so that it keeps max_length // 2 tokens of context
    and the reply gets the rest (a long prompt no longer leaves the window without a trained token)."""
    start = 0
    if side == "left" and len(ids) > max_length:
        first = next((i for i, m in enumerate(mask) if m), 0)
        start = max(0, first - max_length // 2)
    return ids[start:start + max_length], mask[start:start + max_length]


def encode_rows(tokenizer, fmt: str, rows: list, cfg, skipped: Counter) -> list[dict]:
    """[(row, messages|text)] -> [{row, input_ids, loss_mask, messages}], truncated, filtered."""
    out = []
    bar = tqdm(total=len(rows), desc="tokenising", unit="row", mininterval=1.0)
    for b in range(0, len(rows), BATCH_ROWS):
        batch = rows[b:b + BATCH_ROWS]
        items = [item for _, item in batch]
        if fmt == "text":
            encoded = encode_texts(tokenizer, items)
        else:
            encoded = encode_chats(tokenizer, items, [f"{cfg.path}: row {row}" for row, _ in batch],
                                   cfg.on_bad_row, cfg.chat_template_kwargs)
        for (row, item), got in zip(batch, encoded):
            if got is None:  # on_bad_row: skip, and no method could mask this conversation
                skipped["unmaskable_chat"] += 1
                continue
            ids, mask = got
            if not cfg.pack:
                ids, mask = truncate(ids, mask, cfg.max_length, cfg.truncate)
            if sum(mask) < cfg.min_assistant_tokens or not ids:
                skipped["too_few_assistant_tokens"] += 1
                continue
            out.append({"row": row, "input_ids": ids, "loss_mask": mask,
                        "messages": [] if fmt == "text" else item})
        bar.update(len(batch))
    bar.close()
    return out


def pack(seqs: list[dict], max_length: int) -> list[dict]:
    """Concatenate sequences and cut into max_length chunks (the last one may be shorter)."""
    ids = [t for s in seqs for t in s["input_ids"]]
    mask = [m for s in seqs for m in s["loss_mask"]]
    starts = np.cumsum([0] + [len(s["input_ids"]) for s in seqs[:-1]])
    out = []
    for a in range(0, len(ids), max_length):
        first = int(np.searchsorted(starts, a, side="right")) - 1
        out.append({"row": seqs[first]["row"], "input_ids": ids[a:a + max_length],
                    "loss_mask": mask[a:a + max_length], "messages": []})
    return out


def fingerprint(splits: dict[str, list[dict]]) -> str:
    """sha256 of every split's input_ids and loss masks, in order."""
    h = hashlib.sha256()
    for name in SPLITS:
        h.update(name.encode())
        for s in splits[name]:
            h.update(np.asarray(s["input_ids"], dtype=np.int32).tobytes())
            h.update(np.asarray(s["loss_mask"], dtype=np.int8).tobytes())
    return h.hexdigest()


def split_stats(seqs: list[dict]) -> dict:
    return {"sequences": len(seqs), "tokens": sum(len(s["input_ids"]) for s in seqs),
            "assistant_tokens": sum(sum(s["loss_mask"]) for s in seqs)}


def features():
    from datasets import Features, List, Value

    return Features({"input_ids": List(Value("int32")), "loss_mask": List(Value("int8")), "row": Value("int64"),
                     "messages": List({"role": Value("string"), "content": Value("string")})})


def write_prepared(out_dir: Path, splits: dict[str, list[dict]], summary: dict) -> None:
    """Save the DatasetDict and summary.json under a temp name, then swap it in (atomic for readers)."""
    from datasets import Dataset, DatasetDict

    cols = ("input_ids", "loss_mask", "row", "messages")
    dd = DatasetDict({name: Dataset.from_dict({c: [s[c] for s in splits[name]] for c in cols}, features=features())
                      for name in SPLITS})
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    import datasets

    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # our own bar already said what is happening
    try:
        dd.save_to_disk(str(tmp), num_shards={name: 1 for name in SPLITS})  # an empty split still gets a file
    finally:
        if was_enabled:
            datasets.enable_progress_bars()
    write_corpus_summary(tmp, summary)
    old = out_dir.with_name(out_dir.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if out_dir.exists():
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def load_prepared(path: Path):
    """(DatasetDict, summary) of a prepared corpus; a clear error when `prepare` has not run."""
    from datasets import load_from_disk

    path = Path(path)
    summary = read_corpus_summary(path)
    if summary is None:
        raise SpecdistillError(f"{path}: no prepared corpus; run `specdistill prepare --recipe ...` first")
    return load_from_disk(str(path)), summary


def select_rows(recipe, dd, summary: dict, corpus_path: Path):
    """Check the prepared corpus against the recipe; honour a smaller corpus.max_rows by taking a prefix.

    `specdistill cache ... corpus.max_rows=100` caches the sequences of the first 100 source rows
    without re-preparing; any other corpus setting that differs means the corpus is stale.
    """

    made_with = summary.get("corpus_settings")
    if made_with is not None and summary.get("regenerated_from") is None:
        now = corpus_settings(recipe.corpus)
        diff = sorted(k for k in set(made_with) | set(now) if made_with.get(k) != now.get(k))
        if diff:
            raise SpecdistillError(f"{corpus_path}: prepared with different corpus settings "
                                   f"({', '.join('corpus.' + k for k in diff)}); rerun `specdistill prepare`")
    limit = recipe.corpus.max_rows
    if limit is None or limit >= summary.get("rows_read", limit):
        return dd, summary
    from datasets import DatasetDict

    dd = DatasetDict({s: dd[s].select([i for i, r in enumerate(dd[s]["row"]) if r < limit]) for s in SPLITS})
    splits = {s: [{"input_ids": x, "loss_mask": m} for x, m in zip(dd[s]["input_ids"], dd[s]["loss_mask"])]
              for s in SPLITS}
    summary = dict(summary, fingerprint=fingerprint(splits), splits={s: {
        "sequences": len(splits[s]), "tokens": sum(len(x["input_ids"]) for x in splits[s]),
        "assistant_tokens": sum(sum(x["loss_mask"]) for x in splits[s])} for s in SPLITS})
    print(f"using the sequences of the first {limit:,} of {summary['rows_read']:,} prepared rows "
          f"(corpus.max_rows={limit}): {sum(len(v) for v in splits.values()):,} sequences", flush=True)
    return dd, summary


def build_splits(seqs: list[dict], cfg) -> dict[str, list[dict]]:
    splits = {name: [] for name in SPLITS}
    for s in seqs:
        content = s["messages"] or s["input_ids"]
        splits["heldout" if heldout(content, cfg.heldout_fraction) else "train"].append(s)
    if cfg.pack:
        splits = {name: pack(v, cfg.max_length) if v else [] for name, v in splits.items()}
    return splits


def make_summary(stats, fmt: str, splits: dict, skipped: Counter, tokenizer_fp: str, seconds: float) -> dict:
    per_split = {name: split_stats(v) for name, v in splits.items()}
    return {
        "sources": stats.sources, "format": fmt, "tokenizer": tokenizer_fp,
        "rows_read": stats.rows_read, "rows_skipped": dict(skipped), "rows_kept": sum(
            len({s["row"] for s in v}) for v in splits.values()),
        "sequences": sum(p["sequences"] for p in per_split.values()),
        "tokens": sum(p["tokens"] for p in per_split.values()),
        "assistant_tokens": sum(p["assistant_tokens"] for p in per_split.values()),
        "splits": per_split, "fingerprint": fingerprint(splits), "cut": stats.cut,
        "cut_message": stats.cut_message(), "seconds": round(seconds, 2),
    }


def corpus_settings(cfg) -> dict:
    """The corpus keys that shape the prepared sequences (max_rows is handled by the cache stage)."""
    return cfg.model_dump(mode="json", exclude={"max_rows"})


def prepare_corpus(recipe, out_dir: Path, tokenizer=None) -> dict:
    """Read, check, tokenise, split and save the recipe's corpus into out_dir; return the summary."""

    t0 = time.time()
    cfg = recipe.corpus
    fmt, rows, stats = read_corpus(cfg)
    tokenizer = tokenizer or load_tokenizer(recipe.target)
    if fmt != "text" and not has_chat_template(tokenizer):
        raise SpecdistillError(f"target {recipe.target.path}: its tokenizer has no chat template, so the "
                               f"{fmt} corpus {cfg.path} cannot be rendered as chat; use a chat (instruct) "
                               f"target or set corpus.format: text to train on plain text")
    if stats.cut_message():
        print(stats.cut_message(), flush=True)
    skipped = Counter(stats.skipped)
    seqs = encode_rows(tokenizer, fmt, rows, cfg, skipped)
    if not seqs:
        raise SpecdistillError(f"corpus.path {cfg.path}: every row has fewer than corpus.min_assistant_tokens="
                               f"{cfg.min_assistant_tokens} trained tokens (skipped: {dict(skipped)})")
    splits = build_splits(seqs, cfg)
    summary = make_summary(stats, fmt, splits, skipped, fingerprint_tokenizer(tokenizer), time.time() - t0)
    summary["corpus_settings"], summary["max_rows"] = corpus_settings(cfg), cfg.max_rows
    write_prepared(out_dir, splits, summary)
    return summary


def print_summary(summary: dict, out_dir: Path) -> None:
    print(f"prepared {out_dir}: format {summary['format']}, {summary['rows_read']:,} rows read, "
          f"{sum(summary['rows_skipped'].values()):,} skipped {summary['rows_skipped'] or ''}")
    for name, s in summary["splits"].items():
        print(f"  {name:8s} {s['sequences']:7,} sequences {s['tokens']:10,} tokens "
              f"{s['assistant_tokens']:10,} assistant tokens")
    if summary["cut_message"]:
        print(f"  {summary['cut_message']}")
    print(f"  fingerprint {summary['fingerprint'][:16]}  ({summary['seconds']} s)")


def run(recipe, args=None) -> dict:
    out = corpus_dir(recipe.run_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = prepare_corpus(recipe, out)
    print_summary(summary, out)
    return summary
