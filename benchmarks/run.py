"""`make bench`: every benchmark prints ratios against a baseline measured in the same run.

Speed goals live here, not in timed tests. Run one with `make bench ARGS=cache` (cache, train, decode, runtime).
`--toy` runs each at toy size (a few tokens, a step or two): it measures nothing meaningful, it only proves
the benchmark still runs; tests/test_benchmarks.py runs every one of them that way in `make test`.
"""
from __future__ import annotations

import importlib
import sys

BENCHES = {
    "cache": "benchmarks.cache_bench",   # cache throughput / plain forward throughput, bytes per token
    "train": "benchmarks.train_bench",   # training tokens/s per draft kind, 2-process / 1-process
    "decode": "benchmarks.decode_bench", # speculative speedup vs our AR baseline and the comparators
    "runtime": "benchmarks.runtime_bench", # v(M), d, plain decoding per runtime vs eager-fp32
}


def main(argv: list[str]) -> int:
    toy = "--toy" in argv
    chosen = [a for a in argv if a != "--toy"] or list(BENCHES)
    for name in chosen:
        if name not in BENCHES:
            print(f"unknown benchmark {name!r}; choose from {', '.join(BENCHES)}")
            return 2
        print(f"\n=== benchmark: {name}{' (toy size)' if toy else ''} ===", flush=True)
        importlib.import_module(BENCHES[name]).main(toy=toy)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
