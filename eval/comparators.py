"""Reference decoders from transformers, timed on the same prompts as ours (greedy only).

hf_generate       model.generate(), greedy: transformers' own plain decoding
hf_prompt_lookup  prompt-lookup decoding (n-gram drafts copied from the prompt)
hf_assisted       assisted generation with our draft_lm as `assistant_model` (draft_lm drafts only)
"""
from __future__ import annotations

import torch

from specdistill import device as devices

PROMPT_LOOKUP_TOKENS = 10


def comparator_names(draft) -> list[str]:
    names = ["hf_generate", "hf_prompt_lookup"]
    if assistant_of(draft) is not None:
        names.append("hf_assisted")
    return names


def assistant_of(draft):
    """The draft as a transformers model that `generate(assistant_model=...)` accepts (a draft LM, or the
    engine's drafter of one), else None (an EAGLE head has no `generate`)."""
    if hasattr(draft, "generate"):
        return draft
    inner = getattr(draft, "model", None)  # the engine's drafter of a draft LM
    return inner if hasattr(inner, "generate") else None


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
