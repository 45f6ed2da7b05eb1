"""One conversation -> token ids + assistant-only loss mask, through the target's own chat template.

Rows arrive in one of two schemas:
  messages:  {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}
  sharegpt:  {"conversations": [{"from": "system"|"human"|"gpt", "value": str}, ...]}

How the mask is found, for any chat template: for each assistant turn i, render the conversation up to
turn i with the generation prompt (A_i) and up to and including turn i (B_i). The text B_i[len(A_i):] is
what the model writes for that turn; it is cut just after the template's end-of-turn marker (ChatML's
`<|im_end|>`, Llama-3's `<|eot_id|>`, ...) so template glue that follows it (a newline) is not learned.
The full rendering is split at those spans and each piece is tokenised on its own, so the ids of an
assistant turn are exactly those of "prompt, then generate": tok(A_i) followed by tok(response + eot).
"""

from __future__ import annotations

ROLE_ALIASES = {
    "system": "system",
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
    "bing": "assistant", "model": "assistant",
}
# end-of-turn markers of common template families; the tokenizer's eos token is tried too
END_OF_TURN_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>")


class BadRow(Exception):
    """A row that is skipped; `reason` is a short, stable label used for the counts."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# ------------------------------------------------------------------------------------ normalising

def detect_format(columns) -> str:
    if "messages" in columns:
        return "messages"
    if "conversations" in columns:
        return "sharegpt"
    raise BadRow("no_conversation_column")


def normalize(row: dict, fmt: str, require_assistant: bool = True) -> list[dict]:
    """A raw row in either schema -> [{"role", "content"}] with roles system/user/assistant."""
    key, role_key, text_key = ("messages", "role", "content") if fmt == "messages" else \
        ("conversations", "from", "value")
    turns = row.get(key)
    if not isinstance(turns, list) or not turns:
        raise BadRow(f"missing_{key}")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict) or role_key not in turn or text_key not in turn:
            raise BadRow("missing_field")
        role = ROLE_ALIASES.get(str(turn[role_key]).strip().lower())
        if role is None:
            raise BadRow("unknown_role")
        content = turn[text_key]
        if not isinstance(content, str) or not content.strip():
            raise BadRow("empty_content")
        messages.append({"role": role, "content": content})
    if require_assistant and not any(m["role"] == "assistant" for m in messages):
        raise BadRow("no_assistant_turn")
    if any(m["role"] == "system" for m in messages[1:]):
        raise BadRow("system_not_first")
    return messages


# -------------------------------------------------------------------------------- render and mask

def end_of_turn_markers(tokenizer) -> tuple[str, ...]:
    specials = set(getattr(tokenizer, "all_special_tokens", []) or []) | set(tokenizer.get_vocab())
    found = [m for m in END_OF_TURN_MARKERS if m in specials]
    eos = getattr(tokenizer, "eos_token", None)
    return tuple(([eos] if eos else []) + [m for m in found if m != eos])


def _render(tokenizer, messages, generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as exc:  # jinja TemplateError etc.: some templates reject role orders (e.g. user twice)
        raise BadRow("rejected_by_chat_template") from exc


def assistant_spans(tokenizer, messages: list[dict], markers) -> tuple[str, list[tuple[int, int]]]:
    """The full rendering and the character spans [start, end) the model writes (content + end-of-turn)."""
    full = _render(tokenizer, messages, False)
    spans = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], True)
        upto = _render(tokenizer, messages[: i + 1], False)
        if not upto.startswith(before) or not full.startswith(upto):
            raise BadRow("template_not_incremental")
        start, end = len(before), len(upto)
        written = upto[start:end]
        cut = min((written.find(m) + len(m) for m in markers if m in written), default=None)
        end = start + cut if cut is not None else start + len(written.rstrip())
        spans.append((start, end))
    return full, spans


def tokenize_conversation(tokenizer, messages: list[dict], max_length: int, markers) -> tuple[list, list]:
    """-> (input_ids, loss_mask) truncated to max_length; raises BadRow when nothing is left to learn."""
    full, spans = assistant_spans(tokenizer, messages, markers)
    ids: list[int] = []
    mask: list[bool] = []
    cursor = 0
    for start, end in spans + [(len(full), len(full))]:
        for text, learn in ((full[cursor:start], False), (full[start:end], True)):
            if text:
                piece = tokenizer(text, add_special_tokens=False)["input_ids"]
                ids.extend(piece)
                mask.extend([learn] * len(piece))
        cursor = end
    ids, mask = ids[:max_length], mask[:max_length]
    if not any(mask):
        raise BadRow("no_assistant_token_after_truncation")
    return ids, mask
