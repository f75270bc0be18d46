"""One conversation -> the token ids a chat model reads and the mask of the tokens it is trained on.

A conversation is a list of messages {role, content} (extra keys, e.g. a reasoning trace, pass to the
template as they are): roles system, user and assistant; content a string; an assistant's content not empty;
at least one assistant message. The chat template (data/chat_template.py) renders it, and the rendering is
tokenized whole, special tokens' spellings read as those tokens (Tokenizer.encode_rendered), as Hugging Face's
apply_chat_template(tokenize=True) does: the ids are the same whichever data.loss_on.

Which tokens are the assistant's (data.loss_on='assistant'): for assistant message i, its tokens start after
the rendering of messages[:i] with the generation prompt (the role header a served prompt ends with: the
model never predicts it at serving time) and end with the rendering of messages[:i + 1], less trailing
tokens of whitespace text that are not special (template glue such as the newline after Qwen's <|im_end|>).
So they are the reply's text (a reasoning block the template writes into the turn included) and its
end-of-turn token, which must be a special token: a turn that ends in plain text would never teach the model
to stop, and is refused. Both prefixes must tokenize to a beginning of the whole conversation's ids (the
prefix property); a template that renders a turn differently once later turns follow (Qwen3's drops earlier
turns' reasoning) fails it and is refused for 'assistant' (data.loss_on='all' needs no spans).

The mask has one entry per target of the example data/packing.py makes of the ids: entry j < n is 1 when
token j is trained on (the model predicts it), entry n is the final eos target (1 with 'all', never with
'assistant', 0 for a truncated conversation, whose end was cut).
"""
from __future__ import annotations

import numpy as np

from scone_jax.data import chat_template as chat_template_lib

ROLES = ("system", "user", "assistant")
LOSS_ON = ("assistant", "all")
OVERLONG = ("refuse", "truncate")


class ConversationError(ValueError):
    """A conversation that cannot be trained on; the message names where it is (file:line) and the fix."""


def messages_of(record, field: str, where: str) -> list[dict]:
    """The checked messages of a parsed JSONL record (module docstring), else ConversationError naming `where`."""
    if not isinstance(record, dict) or field not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ConversationError(f"{where}: no field {field!r} (found {keys}). Fix: set data.messages_field to the field "
                                "that holds the list of messages.")
    messages = record[field]
    if not isinstance(messages, list) or not messages:
        raise ConversationError(f"{where}: {field!r} holds {str(messages)[:40]!r}, not a list of messages. Fix: "
                                "[{\"role\": \"user\", \"content\": ...}, {\"role\": \"assistant\", ...}].")
    for k, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        if role not in ROLES:
            raise ConversationError(f"{where}: message {k} has role {role!r}, not one of {', '.join(ROLES)}. Fix: use "
                                    "those roles (rename or drop the others).")
        if not isinstance(content, str):
            raise ConversationError(f"{where}: message {k} ({role}) has content {str(content)[:40]!r}, not a string. "
                                    "Fix: give every message its text as a string.")
        if role == "assistant" and not content.strip():
            raise ConversationError(f"{where}: message {k} is an empty assistant turn. Fix: remove the conversation or "
                                    "give the turn its text.")
    if not any(m["role"] == "assistant" for m in messages):
        raise ConversationError(f"{where}: no assistant message, so nothing to train on. Fix: remove the "
                                "conversation or add the reply.")
    return messages


class Encoder:
    """Conversations -> (ids, mask) with one template, tokenizer and data.loss_on; pickles small."""

    def __init__(self, template: chat_template_lib.ChatTemplate, tokenizer, loss_on: str):
        if loss_on not in LOSS_ON:
            raise ValueError(f"data.loss_on={loss_on!r} is not valid; use 'assistant' (the replies' tokens) or 'all'.")
        self.template, self.tokenizer, self.loss_on = template, tokenizer, loss_on
        self._special = chat_template_lib.special_spellings(tokenizer)
        self._special_ids = np.array(sorted(tokenizer.special_token_ids()), np.int64)

    def render(self, messages: list[dict], add_generation_prompt: bool, where: str) -> str:
        try:
            return self.template.render(messages, add_generation_prompt, self._special)
        except chat_template_lib.TemplateError as e:
            raise ConversationError(f"{where}: {e}. Fix: repair the conversation, or set data.chat_template to a "
                                    "template that renders it.") from None

    def prompt_ids(self, messages: list[dict], where: str) -> np.ndarray:
        """The ids a served model reads before it replies to `messages` (the generation prompt appended)."""
        return self.tokenizer.encode_rendered(self.render(messages, True, where))

    def encode(self, messages: list[dict], where: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids int32 [n], mask uint8 [n + 1]) of checked `messages` (module docstring)."""
        ids = self.tokenizer.encode_rendered(self.render(messages, False, where))
        if not len(ids):
            raise ConversationError(f"{where}: the chat template of {self.template.origin} renders it as no tokens. "
                                    "Fix: check the template.")
        mask = np.zeros(len(ids) + 1, np.uint8)
        if self.loss_on == "all":
            mask[:] = 1
            return ids, mask
        for k, message in enumerate(messages):
            if message["role"] == "assistant":
                start, end = self._span(ids, messages, k, where)
                mask[start:end] = 1
        return ids, mask

    def _prefix_length(self, ids: np.ndarray, messages: list[dict], k: int, generation: bool, where: str) -> int:
        """Tokens of the rendering of messages[:k] (with the generation prompt or not), checked to begin `ids`."""
        part = self.tokenizer.encode_rendered(self.render(messages[:k], generation, where)) if k else ids[:0]
        if len(part) > len(ids) or not np.array_equal(ids[:len(part)], part):
            what = "with the generation prompt " if generation else ""
            raise ConversationError(
                f"{where}: the chat template of {self.template.origin} renders the conversation's first {k} "
                f"message(s) {what}as tokens that do not begin the whole conversation's, so the assistant's tokens "
                "cannot be found. Fix: data.loss_on='all', or a template that renders each turn the same whatever "
                "follows it (data.chat_template).")
        return len(part)

    def _span(self, ids: np.ndarray, messages: list[dict], k: int, where: str) -> tuple[int, int]:
        """[start, end) of assistant message k's tokens in `ids` (module docstring)."""
        start = self._prefix_length(ids, messages, k, True, where)
        end = len(ids) if k + 1 == len(messages) else self._prefix_length(ids, messages, k + 1, False, where)
        while end > start and not np.isin(ids[end - 1], self._special_ids) \
                and not self.tokenizer.decode([int(ids[end - 1])]).strip():
            end -= 1
        if end <= start or not np.isin(ids[end - 1], self._special_ids):
            raise ConversationError(
                f"{where}: the chat template of {self.template.origin} ends assistant message {k} with "
                f"{self.tokenizer.decode(ids[max(start, end - 3):end].tolist())!r}, not a special token, so the model "
                "would never learn where a reply ends. Fix: a template that closes each assistant turn with a special "
                "token (e.g. {{ eos_token }}, or <|im_end|>).")
        return start, end


def row_positions(num_ids: int, add_bos: bool) -> int:
    """Row positions a conversation of `num_ids` tokens takes (data/packing.py: one more with a bos)."""
    return num_ids + add_bos


def truncate(ids: np.ndarray, mask: np.ndarray, keep: int) -> tuple[np.ndarray, np.ndarray]:
    """A conversation's first `keep` ids (a row's worth), the final eos target, which would follow a cut, masked
    out."""
    return ids[:keep], np.concatenate([mask[:keep], np.zeros(1, mask.dtype)])
