"""Runs inside vLLM's own environment (.venv-vllm, `make setup-vllm`): decode prompts with vLLM, one engine after
another, and write what vLLM itself counted. `specdistill served` (eval/served.py) writes the job and reads the
result; this file imports nothing of specdistill, so that vLLM's pins never meet ours in one interpreter.

  python eval/vllm_worker.py JOB.json RESULT.json

The job names the target, the prompts as token ids (our chat template, applied once by the caller), the
temperatures, max_new_tokens, and the engines: each is a `vllm serve` command line, parsed by vLLM's own
CLI parser (so an export is started exactly as its README tells a user to), plus overrides the caller
states. Per engine, per temperature, per prompt: the tokens, the wall-clock seconds of `LLM.generate`, and the
deltas of vLLM's speculative-decoding counters (drafts, draft tokens, accepted tokens, accepted per position).

Why the offline `LLM` API and not an HTTP server: it builds the same engine from the same arguments, and one
prompt at a time its counters give per-prompt deltas (bootstrap intervals over prompts) with no scraping;
`vllm serve` adds an HTTP hop to the timing that our own engine does not pay.

For an export, every tensor is accounted for (vLLM will not: its EAGLE `load_weights` returns nothing, so its
strict check never runs): before vLLM loads the draft, each parameter is filled with NaN; after the load a
parameter still holding NaN was not loaded (missing), unless vLLM then shares it with the target; each tensor
of the export must reappear, bit for bit after the dtype cast, as a block of rows of some parameter
(otherwise vLLM dropped it: the `.bias` rule, `t2d`).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

# One process: the draft's weights are inspected in the engine, and the frontend needs no core of its own.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")

COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "accepted"}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def counters(llm) -> dict:
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": []}
    for m in llm.get_metrics():
        if m.name in COUNTERS:
            out[COUNTERS[m.name]] += int(m.value)
        elif m.name == PER_POS:
            out["accepted_per_pos"] = [int(v) for v in m.values]
    return out


def delta(after: dict, before: dict) -> dict:
    d = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")}
    pb = before["accepted_per_pos"] or [0] * len(after["accepted_per_pos"])
    d["accepted_per_pos"] = [a - b for a, b in zip(after["accepted_per_pos"], pb)]
    return d


# ------------------------------------------------------------------------------------- tensor accounting

class TensorAudit:
    """Hooks vLLM's default loader for the model loaded from `draft_dir` (module docstring)."""

    def __init__(self, draft_dir: str):
        self.draft_dir = str(Path(draft_dir).resolve())
        self.report: dict | None = None
        self.model = None

    def install(self) -> None:
        from vllm.model_executor.model_loader import default_loader

        original = default_loader.DefaultModelLoader.load_weights
        audit = self

        def load_weights(loader, model, model_config):
            if str(Path(model_config.model).resolve()) != audit.draft_dir:
                return original(loader, model, model_config)
            audit.poison(model)
            result = original(loader, model, model_config)
            audit.report = audit.account(model)
            audit.model = model
            return result

        default_loader.DefaultModelLoader.load_weights = load_weights

    @staticmethod
    def poison(model) -> None:
        import torch

        for p in model.parameters():
            if p.numel():
                p.data.fill_(float("nan") if p.dtype.is_floating_point else -7_777_777)

    @staticmethod
    def unloaded_rows(p) -> int:
        import torch

        if not p.numel():
            return 0
        bad = torch.isnan(p.data) if p.dtype.is_floating_point else p.data == -7_777_777
        return int(bad.reshape(p.shape[0], -1).any(dim=1).sum()) if p.dim() else int(bad)

    def account(self, model) -> dict:
        import torch
        from safetensors import safe_open

        params = dict(model.named_parameters())
        not_loaded = {n: self.unloaded_rows(p) for n, p in params.items()}
        not_loaded = {n: rows for n, rows in not_loaded.items() if rows}
        dropped = []
        for file in sorted(Path(self.draft_dir).glob("*.safetensors")):
            with safe_open(file, "pt") as f:
                for name in f.keys():
                    if not any(self.holds(p, f.get_tensor(name)) for p in params.values()):
                        dropped.append(name)
        return {"params": {n: list(p.shape) for n, p in params.items()}, "not_loaded": not_loaded,
                "dropped": dropped}

    @staticmethod
    def holds(p, t) -> bool:
        """Does parameter p contain tensor t (cast to p's dtype) as a block of consecutive rows?"""
        import torch

        if not p.numel() or p.dim() != t.dim() or tuple(p.shape[1:]) != tuple(t.shape[1:]) or t.shape[0] > p.shape[0]:
            return False
        t = t.to(p.dtype).to(p.device)
        data = p.data
        if t.dim() == 1:  # a vector: all of it (a norm, d2t)
            return t.shape == data.shape and bool(torch.equal(data, t))
        starts = (data == t[0]).all(dim=1).nonzero().flatten().tolist()
        return any(s + t.shape[0] <= data.shape[0] and torch.equal(data[s:s + t.shape[0]], t) for s in starts)

    def shared_after_load(self, llm) -> list[str]:
        """The draft parameters that vLLM replaced by the target's after loading (embed_tokens, lm_head)."""
        if self.model is None:
            return []
        names = []
        for name, p in self.model.named_parameters():
            if p.numel() and name in (self.report or {}).get("not_loaded", {}) and self.unloaded_rows(p) == 0:
                names.append(name)
        return names


# ------------------------------------------------------------------------------ vLLM's CPU expand bug

def check_cpu_expand() -> dict:
    """vllm-cpu 0.32.0's replacement for the Triton `expand_kernel` (vllm/utils/cpu_triton_utils.py
    `_expand_kernel_impl`) casts the output buffer to int64 (a copy, for any other dtype) and writes there, so
    `expand_batch_to_tokens` returns the uninitialised buffer for float32 and int32 inputs. The rejection
    sampler expands the per-request temperature (and top-k, top-p) to draft tokens with it, so at T>0 it
    divides the target's logits by garbage and rejects (almost) every draft, whatever the method. This
    calls vLLM's own function on two requests and says whether it got the right answer."""
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {"checked": False}
    from vllm.v1.sample import rejection_sampler

    current_platform.register_triton_kernel_overrides()  # as vLLM's worker does before serving
    x, cu = torch.tensor([0.5, 2.0]), torch.tensor([2, 3], dtype=torch.int32)
    got = rejection_sampler.expand_batch_to_tokens(x, cu, 3, replace_from=-1, replace_to=1)
    return {"checked": True, "expected": [0.5, 0.5, 2.0], "got": [float(v) for v in got],
            "broken": not torch.equal(got, torch.tensor([0.5, 0.5, 2.0]))}


def patch_cpu_expand() -> None:
    """Expand per-request values to tokens with torch ops (what the Triton kernel computes), in the one module
    that uses it, so that T>0 measures the head rather than the bug; the result records that it was patched."""
    import torch
    from vllm.v1.sample import rejection_sampler

    def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
        x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
        return torch.repeat_interleave(x, counts, output_size=num_tokens)

    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens


# ------------------------------------------------------------------------------------------- the engines

def engine_kwargs(serve_argv: list[str], overrides: dict) -> dict:
    """`vllm serve MODEL --flag ...` read by vLLM's own parser into the keyword arguments of `LLM`."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if serve_argv[:2] != ["vllm", "serve"]:
        raise SystemExit(f"not a `vllm serve` command: {' '.join(serve_argv)[:200]}")
    parser = FlexibleArgumentParser(prog="vllm")  # as the `vllm` command builds it (vllm/entrypoints/cli/main.py)
    serve = ServeSubcommand()
    serve.subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(serve_argv[1:])
    if getattr(args, "model_tag", None):
        args.model = args.model_tag
    engine = EngineArgs.from_cli_args(args)
    defaults = EngineArgs(model=engine.model)
    kwargs = {f.name: getattr(engine, f.name) for f in dataclasses.fields(EngineArgs)
              if f.name == "model" or getattr(engine, f.name) not in (getattr(defaults, f.name), None, "")}
    kwargs.update(overrides)
    return kwargs


def run_engine(spec: dict, job: dict) -> dict:
    from vllm import LLM, SamplingParams

    audit = TensorAudit(spec["export_dir"]) if spec.get("export_dir") else None
    if audit:
        audit.install()
    kwargs = engine_kwargs(spec["serve"], {**job.get("engine_overrides", {}), "disable_log_stats": False})
    started = time.perf_counter()
    llm = LLM(**kwargs)
    out = {"name": spec["name"], "serve": spec["serve"], "engine_kwargs": {k: str(v) for k, v in kwargs.items()},
           "startup_s": time.perf_counter() - started, "runs": []}
    if audit:
        out["tensors"] = {**(audit.report or {"error": "the draft was not loaded through vLLM's default loader"}),
                          "shared_with_target": audit.shared_after_load(llm)}
    prompts = [{"prompt_token_ids": ids} for ids in job["prompts"]]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up, untimed
    for temperature in job["temperatures"]:
        per_prompt = []
        for i, prompt in enumerate(prompts):
            params = SamplingParams(temperature=temperature, max_tokens=job["max_new_tokens"],
                                    seed=job["seed"] + i, ignore_eos=False)
            before = counters(llm)
            t0 = time.perf_counter()
            result = llm.generate([prompt], params, use_tqdm=False)[0]
            seconds = time.perf_counter() - t0
            per_prompt.append({"tokens": list(result.outputs[0].token_ids), "seconds": seconds,
                               **delta(counters(llm), before)})
        out["runs"].append({"temperature": temperature, "prompts": per_prompt})
    if spec.get("top2_gaps"):
        top2_gaps(llm, prompts, job, out["runs"])
    del llm
    return out


def top2_gaps(llm, prompts: list[dict], job: dict, runs: list[dict]) -> None:
    """Plain decoding's T=0 margin at every position (logprob of its top token minus the runner-up's), from one
    more greedy pass with logprobs, untimed: where a speculative run's T=0 output leaves plain's, this gap says
    whether plain's choice was a near tie there. Stored on each T=0 prompt with the pass's own tokens' agreement."""
    from vllm import SamplingParams

    for run in runs:
        if run["temperature"] != 0:
            continue
        params = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"], logprobs=2, ignore_eos=False)
        for prompt, record in zip(prompts, run["prompts"]):
            result = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            gaps = []
            for step in result.logprobs or []:
                best = sorted((lp.logprob for lp in step.values()), reverse=True)
                gaps.append(best[0] - best[1] if len(best) > 1 else None)
            record["top2_gap"] = gaps
            record["top2_pass_same_tokens"] = list(result.token_ids) == record["tokens"]


def main(argv: list[str]) -> int:
    job = json.loads(Path(argv[0]).read_text())
    import vllm

    spec = job["engine"]  # one engine a process: vLLM keeps global state that a second engine would meet
    expand = check_cpu_expand()
    if expand.get("broken") and job.get("patch_cpu_expand", True):
        patch_cpu_expand()
        expand["patched"] = check_cpu_expand()["broken"] is False
    result = {"vllm_version": vllm.__version__, "cpu_expand": expand, **run_engine(spec, job)}
    Path(argv[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":  # vLLM spawns processes that re-import __main__
    sys.exit(main(sys.argv[1:]))
