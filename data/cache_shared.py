"""The shared cache store: one folder per cache key (a hash of everything that shapes a cache) under the shared
cache root, reused by every run that would compute the same; its lock, the run's link to it, and the tokenizer
fingerprint remembered there."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from specdistill.errors import SpecdistillError
from specdistill.formats import read_json, write_json_atomic
from specdistill.layout import shared_cache_root
from specdistill.target import resolve_target


def cache_settings(recipe, store: list[str]) -> dict:
    """The cache keys that shape the shards: regenerate_* act through the corpus fingerprint, topk only when stored;
    where the cache lives, how training reads it and how it is checked (dir, mode, verify) do not shape it."""
    skip = {k for k in type(recipe.cache).model_fields if k.startswith("regenerate")} | (set() if "topk" in store else {"topk"})
    return recipe.cache.model_dump(mode="json", exclude=skip | {"dir", "mode", "verify"})


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model")


def remembered_tokenizer_fingerprint(recipe, compute) -> str:
    """The target tokenizer's fingerprint without loading transformers when its files are unchanged: loading a
    tokenizer costs seconds of imports, most of a cache stage that only finds its shared cache. Remembered in
    <shared cache root>/tokenizer-fingerprints.json by a hash of the tokenizer files (local targets only)."""

    where = Path(resolve_target(recipe.target))
    if not where.is_dir():
        return compute()
    from importlib.metadata import version

    h = hashlib.sha256(version("transformers").encode())  # how the files are read is part of it
    for name in TOKENIZER_FILES:
        f = where / name
        if f.is_file():
            h.update(name.encode() + b"\0" + f.read_bytes())
    key = h.hexdigest()
    memo_file = shared_cache_root(recipe) / "tokenizer-fingerprints.json"
    try:
        memo = read_json(memo_file)
    except SpecdistillError:  # none yet, or damaged: computed again
        memo = {}
    if key not in memo:
        memo[key] = compute()
        try:
            memo_file.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(memo_file, memo)
        except OSError:
            pass
    return memo[key]


def cache_key(fingerprints: dict, store: list[str], aux_layers: list[int]) -> str:
    """The shared cache folder's name: a hash of everything that shapes the cache (what it is made from, what it stores)."""
    what = {**fingerprints, "store": store, "aux_layers": aux_layers}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


class CacheLock:
    """An exclusive lock file, so two runs never write one shared cache at the same time."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fh = open(self.path, "w")
        try:
            fcntl.flock(self.fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another process writing the same cache ({self.path}) ...", flush=True)
            fcntl.flock(self.fh, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        self.fh.close()


def link_run_cache(link: Path, shared: Path) -> None:
    """Point checkpoints/<run>/cache at the shared cache (atomically: a temp link renamed over the old one)."""
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(f".{link.name}.link-{os.getpid()}")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(Path(shared).resolve(), target_is_directory=True)
    os.replace(tmp, link)
