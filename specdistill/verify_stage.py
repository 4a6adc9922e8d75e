"""`specdistill verify --recipe R [--full]`: check a run's cache, checkpoints and exports against the
checksums written with them (specdistill/integrity.py), print one line per bad file, and fail if any.

The cache is checked as `cache.verify: sample` does (sizes, safetensors headers, a random share of the
data; all of a cache under 256 MiB), or every byte with --full; checkpoints (their COMPLETE marker's
checksums, optimizer state included) and exports (SHA256SUMS) are always hashed in full.
`specdistill cache` rebuilds bad shards; a bad checkpoint or export is deleted and made again.
"""
from __future__ import annotations

import time
from pathlib import Path

from specdistill import integrity, layout
from specdistill.errors import SpecdistillError
from specdistill.formats import read_manifest


def run(recipe, args=None) -> list[str]:
    t0 = time.time()
    run_dir = recipe.run_dir
    mode = "full" if getattr(args, "full", False) else "sample"
    bad, seen = [], []
    cache = layout.cache_dir(run_dir)
    manifest = read_manifest(cache) if cache.exists() else None
    if manifest is not None:
        shards = [sh for info in manifest["splits"].values() for sh in info["shards"]]
        size = sum(sh["bytes"] for sh in shards)
        bad += [line for _, _, line in integrity.cache_problems(cache, manifest, mode)]
        seen.append(f"cache ({len(shards)} shards, {size / 2**30:.3f} GiB, {mode})"
                    + ("" if manifest.get("complete") else ", incomplete"))
    steps = sorted(p for p in run_dir.glob("step-*") if layout.STEP_DIR.match(p.name) and (p / "COMPLETE").exists())
    unrecorded = []
    for step_dir in steps:
        if integrity.read_complete(step_dir) is None:
            unrecorded.append(step_dir.name)
        bad += integrity.checkpoint_problems(step_dir)
    seen.append(f"{len(steps)} checkpoints" + (f" ({len(unrecorded)} written before checksums: "
                                                f"{', '.join(unrecorded)}, not checked)" if unrecorded else ""))
    exports = sorted(d for d in (run_dir / "export").glob("*") if d.is_dir() and not d.name.startswith("."))
    for d in exports:
        bad += integrity.export_problems(d)
    seen.append(f"{len(exports)} exports")
    for line in bad:
        print(f"BAD {line}", flush=True)
    summary = f"verified {run_dir}: " + ", ".join(seen) + f" in {time.time() - t0:.1f} s"
    if bad:
        raise SpecdistillError(f"{summary}: {len(bad)} bad files (listed above)")
    print(summary + ": all good", flush=True)
    return bad
