"""`make bench`: every benchmark prints ratios against a baseline measured in the same run.

Speed goals live here, not in timed tests. Run one with `make bench ARGS=cache` (cache, regenerate, train, decode, hybrid, runtime;
a `*.yaml` word is the recipe and `section.key=value` words are its overrides, for the benches that take them: decode,
hybrid, e.g. `make bench ARGS="hybrid run_name=smollm2-135m-eagle3 eval.num_prompts=8"`;
`make bench ARGS="scaling [--fractions ...] [overrides]"` and
`make bench ARGS="peer [--toy] [overrides]"` only when named). After each, its peak memory
(device.peak_memory: this process's resident set, and the GPU's on CUDA).
`--toy` runs each at toy size (a few tokens, a step or two): it measures nothing meaningful, it only proves
the benchmark still runs; tests/test_benchmarks.py runs every one of them that way in `make test`.
"""
from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
import time

from specdistill import device
from specdistill.errors import SpecdistillError

BENCHES = {
    "cache": "benchmarks.cache_bench",   # cache throughput / plain forward throughput, bytes per token
    "regenerate": "benchmarks.regenerate_bench",  # regeneration (transformers, vLLM) / cache pass tokens/s
    "train": "benchmarks.train_bench",   # training tokens/s per draft kind, 2-process / 1-process
    "decode": "benchmarks.decode_bench", # speculative speedup vs our AR baseline and the comparators
    "hybrid": "benchmarks.hybrid_bench", # head / prompt lookup / their hybrid per workload, vs plain decoding
    "runtime": "benchmarks.runtime_bench", # v(M), d, plain decoding per runtime vs eager-fp32
    "scaling": "benchmarks.scaling_bench", # complete runs at several data sizes: tau against tokens (hours)
    "peer": "benchmarks.peer_bench",       # our EAGLE-3 trainer vs vllm-project/speculators' on the same data
}
LONG = {"scaling", "peer"}  # run only when named; it takes its own arguments (the rest of the line)


def run_stage(stage: str, recipe_path: str, overrides=()) -> float:
    """One pipeline stage in its own process, as `make distill` runs it (one process holding several runs'
    stages grew past 10 GB); the seconds it took. Stops with the stage named if it fails."""
    started = time.time()
    cmd = [sys.executable, "-m", "specdistill.cli", stage, "--recipe", recipe_path, *overrides]
    if subprocess.run(cmd).returncode != 0:
        raise SystemExit(f"{stage} failed: {' '.join(cmd[2:])}")
    return round(time.time() - started, 1)


def main(argv: list[str]) -> int:
    if argv and argv[0] in LONG:
        importlib.import_module(BENCHES[argv[0]]).main(argv[1:])
        return 0
    toy = "--toy" in argv
    recipe = [a for a in argv if a.endswith((".yaml", ".yml"))]
    overrides = [a for a in argv if "=" in a and a not in recipe]
    chosen = [a for a in argv if a != "--toy" and a not in recipe and a not in overrides] or \
        [b for b in BENCHES if b not in LONG]
    where = device.resolve("auto")
    peaks = {}
    for name in chosen:
        if name not in BENCHES:
            print(f"unknown benchmark {name!r}; choose from {', '.join(BENCHES)}")
            return 2
    mains = {name: importlib.import_module(BENCHES[name]).main for name in chosen}
    takes = {name: "overrides" in inspect.signature(m).parameters for name, m in mains.items()}
    if recipe or overrides:
        refused = [name for name in chosen if not takes[name]]
        if refused:
            print(f"benchmark {', '.join(refused)} takes no recipe or overrides ({' '.join(recipe + overrides)})")
            return 2
    for name in chosen:
        print(f"\n=== benchmark: {name}{' (toy size)' if toy else ''} ===", flush=True)
        device.reset_peak_memory(where)
        kwargs = {"overrides": overrides, **({"recipe_path": recipe[0]} if recipe else {})} if takes[name] else {}
        try:
            mains[name](toy=toy, **kwargs)
        except SpecdistillError as e:
            print(f"error: {e}")
            return 1
        peaks[name] = device.peak_memory(where)
        print(f"peak memory of benchmark {name}: " + ", ".join(f"{k} {v}" for k, v in peaks[name].items()), flush=True)
    if len(peaks) > 1:
        print("\npeak memory per benchmark (" + str(where) + "; processes a benchmark starts are not counted):")
        for name, peak in peaks.items():
            print(f"  {name:8s} " + ", ".join(f"{k} {v}" for k, v in peak.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
