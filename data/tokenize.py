"""Chat templating and loss masks.

The loss mask marks assistant tokens. It is found by rendering prefixes of the conversation with the
target's own chat template: the characters between `render(messages[:i], add_generation_prompt=True)`
and `render(messages[:i+1])` are assistant message i (its text and end-of-turn tokens; the role header
belongs to the prompt). Character spans become token masks through the tokenizer's offset mapping,
so no `{% generation %}` markers are needed and any template that renders prefixes as prefixes works.
"""
from __future__ import annotations

from specdistill.errors import SpecdistillError


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def assistant_spans(tokenizer, messages: list[dict], where: str = "") -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns."""
    full = render(tokenizer, messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i == 0:
            continue  # a conversation opening with the assistant has no prompt to locate it by: not trained
        before = render(tokenizer, messages[:i], add_generation_prompt=True)
        through = render(tokenizer, messages[:i + 1])
        if not full.startswith(through) or not through.startswith(before):
            raise SpecdistillError(f"{where}: the chat template does not render prefixes of a conversation as "
                                   f"prefixes of it, so assistant tokens cannot be located")
        spans.append((len(before), len(through)))
    return full, spans


def mask_from_offsets(offsets, spans) -> list[int]:
    """1 for a token whose characters start inside an assistant span (two pointers, both sorted)."""
    mask, s = [], 0
    for start, end in offsets:
        while s < len(spans) and start >= spans[s][1]:
            s += 1
        inside = s < len(spans) and spans[s][0] <= start < spans[s][1] and end > start
        mask.append(1 if inside else 0)
    return mask


def encode_chats(tokenizer, conversations: list[list[dict]]) -> list[tuple[list[int], list[int]]]:
    """Conversations -> [(input_ids, loss_mask)], tokenised in one batch call of the fast tokenizer."""
    rendered = [assistant_spans(tokenizer, msgs) for msgs in conversations]
    enc = tokenizer([text for text, _ in rendered], add_special_tokens=False, return_offsets_mapping=True)
    return [(ids, mask_from_offsets(offs, spans))
            for ids, offs, (_, spans) in zip(enc["input_ids"], enc["offset_mapping"], rendered)]


def encode_texts(tokenizer, texts: list[str]) -> list[tuple[list[int], list[int]]]:
    """Plain text: every token is trained; an end-of-text token closes each document."""
    enc = tokenizer(texts, add_special_tokens=True)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return [(ids + eos, [1] * (len(ids) + len(eos))) for ids in enc["input_ids"]]


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation prefix ready for the assistant's reply (used by regeneration)."""
    return tokenizer(render(tokenizer, messages, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
