"""Reference decoders from transformers, timed on the same prompts as ours (greedy only).

hf_generate       model.generate(), greedy: transformers' own plain decoding
hf_prompt_lookup  prompt-lookup decoding (n-gram drafts copied from the prompt)
hf_assisted       assisted generation with our draft as `assistant_model` (drafts that are causal LMs only)
"""
from __future__ import annotations

import torch
from transformers import GenerationMixin

from specdistill import device as devices

PROMPT_LOOKUP_TOKENS = 10


def comparator_names(draft) -> list[str]:
    names = ["hf_generate", "hf_prompt_lookup"]
    if assistant_of(draft) is not None:
        names.append("hf_assisted")
    return names


def assistant_of(draft):
    """The draft (a loaded module, kinds.load_draft) as a transformers model that `generate(assistant_model=...)`
    accepts: a draft LM, a transformers generation model; else None (EAGLE and Medusa heads generate nothing)."""
    return draft if isinstance(draft, GenerationMixin) else None


@torch.inference_mode()
def run_comparator(name: str, target, prompt_ids: list[int], max_new_tokens: int, eos_ids, pad_id,
                   draft=None, k: int = 4) -> tuple[list[int], float]:
    """Greedy decode one prompt with a transformers decoder -> (new tokens, seconds)."""
    ids = torch.tensor([prompt_ids], device=target.device)
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=sorted(eos_ids) or None,
                  pad_token_id=pad_id, attention_mask=torch.ones_like(ids))
    if name == "hf_prompt_lookup":
        kwargs["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
    elif name == "hf_assisted":
        kwargs["assistant_model"] = assistant_of(draft)
        kwargs["num_assistant_tokens"] = k  # the same chain length as ours
        kwargs["num_assistant_tokens_schedule"] = "constant"
    elif name != "hf_generate":
        raise ValueError(f"unknown comparator {name}")
    now = devices.clock(target.device)  # waits for the device before it reads the time
    start = now()
    out = target.generate(ids, **kwargs)
    seconds = now() - start
    return out[0, ids.shape[1]:].tolist(), seconds
