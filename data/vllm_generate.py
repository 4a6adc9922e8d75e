"""Runs inside vLLM's own environment (.venv-vllm): the target answers prompts in vLLM's batched generation, for
`cache.regenerate_engine: vllm` (data/regenerate.py writes the job and reads the replies). Imports nothing of
specdistill, so that vLLM's pins never meet ours in one interpreter.

  python data/vllm_generate.py JOB.json RESULT.json

The job names the target directory, its dtype, the prompts as token ids with their indices, max_new_tokens, the
temperature and the ids that end a reply. Prompts go to vLLM `chunk` at a time (vLLM batches within a chunk);
after each chunk its replies are appended to the job's `partial` file as JSON lines {"i": index, "ids": [...]},
so a killed run loses at most one chunk. At T > 0 each prompt samples with its own seed (its index), so a
reply does not depend on which chunk or batch it fell in. The result holds the timings only.
"""
from __future__ import annotations

import json
import os
import sys
import time

# One process and both cores: nothing else runs beside the engine while it generates.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


def main(job_file: str, result_file: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.loads(open(job_file).read())
    started = time.perf_counter()
    llm = LLM(model=job["target"], dtype=job["dtype"], max_model_len=job["max_model_len"], seed=0,
              **job.get("engine_args", {}))
    startup = time.perf_counter() - started

    def params(i: int) -> SamplingParams:
        sampled = job["temperature"] > 0
        return SamplingParams(max_tokens=job["max_new_tokens"], temperature=job["temperature"], top_k=0, top_p=1.0,
                              stop_token_ids=job["stop_token_ids"], seed=i if sampled else None,
                              skip_special_tokens=False, detokenize=False)

    prompts, generated, seconds = job["prompts"], 0, 0.0
    for start in range(0, len(prompts), job["chunk"]):
        chunk = prompts[start:start + job["chunk"]]
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p["ids"]) for p in chunk], [params(p["i"]) for p in chunk],
                            use_tqdm=False)
        seconds += time.perf_counter() - t0
        lines = [json.dumps({"i": p["i"], "ids": list(o.outputs[0].token_ids)}) for p, o in zip(chunk, outs)]
        generated += sum(len(o.outputs[0].token_ids) for o in outs)
        with open(job["partial"], "a") as fh:  # whole lines: a line an earlier kill cut was ended by the caller
            fh.write("".join(line + "\n" for line in lines))
            fh.flush()
            os.fsync(fh.fileno())
        print(f"vllm_generate: {start + len(chunk)}/{len(prompts)} prompts, {generated / seconds:.1f} generated "
              f"tokens/s", flush=True)
    with open(result_file, "w") as fh:
        json.dump({"prompts": len(prompts), "generated_tokens": generated, "generate_s": seconds,
                   "startup_s": startup}, fh)


if __name__ == "__main__":
    main(*sys.argv[1:3])
