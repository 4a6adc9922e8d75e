"""`python -m experiments.run NAME`: run an experiment as pinned in experiments/NAME.yaml and write its record,
experiments/records/NAME.json: the settings (each arm's full recipe), fingerprints, hardware, code version,
results and the table experiments/README.md renders (`python -m experiments.render`).

Runners: `exactness` (the eval's own batch-invariance check, eval/exactness.py, on the real target in each
arm's runtime: a minute on 2 cores) renders its table itself. `pipeline` (the stages of `make distill`
per arm) keeps each arm's raw results (stage times, training tokens/s, eval and served JSONs) and computes its table with
experiments/tables.py where that has a formatter for it (`python -m experiments.run NAME --table` recomputes it
from the record); `bench` (a `make bench` entry) keeps its output. Tables without a formatter were transcribed
from the sessions that ran them (each record says so in `provenance`), and a rerun records the raw results
beside the transcribed table for a reader to compare.
"""
from __future__ import annotations

import importlib
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.run import BENCHES, run_stage
from experiments import tables
from experiments.schema import RECORDS, load, pinned_recipe
from specdistill import device, layout, provenance
from specdistill.eval.exactness import verify_rows_match
from specdistill.eval.prompts import load_prompts
from specdistill.eval.runtime import make_runtime, parse_runtime
from specdistill.formats import read_corpus_summary, read_jsonl
from specdistill.plan import STAGE_ORDER
from specdistill.recipe import recipe_dump
from specdistill.target import load_target, load_tokenizer
from specdistill.train import replay

PIPELINE_STAGES = STAGE_ORDER  # what `make distill` runs
# the decode and hybrid benches read the last checkpoint; the scaling and peer benches run their own stages
BENCH_NEEDS = {"decode": ("prepare", "cache", "train"), "hybrid": ("prepare", "cache", "train"), "runtime": (), "scaling": (), "peer": ()}


def run_exactness(exp) -> tuple[dict, list[list]]:
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


def pinned_file(recipe) -> str:
    """The arm's full recipe as a file the stages and benches read (JSON is YAML)."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as fh:
        fh.write(json.dumps(recipe_dump(recipe)))
    return fh.name


def run_stages(recipe_path: str, stages) -> dict:
    """Each stage in its own process, as `make distill` runs them; the seconds each took."""
    return {stage: run_stage(stage, recipe_path) for stage in stages}


def run_results(run_dir: Path, seconds: dict) -> dict:
    """What a pipeline arm keeps: the stages' seconds, training tokens/s, the plan, every eval, workloads and served
    JSON, and the regenerated corpus's summary."""
    steps = read_jsonl(run_dir / "train_log.jsonl")
    plan = layout.plan_path(run_dir)
    workloads = layout.workloads_results(run_dir)  # in eval/ beside the eval results, kept apart from them
    # tokens/s: the median step of the second half (start-up, compilation and warm caches behind it)
    return {"stage_seconds": seconds,  # a stage another arm already did (a shared cache) is ~0
            "train_tokens_per_s": statistics.median(s["tokens_per_s"] for s in steps[len(steps) // 2:]),
            "plan": json.loads(plan.read_text()) if plan.is_file() else None,
            "eval": {p.name: json.loads(p.read_text()) for p in sorted(layout.eval_dir(run_dir).glob("*.json"))
                     if p not in workloads},
            "workloads": {p.name: json.loads(p.read_text()) for p in workloads},
            "served": {p.name: json.loads(p.read_text()) for p in sorted((run_dir / "served").glob("*.json"))},
            # cache.regenerate: the regenerated corpus's summary (its seconds are inside the cache stage's)
            "regenerated": read_corpus_summary(run_dir / "corpus-regenerated"),
            "replay": replay.summary(run_dir)}  # loss.replay_weight: Draft-OPD's replay (inside the train stage's seconds)


def run_pipeline(exp) -> tuple[dict, list[list] | None]:
    results = {}
    for arm in exp.arms:
        recipe = pinned_recipe(exp, arm)
        results[arm] = run_results(recipe.run_dir, run_stages(pinned_file(recipe), PIPELINE_STAGES))
    return results, tables.ROWS[exp.name](results) if exp.name in tables.ROWS else None


TOOK = re.compile(r"^plan: (\w+) took ([\d.]+) min", re.M)  # specdistill.plan.time_left's line after each stage


def from_run(name: str, run_dir: Path, log: Path | None = None) -> Path:
    """Record an experiment from a run `make distill` made (in a fresh clone, say: `run_dir` is
    <clone>/checkpoints/<run_name>). A pipeline experiment (one arm): its stage times read from the make log's
    time-left lines (0.1 min). A bench experiment: its bench run now on that run's checkpoints, as they are, once
    per arm (arms that change how the bench measures, never what was trained)."""
    exp = load(name)
    recipe = pinned_recipe(exp, next(iter(exp.arms)))  # the arms share the run (its name and what it trained)
    clone = run_dir.resolve().parent.parent
    if run_dir.name != recipe.run_name:
        raise SystemExit(f"{run_dir}: not a run of experiments/{name}.yaml (its run_name is {recipe.run_name})")
    started = time.time()
    if exp.runner == "bench":
        results = {}
        for arm in exp.arms:
            out = importlib.import_module(BENCHES[exp.bench]).run(pinned_file(pinned_recipe(exp, arm)),
                                                                  [f"output_dir={run_dir.resolve().parent}"])
            results[arm] = json.loads(json.dumps(out, default=str))
        seconds = round(time.time() - started, 1)
        made_by = f"`{exp.bench}` bench on the checkpoints of `make distill`"
    else:
        if log is None:
            raise SystemExit(f"{name}: a pipeline experiment is recorded from a run and its make log (MAKE_LOG)")
        stage_seconds = {stage: round(float(m) * 60, 1) for stage, m in TOOK.findall(log.read_text())}
        if set(stage_seconds) != set(PIPELINE_STAGES):
            raise SystemExit(f"{log}: time-left lines for {sorted(stage_seconds)}, expected every stage of {PIPELINE_STAGES}")
        results, seconds = {"main": run_results(run_dir, stage_seconds)}, round(sum(stage_seconds.values()), 1)
        made_by, started = "`make distill`", log.stat().st_mtime
    made = provenance.git_commit(root=clone)
    ran = provenance.git_commit() if exp.runner == "bench" else made  # a bench runs this checkout's code
    record = {"experiment": name, "title": exp.title, "command": exp.command,
              "provenance": f"recorded from {made_by} in a fresh clone of {made} ({run_dir.name}), "
                            f"{time.strftime('%Y-%m-%d', time.gmtime(started))}"
                            + (f"; the bench ran at {ran}" if ran != made else ""),
              "settings": {arm: recipe_dump(pinned_recipe(exp, arm)) for arm in exp.arms},
              "fingerprints": {"decode_code": provenance.code_fingerprint(root=provenance.REPO_ROOT if exp.runner == "bench" else clone)},
              "hardware": device.hardware(torch.device("cpu")), "code_version": ran,
              "seconds": seconds, "results": results,
              "table": {"columns": exp.columns, "rows": tables.ROWS[name](results)}}
    return write_record(RECORDS / f"{name}.json", record)


def run_bench(exp) -> tuple[dict, list[list] | None]:
    """The `make bench` entry `exp.bench` on each arm's pinned recipe, after the stages it reads from disk; the
    table computed from its output where experiments/tables.py has a formatter for it."""
    results = {}
    for arm in exp.arms:
        path = pinned_file(pinned_recipe(exp, arm))
        run_stages(path, BENCH_NEEDS[exp.bench])
        out = importlib.import_module(BENCHES[exp.bench]).run(path)
        results[arm] = json.loads(json.dumps(out, default=str))
    return results, tables.ROWS[exp.name](results) if exp.name in tables.ROWS else None


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
    return write_record(out, record)


def write_record(out: Path, record: dict) -> Path:
    RECORDS.mkdir(exist_ok=True)
    out.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {out}")
    return out


def retable(name: str) -> Path:
    """Recompute a record's table from the results it holds (a formatter changed; nothing is run)."""
    exp, out = load(name), RECORDS / f"{name}.json"
    record = json.loads(out.read_text())
    if name not in tables.ROWS:
        raise SystemExit(f"{out}: its table was transcribed, not computed (experiments/tables.py has no {name!r})")
    record["table"] = {"columns": exp.columns, "rows": tables.ROWS[name](record["results"])}
    return write_record(out, record)


if __name__ == "__main__":
    if sys.argv[2:3] == ["--from-run"]:  # NAME --from-run RUN_DIR [MAKE_LOG]
        from_run(sys.argv[1], Path(sys.argv[3]), Path(sys.argv[4]) if sys.argv[4:] else None)
    else:
        retable(sys.argv[1]) if sys.argv[2:] == ["--table"] else main(sys.argv[1])
