"""`specdistill served`: serve every export of a run with vLLM, measure acceptance there, and gate on parity.

The heads are made for vLLM, so the number that counts is the one vLLM measures. For the checkpoint that was
exported, this stage decodes the eval's prompts (the same chat-templated ids, max_new_tokens, temperatures)
with vLLM, one engine at a time, each in its own process of vLLM's environment (eval/vllm_worker.py):

  plain           `vllm serve TARGET`: vLLM's own plain decoding, the baseline of every served speedup
  <format>        each export, started by the `vllm serve` command its README gives a user
  ngram, suffix   vLLM's training-free methods at the same K (suffix needs the arctic-inference package)

Served tau and alpha come from vLLM's own counters (drafts, accepted tokens, accepted per position), in the
definitions of docs (metrics): tau = tokens / verification steps, alpha_at[i] = accepted at depth i / reached
depth i. They are set beside what `specdistill eval` measured with our engine for the same checkpoint and K.
Parity is a gate: a head is fit to deploy when every draft tensor was loaded (vLLM does not check this
itself), vLLM's speculative output equals vLLM's plain output at T=0, and at every temperature the interval of
served tau minus ours, prompts resampled in pairs (the same prompts decoded by both), holds 0: a 97.5% interval
for each of two temperatures (GATE_ERROR shared out, so a head at parity fails in at most 5% of runs).
An older eval result without per-prompt counts falls back to served tau inside our interval: a test of one
point against one interval, which a drafter identical in both fails by chance (a 0.002 miss happened).
The verdict goes into served/<checkpoint>.json, the export's
README and report.md.

Writes checkpoints/<run>/served/<checkpoint>.json (+ one vLLM log per engine).
"""
from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path

from specdistill import device, formats, integrity, kinds, layout
from specdistill.errors import SpecdistillError
from specdistill.eval.prompts import load_prompts
from specdistill.eval.results import read_result
from specdistill.eval.runtime_names import parse_runtime, resolve_runtime_name
from specdistill.eval.served_tables import SERVED_NOTE, served_note, served_summary
from specdistill.eval.summary import interval, resamples
from specdistill.processes import last_error
from specdistill.target import load_tokenizer, resolve_target
from specdistill.vllm_env import INSTALL_HINT, run_script, vllm_python

WORKER = Path(__file__).with_name("vllm_worker.py")
TAU_PARITY = 0.05  # issue 35's goal: served tau at T=0 within 0.05 of ours
ALPHA_PARITY = 0.03  # ... and alpha per position within 0.03
# vLLM ignores this tensor by design (llama_eagle3.py: `if "t2d" in name: continue`); it is written for SGLang
KNOWN_IGNORED = {"t2d"}
GATE_ERROR = 0.05  # the parity gate's false-failure rate for a head at parity, over all its temperatures together


# ------------------------------------------------------------------------------------------------ vLLM

def readme_serve_command(export_dir: Path) -> list[str]:
    """The `vllm serve ...` line of an export's README: what a user runs, and so what is measured."""
    readme = Path(export_dir) / "README.md"
    if not readme.is_file():
        raise SpecdistillError(f"{readme}: missing; rerun `specdistill export`")
    for line in readme.read_text().splitlines():
        if line.startswith("vllm serve "):
            return shlex.split(line)
    raise SpecdistillError(f"{readme}: no `vllm serve` line; rerun `specdistill export`")


def engines(recipe, step_dir: Path, target: str, k: int) -> list[dict]:
    """What to serve: vLLM plain, every export of this checkpoint, and vLLM's training-free methods at K."""
    out = [{"name": "plain", "serve": ["vllm", "serve", target], "top2_gaps": True}]
    kind = kinds.kind(formats.read_draft_config(step_dir)["kind"])
    for fmt in kind.EXPORT_FORMATS:
        export_dir = layout.export_dir(recipe.run_dir, fmt)
        if (export_dir / "README.md").is_file() and exported_step(export_dir) == step_dir.name:
            out.append({"name": fmt, "serve": readme_serve_command(export_dir), "export_dir": str(export_dir),
                        "format": fmt})
    for method in recipe.served.methods:
        spec = {"method": method, "num_speculative_tokens": k, **recipe.served.method_args.get(method, {})}
        out.append({"name": method, "serve": ["vllm", "serve", target, "--speculative-config", json.dumps(spec)]})
    return out


def exported_step(export_dir: Path) -> str | None:
    """Which checkpoint an export holds (its README's title line: `# <run> / <checkpoint> — <format>`)."""
    first = (Path(export_dir) / "README.md").read_text().splitlines()[:1]
    parts = first[0].split(" / ", 1) if first else []
    return parts[1].split(" ", 1)[0] if len(parts) == 2 else None


def exported_k(recipe, step_dir: Path) -> int:
    """The K the exports' serve commands give (export.num_speculative_tokens or eval's measured best K)."""
    ks = set()
    for fmt in kinds.kind(formats.read_draft_config(step_dir)["kind"]).EXPORT_FORMATS:
        d = layout.export_dir(recipe.run_dir, fmt)
        if (d / "README.md").is_file():
            argv = readme_serve_command(d)
            spec = json.loads(argv[argv.index("--speculative-config") + 1])
            ks.add(int(spec["num_speculative_tokens"]))
    if len(ks) != 1:
        raise SpecdistillError(f"{recipe.run_dir}/export: the exports' serve commands give K = {sorted(ks)}; "
                               "export every format again")
    return ks.pop()


def run_engine(python: Path, engine: dict, job: dict, out_dir: Path, timeout_s: int) -> dict:
    """One engine in one process of vLLM's environment; its log kept beside the result."""
    job_file, result_file, log = (out_dir / f"{engine['name']}.{ext}" for ext in ("job.json", "result.json", "log"))
    formats.write_json_atomic(job_file, {**job, "engine": engine})
    result_file.unlink(missing_ok=True)
    rc, wall = run_script(python, WORKER, [str(job_file), str(result_file)], log, timeout_s)
    if rc != 0 or not result_file.exists():
        return {"name": engine["name"], "serve": engine["serve"], "error": f"vLLM exited {rc} after {wall:.0f} s: "
                f"{last_error(log)} (log: {log})", "wall_s": wall}
    return {**json.loads(result_file.read_text()), "wall_s": wall}


# ---------------------------------------------------------------------------------------------- numbers

def served_counts(prompts: list[dict]) -> dict:
    """Pooled over prompts, in docs/METRICS.md's definitions. tau = 1 + accepted / drafting steps: our engine's
    tokens / steps is exactly that (each step commits 1 + its accepted drafts), while vLLM's prefill commits a
    first token without drafting, so its tokens / drafts would count one free token per prompt. Accepted means
    emitted: vLLM's counters also count drafts its last step accepted past max_tokens, which it then cuts (seen on
    5 of 16 prompts, 1-2 tokens each, +0.02 tau); ours stops at max_new_tokens. So a prompt's accepted tokens are
    at most its tokens - 1 - drafts (`accepted_past_end` keeps the difference); alpha stays the counters'.
    alpha_at[i] = accepted at depth i / drafts that reached depth i (accepted at depth i-1)."""
    tokens = sum(len(p["tokens"]) for p in prompts)
    counted = [sum(p["accepted_per_pos"]) for p in prompts]
    emitted = [min(n, max(0, len(p["tokens"]) - 1 - p["drafts"])) for n, p in zip(counted, prompts)]
    seconds = sum(p["seconds"] for p in prompts)
    drafts = sum(p["drafts"] for p in prompts)
    depth = max((len(p["accepted_per_pos"]) for p in prompts), default=0)
    acc = [sum(p["accepted_per_pos"][i] for p in prompts if i < len(p["accepted_per_pos"])) for i in range(depth)]
    reached = [drafts] + acc[:-1]
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds if seconds else 0.0,
            "steps": drafts, "tau": 1 + sum(emitted) / drafts if drafts else None,  # vLLM's "mean acceptance length",
            "accepted_past_end": sum(counted) - sum(emitted),  # ... less what it accepted past max_tokens
            "alpha": sum(acc) / sum(reached) if drafts else None,
            "alpha_at": [a / r if r else 0.0 for a, r in zip(acc, reached)], "accepted_at": acc}


def bootstrap(prompts: list[dict], base: list[dict] | None, ours: list[dict] | None = None,
              gate_level: float = 0.95) -> dict:
    """95% percentile intervals over prompts (the eval's resamples: pooled as the point estimates). With `ours`
    (our eval's per_prompt at the same K: tokens, steps; the same prompts in the same order), `tau_gap_ci95`: the
    interval of served tau - ours, prompt i of both resampled together, so what a prompt makes easy or hard
    cancels and the interval is of the difference, not of either alone."""
    taus, alphas, speedups, gaps = [], [], [], []
    for idx in (resamples(len(prompts)) if prompts else []):
        c = served_counts([prompts[i] for i in idx])
        if c["tau"] is not None:
            taus.append(c["tau"])
            alphas.append(c["alpha_at"])
            steps = sum(ours[i]["steps"] for i in idx) if ours else 0
            if steps:
                gaps.append(c["tau"] - sum(ours[i]["tokens"] for i in idx) / steps)
        if base:
            b = served_counts([base[i] for i in idx])
            if b["tokens_per_s"]:
                speedups.append(c["tokens_per_s"] / b["tokens_per_s"])
    depth = min((len(a) for a in alphas), default=0)
    out = {"tau_ci95": interval(taus) if taus else None, "speedup_ci95": interval(speedups) if speedups else None,
           "alpha_at_ci95": [interval([a[i] for a in alphas]) for i in range(depth)]}
    if gaps:
        out["tau_gap_ci95"] = interval(gaps)
        out["tau_gap_ci_gate"] = interval(gaps, gate_level)  # what the parity gate tests (compare: GATE_ERROR)
    return out


def ours_at(result: dict | None, temperature: float, k: int) -> dict | None:
    """`specdistill eval`'s numbers for this checkpoint at T and K (alpha per depth only where K was its main K)."""
    for r in (result or {}).get("results", []):
        if float(r["temperature"]) == float(temperature):
            tau = (r.get("tau_by_k") or {}).get(str(k))
            ci = ((r.get("ci95_by_k") or {}).get(str(k)) or {}).get("tau_ci95")
            if tau is None:
                return None
            main = int(result.get("k", -1)) == k  # alpha per depth and per-prompt counts are the main K's
            return {"tau": tau, "tau_ci95": ci, "alpha_at": r.get("alpha_at") if main else None,
                    "per_prompt": r.get("per_prompt") if main else None,
                    "speedup": (r.get("speedup_by_k") or {}).get(str(k)), "lossless": r.get("lossless"),
                    # our engine's speed beside vLLM's (the fastest plain decoding may be vLLM's own)
                    "plain_tokens_per_s": r.get("baseline_tokens_per_s")}
    return None


def compare(engine: dict, plain: dict | None, ours: dict | None, k: int) -> dict:
    """Per temperature: served numbers, their intervals, lossless against vLLM plain, parity with ours."""
    rows = []
    plain_runs = {r["temperature"]: r["prompts"] for r in (plain or {}).get("runs", [])}
    # one parity test per temperature: each at GATE_ERROR / n, so that a head at parity fails the gate by chance in
    # at most GATE_ERROR of runs, not in up to n times that (Bonferroni)
    gate_level = 1 - GATE_ERROR / max(1, len(engine.get("runs", [])))
    for run in engine.get("runs", []):
        t, prompts = run["temperature"], run["prompts"]
        base = plain_runs.get(t)
        c = served_counts(prompts)
        o = ours_at(ours, t, k) if ours is not None else None
        paired = (o or {}).pop("per_prompt", None)
        paired = paired if paired and len(paired) == len(prompts) else None
        row = {"temperature": t, **c, **bootstrap(prompts, base, paired, gate_level)}
        if base:
            b = served_counts(base)
            row["plain_tokens_per_s"] = b["tokens_per_s"]
            row["speedup"] = c["tokens_per_s"] / b["tokens_per_s"] if b["tokens_per_s"] else None
            if t == 0:  # vLLM's own losslessness: its speculative output is its plain output
                row["lossless"] = all(p["tokens"] == q["tokens"] for p, q in zip(prompts, base))
                row["divergences"] = divergences(prompts, base)
        if o is not None and c["tau"] is not None:
            row["ours"] = o
            row["tau_gap"] = c["tau"] - o["tau"]
            if "tau_gap_ci_gate" in row:
                row["gate_level"] = gate_level
                row["tau_parity"] = row["tau_gap_ci_gate"][0] <= 0.0 <= row["tau_gap_ci_gate"][1]
            else:  # an eval result without per-prompt counts at this K: served tau inside our interval
                row["tau_parity"] = bool(o["tau_ci95"] and o["tau_ci95"][0] <= c["tau"] <= o["tau_ci95"][1])
            if o["alpha_at"]:
                gaps = [a - b for a, b in zip(c["alpha_at"], o["alpha_at"])]
                row["alpha_at_gap"] = gaps
        rows.append(row)
    return {"name": engine["name"], "serve": " ".join(shlex.quote(a) for a in engine["serve"]),
            "startup_s": engine.get("startup_s"), "wall_s": engine.get("wall_s"), "tensors": engine.get("tensors"),
            "error": engine.get("error"), "results": rows}


def divergences(prompts: list[dict], base: list[dict]) -> list[dict]:
    """Where a T=0 speculative output leaves vLLM's plain output: per prompt, the first differing position and
    plain's top-2 logprob gap there (None where the plain engine recorded none)."""
    out = []
    for i, (p, q) in enumerate(zip(prompts, base)):
        if p["tokens"] != q["tokens"]:
            at = next((j for j, (a, b) in enumerate(zip(p["tokens"], q["tokens"])) if a != b),
                      min(len(p["tokens"]), len(q["tokens"])))
            gaps = q.get("top2_gap") or []
            out.append({"prompt": i, "at": at, "plain_top2_gap": gaps[at] if at < len(gaps) else None})
    return out


def headless_divergence(headless: list[dict], temperature: float) -> list[str]:
    """vLLM's training-free methods (no head of ours: ngram, suffix) whose output also left vLLM's plain output
    at this temperature in the same run. A divergence they share is vLLM's own (its verify of several tokens
    against its decode of one), not the head's: at T=0 a draft only decides which positions are verified
    together, never which token the target emits."""
    return [e["name"] for e in headless for r in e.get("results", [])
            if r["temperature"] == temperature and r.get("lossless") is False]


def verdict(entry: dict, headless: list[dict] = ()) -> tuple[bool, list[str]]:
    """(fit to deploy, the reasons it is not): tensors, T=0 losslessness, tau parity at every temperature.
    A T=0 divergence that vLLM's headless methods share in the same run is vLLM's and no reason
    (`vllm_own_divergence` says so beside the verdict)."""
    why = []
    if entry.get("error"):
        return False, [f"vLLM could not serve it: {entry['error']}"]
    tensors = entry.get("tensors") or {}
    missing = sorted(set(tensors.get("not_loaded", {})) - set(tensors.get("shared_with_target", [])))
    if missing:
        why.append(f"vLLM left {len(missing)} draft parameter(s) unloaded (random memory at serve time): "
                   f"{', '.join(missing[:4])}")
    dropped = [n for n in tensors.get("dropped", []) if n not in KNOWN_IGNORED]
    if dropped:
        why.append(f"vLLM dropped {len(dropped)} exported tensor(s) silently: {', '.join(dropped[:4])}")
    for r in entry["results"]:
        if r.get("lossless") is False and not headless_divergence(headless, r["temperature"]):
            why.append(f"T={r['temperature']:g}: vLLM's speculative output differs from vLLM's plain output")
        if r.get("tau_parity", r.get("tau_inside_ours")) is False:  # tau_inside_ours: records before the pairing
            ci, gap = r["ours"]["tau_ci95"], r.get("tau_gap_ci_gate", r.get("tau_gap_ci95"))  # ci95: older records
            level = f"{100 * r.get('gate_level', 0.95):g}% "
            why.append(f"T={r['temperature']:g}: served tau {r['tau']:.3f} against ours {r['ours']['tau']:.3f}: "
                       f"the gap's {level}interval [{gap[0]:+.3f}, {gap[1]:+.3f}] (prompts paired) leaves 0" if gap else
                       f"T={r['temperature']:g}: served tau {r['tau']:.3f} outside ours {r['ours']['tau']:.3f} "
                       f"[{ci[0]:.3f}, {ci[1]:.3f}]" if ci else f"T={r['temperature']:g}: no interval of ours")
        if "ours" not in r:
            why.append(f"T={r['temperature']:g}: no `specdistill eval` result of ours at this K to compare with")
    return not why, why


def vllm_own_divergence(entry: dict, headless: list[dict]) -> str | None:
    """The T=0 divergence of this export that is vLLM's own (shared by its headless methods), in one line."""
    for r in entry.get("results", []):
        shared = headless_divergence(headless, r["temperature"]) if r.get("lossless") is False else []
        if shared:
            found = r.get("divergences")  # absent in records made before it was kept
            gaps = [d["plain_top2_gap"] for d in found or [] if d["plain_top2_gap"] is not None]
            where = f" at {len(found)} prompt(s)" if found is not None else ""
            return (f"T={r['temperature']:g}: vLLM's speculative output left its plain output{where}, and so did "
                    f"{', '.join(shared)} with no head of ours: vLLM's own, not the head's"
                    + (f" (plain's top-2 logprob gap there at most {max(gaps):.3f})" if gaps else ""))
    return None


# ------------------------------------------------------------------------------------------------- run

def served_path(run_dir: Path, checkpoint: str) -> Path:
    return layout.served_dir(run_dir) / f"{checkpoint}.json"


def read_served(run_dir: Path, checkpoint: str) -> dict | None:
    path = served_path(run_dir, checkpoint)
    return formats.read_json(path) if path.exists() else None


def exported_checkpoint(recipe) -> Path:
    """The checkpoint the run's exports hold (all of them hold one: the export stage writes one checkpoint)."""
    found = set()
    for fmt in kinds.export_formats():
        d = layout.export_dir(recipe.run_dir, fmt)
        if (d / "README.md").is_file():
            found.add(exported_step(d))
    found.discard(None)
    if not found:
        raise SpecdistillError(f"{recipe.run_dir}/export: no export to serve; run `specdistill export` first")
    if len(found) > 1:
        raise SpecdistillError(f"{recipe.run_dir}/export: exports of several checkpoints ({', '.join(sorted(found))}); "
                               "export one checkpoint in every format")
    return recipe.run_dir / found.pop()


def run(recipe, args) -> None:
    if not recipe.served.enabled:
        print("served: skipped (served.enabled: false)")
        return
    python = vllm_python(recipe.served.python, "served")
    step_dir = exported_checkpoint(recipe)
    k = exported_k(recipe, step_dir)
    target = resolve_target(recipe.target)
    prompts = load_prompts(recipe.eval, load_tokenizer(recipe.target))
    temperatures = recipe.eval.temperature if isinstance(recipe.eval.temperature, list) else [recipe.eval.temperature]
    ours = read_result(recipe, step_dir.name)
    dtype = served_dtype(recipe, ours, target)
    job = {"prompts": [p.ids for p in prompts], "temperatures": [float(t) for t in temperatures],
           "max_new_tokens": recipe.eval.max_new_tokens, "seed": recipe.eval.seed,
           "engine_overrides": {"dtype": dtype, "max_model_len": recipe.served.max_model_len,
                                "seed": recipe.eval.seed, **recipe.served.engine_args}}
    out_dir = layout.served_dir(recipe.run_dir) / step_dir.name
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    raw = {}
    for engine in engines(recipe, step_dir, target, k):
        print(f"served: {engine['name']}: {' '.join(engine['serve'])}", flush=True)
        raw[engine["name"]] = run_engine(python, engine, job, out_dir, recipe.served.timeout_s)
        if raw[engine["name"]].get("error"):
            if engine["name"] == "plain":  # vLLM cannot decode the target at all: nothing else would run either
                raise SpecdistillError(f"served: vLLM at {python} could not decode the target: "
                                       f"{raw['plain']['error']}; {INSTALL_HINT}")
            print(f"served: {engine['name']}: {raw[engine['name']]['error']}", file=sys.stderr)
    plain = raw.pop("plain")
    entries = [compare(e, plain, ours if e["name"] in kinds.export_formats() else None, k) for e in raw.values()]
    headless = [e for e in entries if e["name"] in recipe.served.methods]
    for e in entries:
        if e["name"] in kinds.export_formats():
            e["fit_to_deploy"], e["not_fit_because"] = verdict(e, headless)
            e["vllm_own_divergence"] = vllm_own_divergence(e, headless)
    record = {"checkpoint": step_dir.name, "k": k, "target": target, "prompts": recipe.eval.prompts,
              "num_prompts": len(prompts), "max_new_tokens": recipe.eval.max_new_tokens,
              "vllm_version": plain.get("vllm_version"), "vllm_cpu_expand": plain.get("cpu_expand"),
              "plain": compare(plain, plain, None, k),
              "engines": entries, "ours_file": (ours or {}).get("_file"),
              "settings": {"dtype": dtype, "engine_args": recipe.served.engine_args,
                           "method_args": recipe.served.method_args},
              "hardware": hardware(), "wall_s": time.perf_counter() - started}
    formats.write_json_atomic(served_path(recipe.run_dir, step_dir.name), record)
    for e in entries:
        if e.get("fit_to_deploy") is not None:
            write_served_note(recipe, record, e)
    print(served_summary(record))
    print(f"served: wrote {served_path(recipe.run_dir, step_dir.name)} in {record['wall_s'] / 60:.1f} min")


def served_dtype(recipe, ours: dict | None, target: str) -> str:
    """served.dtype, else the dtype our eval decoded in (its result's runtime; else eval.runtime resolved)."""
    if recipe.served.dtype:
        return recipe.served.dtype
    if ours and ours.get("runtime"):
        return parse_runtime(ours["runtime"])[1]
    from transformers import AutoConfig

    return parse_runtime(resolve_runtime_name(recipe.eval.runtime, AutoConfig.from_pretrained(target)))[1]


def hardware() -> dict:
    return {"cpu": device.cpu_name(), "cpu_isa": device.cpu_isa(), "cores": os.cpu_count()}


def write_served_note(recipe, record: dict, entry: dict) -> None:
    """SERVED.md in the export: what vLLM measured of this very directory, and whether it is fit to deploy
    (the export's README points at it); the export's checksums then cover it."""
    out = layout.export_dir(recipe.run_dir, entry["name"])
    formats.write_text_atomic(out / SERVED_NOTE, served_note(record, entry))
    integrity.write_checksums(out)
