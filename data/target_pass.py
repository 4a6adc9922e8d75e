"""The target's pass over the corpus: batches of whole sequences (up to `cache.batch_tokens` padded tokens),
the target's outputs for their real tokens (hidden states, top-k log-probs), one shard's tensors; and the target
loaded for it (across GPUs when one cannot hold it). Online training (data/cache_reader.py) computes the same
outputs with the same function."""
from __future__ import annotations

import torch

from specdistill import device as devices
from specdistill.target import (DTYPES, load_target, load_target_config, one_device_shortfall, resolve_target,
                                target_logits_from_hidden)

LOGIT_CHUNK = 1024  # tokens per LM-head chunk: bounds the [tokens, vocab] float32 buffer


def plan_batches(indices, lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Sort by length (longest first) and fill each batch up to batch_tokens padded tokens."""
    order = sorted(indices, key=lambda i: (-lengths[i], i))
    batches, current = [], []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        if current and (len(current) + 1) * longest > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def topk_of(model, hidden: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """Top-k log-probs at T=1 (descending), their ids and the probability mass left outside them."""
    values, ids = [], []
    for a in range(0, hidden.shape[0], LOGIT_CHUNK):
        logits = target_logits_from_hidden(model.config, model.get_output_embeddings(), hidden[a:a + LOGIT_CHUNK])
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # capped in the model's dtype, as its own forward does
        v, i = logprobs.topk(k, dim=-1)
        values.append(v)
        ids.append(i)
    values, ids = torch.cat(values), torch.cat(ids)
    tail = (1.0 - values.exp().sum(-1)).clamp_min(0.0)
    return {"topk_logprobs": values.float(), "topk_ids": ids.to(torch.int32), "tail_mass": tail.float()}


def real_rows(hidden: torch.Tensor, valid: torch.Tensor, device) -> torch.Tensor:
    """hidden[valid] ([N, H], real tokens only) on `device`. A target spread with device_map="auto" leaves each
    layer's hidden state on the GPU that computed it and the mask on the first: the small mask goes to the
    state, only the selected rows travel."""
    return hidden[valid.to(hidden.device)].to(device)


@torch.inference_mode()
def target_outputs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, store: list[str],
                   aux_layers: list[int], k: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One padded batch -> the stored kinds for its real tokens, concatenated row by row ([N, ...]).
    Safe for a target spread over devices: each hidden state is masked where it lives, the aux layers are
    stacked on the mask's device, and the final state stays where the final norm ran (the LM head reads it)."""
    need_aux = "hidden_aux" in store
    out = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                              output_hidden_states=need_aux, use_cache=False)
    valid = attention_mask.bool()
    last = real_rows(out.last_hidden_state, valid, out.last_hidden_state.device)
    result = {}
    if "hidden_last" in store:
        result["hidden_last"] = last.to(dtype)
    if need_aux:
        result["hidden_aux"] = torch.stack([real_rows(out.hidden_states[l], valid, valid.device) for l in aux_layers],
                                           dim=1).to(dtype)
    if "topk" in store:
        result.update(topk_of(model, last, k))
    return result


def pad_batch(seqs: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right padding with token 0 (masked out, so its value does not matter); built on the host, one copy over."""
    longest = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), longest, dtype=torch.long, device="cpu")
    mask = torch.zeros(len(seqs), longest, dtype=torch.long, device="cpu")
    for r, s in enumerate(seqs):
        ids[r, :len(s)] = torch.tensor(s, dtype=torch.long, device="cpu")
        mask[r, :len(s)] = 1
    return ids.to(device), mask.to(device)


def compute_shard(model, split_ds, indices: range, lengths: list[int], settings: dict, bar=None) -> dict:
    """The shard's tensors (DESIGN.md table), sequences in corpus order."""
    # where the inputs go: the embedding's device (the first GPU of a target spread with device_map)
    device = model.get_input_embeddings().weight.device if model is not None else "cpu"
    rows = split_ds.select(indices)
    input_ids = [list(x) for x in rows["input_ids"]]
    loss_masks = [list(x) for x in rows["loss_mask"]]
    pieces: dict[int, dict] = {}
    local_lengths = [lengths[i] for i in indices]
    for batch in plan_batches(range(len(indices)), local_lengths, settings["batch_tokens"]) if settings["store"] else []:
        ids, mask = pad_batch([input_ids[i] for i in batch], device)
        out = target_outputs(model, ids, mask, settings["store"], settings["aux_layers"], settings["topk"],
                             DTYPES[settings["dtype"]])
        sizes = [local_lengths[i] for i in batch]
        for name, tensor in out.items():
            for i, part in zip(batch, tensor.cpu().split(sizes)):
                pieces.setdefault(i, {})[name] = part
        if bar is not None:
            bar.update(sum(sizes))
    order = range(len(indices))
    tensors = {
        "input_ids": torch.tensor([t for i in order for t in input_ids[i]], dtype=torch.int32, device="cpu"),
        "loss_mask": torch.tensor([m for i in order for m in loss_masks[i]], dtype=torch.uint8, device="cpu"),
        "seq_lens": torch.tensor(local_lengths, dtype=torch.int64, device="cpu"),
    }
    for name in pieces.get(0, {}):
        tensors[name] = torch.cat([pieces[i][name] for i in order]).contiguous()
    if bar is not None and not settings["store"]:
        bar.update(sum(local_lengths))
    return tensors


def load_model(recipe, device: torch.device):
    """The target on `device`; one larger than the GPU's free memory spread over every GPU (accelerate's
    device_map="auto"), so a target no single GPU holds can still be cached."""
    devices.warn_if_bf16_emulated(DTYPES[recipe.target.dtype], device, "the cache pass runs the target",
                                  "target.dtype=float32")
    if one_device_shortfall(recipe.target, device) is None:
        return load_target(recipe.target, device)
    from transformers import AutoModelForCausalLM

    print(f"target {recipe.target.path} does not fit in {device}'s free memory: loading it across "
          f"{torch.cuda.device_count()} GPUs (device_map=auto)", flush=True)
    load_target_config(recipe.target)  # a readable error on a bad path or architecture
    model = AutoModelForCausalLM.from_pretrained(resolve_target(recipe.target), dtype=DTYPES[recipe.target.dtype],
                                                 trust_remote_code=recipe.target.trust_remote_code,
                                                 device_map="auto")
    return model.eval().requires_grad_(False)
