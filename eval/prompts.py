"""Evaluation prompts: MT-bench (first turns) or any JSONL, chat-templated with the target tokenizer."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specdistill.errors import SpecdistillError
from specdistill.target_files import pypi_asset

DEFAULT_FIELDS = ("turns", "prompt", "instruction", "question", "text")


@dataclass
class Prompt:
    text: str
    category: str
    ids: list[int]


def _prompt_text(row: dict, field: str | None, where: str) -> str:
    names = [field] if field else [f for f in DEFAULT_FIELDS if f in row]
    if not names or names[0] not in row:
        want = f"field '{field}'" if field else "one of " + ", ".join(DEFAULT_FIELDS)
        raise SpecdistillError(f"{where}: no prompt field (eval.prompt_field): expected {want}")
    value = row[names[0]]
    if isinstance(value, list):  # MT-bench `turns`: the first user turn
        value = value[0] if value else None
    if not isinstance(value, str) or not value.strip():
        raise SpecdistillError(f"{where}: field '{names[0]}' is not a non-empty string")
    return value


def read_prompt_rows(spec: str, field: str | None, limit: int) -> list[tuple[str, str]]:
    """(text, category) for `limit` rows of the JSONL named by `spec` (path or pypi:NAME), spread over categories."""
    path = pypi_asset(spec) if spec.startswith("pypi:") else Path(spec).expanduser()
    if not path.is_file():
        raise SpecdistillError(f"eval.prompts {spec}: no such file")
    rows = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"eval.prompts {path}: line {lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise SpecdistillError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise SpecdistillError(f"{where}: expected a JSON object")
            rows.append((_prompt_text(row, field, where), str(row.get("category", "all"))))
    if not rows:
        raise SpecdistillError(f"eval.prompts {path}: no prompts")
    return spread_over_categories(rows, limit)


def spread_over_categories(rows: list[tuple[str, str]], limit: int) -> list[tuple[str, str]]:
    """The first `limit` prompts taken round-robin over categories, in file order within each.

    MT-bench is sorted by category (its first 10 rows are all 'writing'): a plain prefix would measure
    one kind of traffic only.
    """
    by_cat: dict[str, list[tuple[str, str]]] = {}
    for row in rows:
        by_cat.setdefault(row[1], []).append(row)
    picked, depth = [], 0
    while len(picked) < min(limit, len(rows)):
        for cat_rows in by_cat.values():
            if depth < len(cat_rows) and len(picked) < limit:
                picked.append(cat_rows[depth])
        depth += 1
    return picked


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Chat template with the generation prompt; plain text when the tokenizer has none."""
    if tokenizer.chat_template:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        return list(ids)
    return tokenizer(text)["input_ids"]


def load_prompts(eval_cfg, tokenizer) -> list[Prompt]:
    rows = read_prompt_rows(eval_cfg.prompts, eval_cfg.prompt_field, eval_cfg.num_prompts)
    return [Prompt(text, cat, encode_prompt(tokenizer, text)) for text, cat in rows]


def load_tuning_prompts(eval_cfg, tokenizer) -> list[Prompt]:
    """eval.tuning_prompts prompts after the reported ones in the same category spread: disjoint from them
    (the spread's first num_prompts are exactly load_prompts'); fewer when the file runs out."""
    if not eval_cfg.tuning_prompts:
        return []
    rows = read_prompt_rows(eval_cfg.prompts, eval_cfg.prompt_field, eval_cfg.num_prompts + eval_cfg.tuning_prompts)
    return [Prompt(text, cat, encode_prompt(tokenizer, text)) for text, cat in rows[eval_cfg.num_prompts:]]
