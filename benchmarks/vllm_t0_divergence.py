"""A minimal reproduction, vLLM only: at T=0, is vLLM's speculative output its plain output?

Run with vLLM's interpreter (nothing of specdistill is imported), on any target directory:

  .venv-vllm/bin/python benchmarks/vllm_t0_divergence.py TARGET_DIR [--dtype bfloat16] [--out result.json]

It decodes the same chat prompts greedily with `LLM(TARGET)` and with `LLM(TARGET, speculative_config=ngram)` (no
draft model: vLLM's own prompt lookup), each engine in its own process, and prints per prompt whether the tokens
are equal and, where they are not, the first differing position with plain decoding's top-2 logprob gap there.
At T=0 a speculative method is lossless only if the target's verify of several tokens picks the token its
decode of one picks; in bfloat16 the two computations may round differently and break a near tie.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")

PROMPTS = [
    "Explain how a hash map works.", "Write a short poem about the sea.", "What causes the seasons on Earth?",
    "Give three tips for learning a new language.", "Summarise the plot of Romeo and Juliet.",
    "How do vaccines train the immune system?", "Write a Python function that reverses a string.",
    "What is the difference between weather and climate?", "Describe a good morning routine.",
    "Why is the sky blue?", "Explain recursion to a ten-year-old.", "List the planets of the solar system.",
    "What makes a good password?", "How does a bicycle stay upright?", "Write an email declining a meeting.",
    "What is photosynthesis?",
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def decode(target: str, dtype: str, speculative: bool, max_tokens: int) -> list[dict]:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(target)
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in PROMPTS]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    llm = LLM(target, dtype=dtype, max_model_len=1024, seed=0,
              speculative_config=NGRAM if speculative else None)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2)
    out = []
    for prompt in ids:  # one prompt at a time: no batching effect of vLLM's scheduler
        o = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        gaps = [sorted((lp.logprob for lp in step.values()), reverse=True) for step in o.logprobs]
        out.append({"tokens": list(o.token_ids), "top2_gap": [g[0] - g[1] if len(g) > 1 else None for g in gaps]})
    return out


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("target")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=None, help="write the comparison as JSON here")
    ap.add_argument("--engine", choices=["plain", "ngram"], help=argparse.SUPPRESS)  # the child process
    ap.add_argument("--engine-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.engine:
        with open(args.engine_out, "w") as f:
            json.dump(decode(args.target, args.dtype, args.engine == "ngram", args.max_tokens), f)
        return 0
    runs = {}
    for engine in ("plain", "ngram"):  # one engine a process: vLLM keeps global state
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            subprocess.run([sys.executable, __file__, args.target, "--dtype", args.dtype, "--max-tokens",
                            str(args.max_tokens), "--engine", engine, "--engine-out", f.name], check=True)
            runs[engine] = json.load(open(f.name))
    rows = []
    for i, (plain, spec) in enumerate(zip(runs["plain"], runs["ngram"])):
        at = next((j for j, (a, b) in enumerate(zip(plain["tokens"], spec["tokens"])) if a != b), None)
        if at is None and len(plain["tokens"]) != len(spec["tokens"]):
            at = min(len(plain["tokens"]), len(spec["tokens"]))
        gap = plain["top2_gap"][at] if at is not None and at < len(plain["top2_gap"]) else None
        rows.append({"prompt": i, "identical": at is None, "first_difference_at": at, "plain_top2_gap": gap})
        print(f"prompt {i:2d}: " + ("identical" if at is None else
                                    f"differs from token {at} (plain's top-2 logprob gap there {gap:.4f})"))
    import vllm

    summary = {"vllm": vllm.__version__, "target": args.target, "dtype": args.dtype, "max_tokens": args.max_tokens,
               "speculative_config": NGRAM, "prompts": len(rows), "differ": sum(not r["identical"] for r in rows),
               "rows": rows}
    print(f"vLLM {vllm.__version__}, dtype {args.dtype}: ngram's T=0 output differs from plain at "
          f"{summary['differ']} of {len(rows)} prompts")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":  # vLLM spawns processes that re-import __main__
    sys.exit(main(sys.argv[1:]))
