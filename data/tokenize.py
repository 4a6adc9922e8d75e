"""Chat templating and loss masks.

The loss mask marks assistant tokens, found by the first of these that works for a conversation:
1. the template's own assistant mask (`return_assistant_tokens_mask`), when the template marks its
   assistant turns with `{% generation %}`;
2. prefixes: the characters between `render(messages[:i], add_generation_prompt=True)` and
   `render(messages[:i+1])` are assistant message i (its text and end-of-turn tokens; the role header
   belongs to the prompt), when the template renders prefixes of a conversation as prefixes of it;
3. search: templates that render a turn differently when it is the last one (Qwen3 adds
   `<think>\n\n</think>\n\n` to the last assistant turn only) break 2; then each assistant message's
   text is found, in order, in the whole rendering, with the end-of-turn text the template puts after it.
A conversation none of them can mask is an `UnmaskableChat` (corpus.on_bad_row decides: stop or skip).
Character spans become token masks through the tokenizer's offset mapping.
`template_kwargs` go to the template (e.g. `enable_thinking: false` for Qwen3's thinking switch).
"""
from __future__ import annotations

from specdistill.errors import SpecdistillError


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


class UnmaskableChat(SpecdistillError):
    """A conversation whose assistant tokens no method can locate."""


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False, **template_kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **template_kwargs)


def template_marks_assistant(tokenizer) -> bool:
    """Whether the chat template marks assistant turns ({% generation %}), so it can return their mask itself."""
    t = getattr(tokenizer, "chat_template", None)
    return isinstance(t, str) and "generation" in t and "endgeneration" in t


def prefix_spans(tokenizer, messages: list[dict], full: str, **kw) -> list[tuple[int, int]] | None:
    """Method 2; None when the template does not render prefixes as prefixes."""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i == 0:
            continue  # a conversation opening with the assistant has no prompt to locate it by: not trained
        before = render(tokenizer, messages[:i], add_generation_prompt=True, **kw)
        through = render(tokenizer, messages[:i + 1], **kw)
        if not full.startswith(through) or not through.startswith(before):
            return None
        spans.append((len(before), len(through)))
    return spans


def search_spans(tokenizer, messages: list[dict], full: str, **kw) -> list[tuple[int, int]] | None:
    """Method 3; None when an assistant message's text is not in the rendering verbatim, in order."""
    spans, cursor = [], 0
    for i, m in enumerate(messages):
        if i > 0 and m["role"] != "assistant":  # move past the other turns in order
            if m["content"]:
                found = full.find(m["content"], cursor)
                if found < 0:
                    return None
                cursor = found + len(m["content"])
            continue
        if m["role"] != "assistant" or i == 0:
            continue
        if not m["content"]:
            return None
        start = full.find(m["content"], cursor)
        if start < 0:
            return None
        end = start + len(m["content"])
        # the end-of-turn text the template writes after this message when it is the last one
        through = render(tokenizer, messages[:i + 1], **kw)
        tail = through[through.rfind(m["content"]) + len(m["content"]):]
        n = 0
        while n < len(tail) and end + n < len(full) and full[end + n] == tail[n]:
            n += 1
        spans.append((start, end + n))
        cursor = end + n
    return spans


def assistant_spans(tokenizer, messages: list[dict], where: str = "", **template_kwargs) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns (methods 2 and 3)."""
    full = render(tokenizer, messages, **template_kwargs)
    spans = prefix_spans(tokenizer, messages, full, **template_kwargs)
    if spans is None:
        spans = search_spans(tokenizer, messages, full, **template_kwargs)
    if spans is None:
        raise UnmaskableChat(f"{where}: the chat template neither marks assistant turns ({{% generation %}}) nor "
                             f"renders prefixes of this conversation as prefixes of it, and an assistant message's "
                             f"text is not in the rendering verbatim, so its assistant tokens cannot be located")
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


def template_mask(tokenizer, messages: list[dict], **kw) -> tuple[list[int], list[int]] | None:
    """Method 1: the template's own assistant mask; None when it marks no assistant token."""
    try:
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True, **kw)
    except Exception:  # a template whose markers transformers cannot use: fall back
        return None
    ids, mask = list(out["input_ids"]), [int(x) for x in out["assistant_masks"]]
    return (ids, mask) if any(mask) else None


def encode_chats(tokenizer, conversations: list[list[dict]], wheres: list[str] | None = None,
                 on_bad_row: str = "error", template_kwargs: dict | None = None) -> list[tuple[list[int], list[int]] | None]:
    """Conversations -> [(input_ids, loss_mask)], the rest tokenised in one batch call of the fast tokenizer.

    A conversation no method can mask raises UnmaskableChat naming its row (`wheres`), or with
    on_bad_row 'skip' comes back as None.
    """
    kw = dict(template_kwargs or {})
    wheres = wheres or [f"conversation {i}" for i in range(len(conversations))]
    out: list = [None] * len(conversations)
    pending = []  # (index, text, spans) for methods 2 and 3
    marked = template_marks_assistant(tokenizer)
    for i, (msgs, where) in enumerate(zip(conversations, wheres)):
        if marked:
            got = template_mask(tokenizer, msgs, **kw)
            if got is not None:
                out[i] = got
                continue
        try:
            text, spans = assistant_spans(tokenizer, msgs, where, **kw)
        except UnmaskableChat as e:
            if on_bad_row == "skip":
                continue
            raise UnmaskableChat(f"{e}; set corpus.on_bad_row: skip to skip such rows") from None
        pending.append((i, text, spans))
    if pending:
        enc = tokenizer([text for _, text, _ in pending], add_special_tokens=False, return_offsets_mapping=True)
        for (i, _, spans), ids, offs in zip(pending, enc["input_ids"], enc["offset_mapping"]):
            out[i] = (ids, mask_from_offsets(offs, spans))
    return out


def encode_texts(tokenizer, texts: list[str]) -> list[tuple[list[int], list[int]]]:
    """Plain text: every token is trained; an end-of-text token closes each document."""
    enc = tokenizer(texts, add_special_tokens=True)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return [(ids + eos, [1] * (len(ids) + len(eos))) for ids in enc["input_ids"]]


def prompt_ids(tokenizer, messages: list[dict], **template_kwargs) -> list[int]:
    """Token ids of a conversation prefix ready for the assistant's reply (used by regeneration)."""
    return tokenizer(render(tokenizer, messages, add_generation_prompt=True, **template_kwargs),
                     add_special_tokens=False)["input_ids"]
