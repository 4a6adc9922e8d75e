"""Checksums read back where data is trusted: cache shards, checkpoints and exports.

Every file a stage writes is recorded with its size and sha256 (cache shards in the manifest, with one
sha256 per BLOCK bytes as well; a checkpoint's files in its COMPLETE marker; an export's in its
SHA256SUMS). Verifying a file (`check_file`) always checks that it is there with the recorded size and,
for safetensors, that its header parses and its tensors exactly fill the file; the data itself is
hashed in full (`full`) or by a random sample of blocks (`sample`; a cache no larger than SAMPLE_MIN
is hashed in full). Each problem comes back as one line naming the file.
"""
from __future__ import annotations

import hashlib
import json
import random
import struct
from pathlib import Path

from specdistill.errors import SpecdistillError

BLOCK = 64 << 20  # bytes per block checksum: a terabyte cache records 16k of them, a sampled check reads whole blocks
SAMPLE_FRACTION = 1 / 64  # share of a large cache's blocks a sampled check hashes
SAMPLE_MIN = 256 << 20  # a sampled check hashes at least this much (all of a smaller cache)
MODES = ("sample", "full", "none")


def file_digest(path: Path) -> dict:
    """{bytes, sha256, block_sha256}: one pass over the file."""
    whole, blocks, size = hashlib.sha256(), [], 0
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(BLOCK), b""):
            whole.update(block)
            blocks.append(hashlib.sha256(block).hexdigest())
            size += len(block)
    return {"bytes": size, "sha256": whole.hexdigest(), "block_sha256": blocks}


def sha256_of(path: Path, start: int = 0, length: int | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        fh.seek(start)
        left = length
        while left is None or left > 0:
            block = fh.read(1 << 22 if left is None else min(1 << 22, left))
            if not block:
                break
            h.update(block)
            left = None if left is None else left - len(block)
    return h.hexdigest()


def safetensors_problem(path: Path, size: int) -> str | None:
    """Why a safetensors file's header is unreadable or does not fill the file exactly; None when it is sound."""
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            return "too short for a safetensors header"
        n = struct.unpack("<Q", head)[0]
        if n > size - 8:
            return f"safetensors header claims {n} bytes, more than the file holds"
        try:
            header = json.loads(fh.read(n))
        except (ValueError, UnicodeDecodeError):
            return "safetensors header is not valid JSON"
    data = size - 8 - n
    ends = [t.get("data_offsets", [0, 0])[1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)]
    if any(e > data for e in ends) or (ends and max(ends) != data):
        return f"safetensors tensors end at byte {max(ends, default=0)} of {data} data bytes (truncated or padded)"
    return None


def check_file(path: Path, entry: dict, blocks: list[int] | None = None) -> str | None:
    """One line naming what is wrong with `path` against its recorded entry {bytes, sha256[, block_sha256]}, or None.

    blocks: None hashes the whole file; a list hashes only those blocks (an empty list: size and header only).
    """
    path = Path(path)
    if not path.is_file():
        return f"{path}: missing"
    size = path.stat().st_size
    if size != entry["bytes"]:
        return f"{path}: {size} bytes, {entry['bytes']} recorded (truncated or overwritten)"
    if path.suffix == ".safetensors":
        problem = safetensors_problem(path, size)
        if problem:
            return f"{path}: {problem}"
    if blocks is None:
        if sha256_of(path) != entry["sha256"]:
            return f"{path}: sha256 differs from the recorded one (corrupted data)"
        return None
    recorded = entry.get("block_sha256")
    for b in blocks:
        if recorded is None:  # written before block checksums: a sampled block is the whole file
            return check_file(path, entry, None)
        if sha256_of(path, b * BLOCK, BLOCK) != recorded[b]:
            return (f"{path}: sha256 of bytes {b * BLOCK}..{min(size, (b + 1) * BLOCK)} differs from the recorded one "
                    f"(corrupted data)")
    return None


def num_blocks(entry: dict) -> int:
    return max(1, len(entry.get("block_sha256") or [None]))


def sampled_blocks(entries: list[dict], mode: str, rng: random.Random | None = None) -> list[list[int] | None]:
    """Per file: the blocks to hash (None: all). full: all; none: none (size and header only); sample: every block
    of a set of files no larger than SAMPLE_MIN, else a random SAMPLE_FRACTION of the blocks (at least SAMPLE_MIN)."""
    if mode == "full":
        return [None] * len(entries)
    if mode == "none":
        return [[] for _ in entries]
    total = sum(e["bytes"] for e in entries)
    if total <= SAMPLE_MIN:
        return [None] * len(entries)
    share = max(SAMPLE_FRACTION, SAMPLE_MIN / total)
    rng = rng or random.Random()
    return [[b for b in range(num_blocks(e)) if rng.random() < share] for e in entries]


# ---- cache ------------------------------------------------------------------------------------------

def cache_problems(cache_dir: Path, manifest: dict, mode: str) -> list[tuple[str, int, str]]:
    """(split, shard index, one line) for every bad shard of a cache the manifest lists as written."""
    cache_dir = Path(cache_dir)
    listed = [(split, i, shard) for split, info in manifest["splits"].items() for i, shard in enumerate(info["shards"])]
    plan = sampled_blocks([shard for _, _, shard in listed], mode)
    bad = []
    for (split, i, shard), blocks in zip(listed, plan):
        problem = check_file(cache_dir / split / shard["file"], shard, blocks)
        if problem:
            bad.append((split, i, problem))
    return bad


def check_cache(cache_dir: Path, manifest: dict, mode: str, recipe_source=None) -> None:
    """Stop with one line naming the first bad shard (and how many there are)."""
    bad = cache_problems(cache_dir, manifest, mode)
    if bad:
        more = f" ({len(bad)} bad shards; `specdistill verify` lists them)" if len(bad) > 1 else ""
        how = f" --recipe {recipe_source}" if recipe_source else ""
        raise SpecdistillError(f"{bad[0][2]}{more}; `specdistill cache{how}` rebuilds the bad shards")


def quarantine(cache_dir: Path, manifest: dict, bad: list[tuple[str, int, str]]) -> None:
    """Move bad shards aside (`.corrupt`) so a rebuild sees them missing, whatever sample it draws."""
    for split, i, _ in bad:
        f = Path(cache_dir) / split / manifest["splits"][split]["shards"][i]["file"]
        if f.exists():
            f.replace(f.with_name(f.name + ".corrupt"))


# ---- checkpoints and exports ----------------------------------------------------------------------------

CHECKSUMS = "SHA256SUMS"  # an export's checksums, in sha256sum's format (`sha256sum -c SHA256SUMS` works too)


def digest_tree(root: Path, skip: tuple[str, ...] = ()) -> dict[str, dict]:
    """{relative path: {bytes, sha256}} of every file under root."""
    root = Path(root)
    out = {}
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = f.relative_to(root).as_posix()
        if rel not in skip:
            d = file_digest(f)
            out[rel] = {"bytes": d["bytes"], "sha256": d["sha256"]}
    return out


def read_complete(step_dir: Path) -> dict | None:
    """The checksums a checkpoint's COMPLETE marker records ({relative path: {bytes, sha256}}), None for an older
    checkpoint whose marker holds only its step."""
    try:
        data = json.loads((Path(step_dir) / "COMPLETE").read_text())
    except (OSError, ValueError):
        return None
    return data.get("files") if isinstance(data, dict) else None


def checkpoint_problems(step_dir: Path, only: tuple[str, ...] | None = None) -> list[str]:
    """One line per bad file of a checkpoint (all files, or `only` those). Optimizer state (ds/) removed by
    train.keep_last is not a problem: every ds/ file gone at once is a thinned checkpoint."""
    step_dir = Path(step_dir)
    files = read_complete(step_dir)
    if files is None:
        return []
    thinned = not (step_dir / "ds").exists()
    bad = []
    for rel, entry in files.items():
        if (only is not None and rel not in only) or (thinned and rel.startswith("ds/")):
            continue
        problem = check_file(step_dir / rel, entry)
        if problem:
            bad.append(problem)
    return bad


def check_checkpoint(step_dir: Path, only: tuple[str, ...] | None = None) -> None:
    bad = checkpoint_problems(step_dir, only)
    if bad:
        more = f" (and {len(bad) - 1} more bad files)" if len(bad) > 1 else ""
        raise SpecdistillError(f"{bad[0]}{more}: checkpoint {Path(step_dir).name} is corrupt; refusing to use it")


def write_checksums(directory: Path) -> None:
    """SHA256SUMS over every file of an export directory (written last)."""
    directory = Path(directory)
    lines = [f"{e['sha256']}  {rel}\n" for rel, e in digest_tree(directory, skip=(CHECKSUMS,)).items()]
    (directory / CHECKSUMS).write_text("".join(lines))


def export_problems(directory: Path) -> list[str]:
    directory = Path(directory)
    sums = directory / CHECKSUMS
    if not sums.is_file():
        return []
    bad = []
    for line in sums.read_text().splitlines():
        digest, rel = line.split("  ", 1)
        f = directory / rel
        if not f.is_file():
            bad.append(f"{f}: missing")
        elif sha256_of(f) != digest:
            bad.append(f"{f}: sha256 differs from {sums.name} (corrupted data)")
    return bad


def check_export(directory: Path, what: str = "") -> None:
    bad = export_problems(directory)
    if bad:
        more = f" (and {len(bad) - 1} more bad files)" if len(bad) > 1 else ""
        raise SpecdistillError(f"{what}{bad[0]}{more}: refusing a corrupt head")
