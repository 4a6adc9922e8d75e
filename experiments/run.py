"""`python -m experiments.run NAME`: run an experiment as pinned in experiments/NAME.yaml and write its record,
experiments/records/NAME.json: the settings (each arm's full recipe), fingerprints, hardware, code version,
results and the table the README renders (`python -m experiments.render`).

Runners: `exactness` (the eval's own batch-invariance check, eval/exactness.py, on the real target in each
arm's runtime: a minute on 2 cores) renders its table itself. `pipeline` (prepare -> cache -> train -> eval
per arm) and `bench` (a `make bench` entry) keep their raw results in the record; their README tables were
transcribed from the sessions that ran them (each record says so in `provenance`), and a rerun records the
raw results beside the transcribed table for a reader to compare.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from experiments.schema import RECORDS, load, pinned_recipe
from specdistill import device, provenance
from specdistill.formats import read_jsonl
from specdistill.recipe import recipe_dump


def run_exactness(exp) -> tuple[dict, list[list]]:
    from specdistill.eval.exactness import verify_rows_match
    from specdistill.eval.prompts import load_prompts
    from specdistill.eval.runtime import make_runtime, parse_runtime
    from specdistill.target import load_target, load_tokenizer

    results, rows = {}, []
    for arm in exp.arms:
        recipe = pinned_recipe(exp, arm)
        name = recipe.eval.runtime
        target = load_target(recipe.target.model_copy(update={"dtype": parse_runtime(name)[1]}))
        runtime = make_runtime(target, name)
        prompt = load_prompts(recipe.eval, load_tokenizer(recipe.target))[0]
        check = verify_rows_match(runtime, prompt.ids, recipe.eval.k_sweep)
        results[arm] = check
        by_k = {c["k"]: c for c in check["checks"]}
        rows.append([f"`{name}`"] + ["yes" if by_k[k]["bitwise_identical"] else "**no**" for k in sorted(by_k)]
                    + [f"{max(c['max_abs_logit_diff'] for c in check['checks']):.3g}"])
    return results, rows


def run_pipeline(exp) -> tuple[dict, None]:
    from specdistill.cli import main as cli

    results = {}
    for arm in exp.arms:
        recipe = pinned_recipe(exp, arm)
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as fh:
            fh.write(json.dumps(recipe_dump(recipe)))
        seconds = {}
        for stage in ("prepare", "cache", "train", "eval"):
            started = time.time()
            if cli([stage, "--recipe", fh.name]) != 0:
                raise SystemExit(f"experiment {exp.name}: arm {arm}: {stage} failed")
            seconds[stage] = round(time.time() - started, 1)
        steps = read_jsonl(recipe.run_dir / "train_log.jsonl")
        results[arm] = {"stage_seconds": seconds,  # a stage another arm already did (a shared cache) is ~0
                        "train_tokens_per_s": statistics.median(s["tokens_per_s"] for s in steps[1:] or steps),
                        "eval": {p.name: json.loads(p.read_text()) for p in sorted((recipe.run_dir / "eval").glob("*.json"))}}
    return results, None


def run_bench(exp) -> tuple[dict, None]:
    done = subprocess.run(exp.command, shell=True, capture_output=True, text=True, check=True)
    return {"stdout": done.stdout[-20000:]}, None


RUNNERS = {"exactness": run_exactness, "pipeline": run_pipeline, "bench": run_bench}


def main(name: str) -> Path:
    exp = load(name)
    started, code_version = time.time(), provenance.git_commit()  # the code as it was when the run started
    results, rows = RUNNERS[exp.runner](exp)
    out = RECORDS / f"{name}.json"
    previous = json.loads(out.read_text()) if out.exists() else None
    record = {
        "experiment": name, "title": exp.title, "command": exp.command,
        "provenance": f"run by `{exp.command}` on {time.strftime('%Y-%m-%d', time.gmtime(started))}",
        "settings": {arm: recipe_dump(pinned_recipe(exp, arm)) for arm in exp.arms},
        "fingerprints": {"decode_code": provenance.code_fingerprint()},
        "hardware": device.hardware(torch.device("cpu")), "code_version": code_version,
        "seconds": round(time.time() - started, 1), "results": results,
        "table": {"columns": exp.columns, "rows": rows} if rows is not None else (previous or {}).get("table"),
    }
    if rows is None and previous is not None:
        record["provenance"] += f"; table kept from the earlier record ({previous['provenance']})"
    RECORDS.mkdir(exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main(sys.argv[1])
