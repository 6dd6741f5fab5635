"""Chat data: a column of conversations (lists of `{"role", "content"}` messages, trl's `messages`) as
PPO prompts and SFT examples, rendered with the tokenizer's chat template or one the user gives.

A tokenizer without a template (a base model's) gets the plain one of `fitrl.tasks.answer_format`, and the
stage says so once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fitrl.config import UsageError, first_line
from fitrl.tasks.answer_format import ensure_chat_template

CHAT_TEMPLATE_HELP = (
    "A Jinja chat template (a .jinja file, or the template itself) for chat rows instead of the tokenizer's; "
    "a tokenizer without one gets a plain 'Question:/Answer:' template (said once)."
)


def is_chat(value: Any) -> bool:
    """True for a conversation: a list (of messages, checked by `check_chat`), not a text."""
    return isinstance(value, list)


def check_chats(values: list[Any], column: str, prompt: bool) -> bool:
    """Whether a column's `values` are chats; if so each row is checked (`check_chat`; an empty row is
    left to the caller)."""
    if not any(is_chat(v) for v in values):
        return False
    for row, value in enumerate(values):
        if value is not None:
            check_chat(value, column, row, prompt=prompt)
    return True


def check_chat(messages: Any, column: str, row: int, prompt: bool) -> None:
    """A one-line `UsageError` unless `messages` is a non-empty list of role/content messages (and, for a
    `prompt`, one that ends before the assistant's turn)."""
    where = f"row {row + 1} of column '{column}'"
    if not (
        isinstance(messages, list)
        and messages
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)
        and all(isinstance(m.get("content"), str) for m in messages)
    ):
        raise UsageError(f'{where} is not a chat; give a list of {{"role": ..., "content": ...}} messages')
    if prompt and messages[-1]["role"] == "assistant":
        raise UsageError(f"{where} ends with the assistant's turn; a prompt ends before it (drop that message)")


def use_chat_template(tokenizer: Any, template: str | None) -> bool:
    """Set the template chats are rendered with: `template` (a file or Jinja text), else the tokenizer's
    own, else the plain one. True when the plain one had to be used."""
    if template is None:
        return ensure_chat_template(tokenizer)
    path = Path(template).expanduser()
    if path.is_file():
        tokenizer.chat_template = path.read_text(encoding="utf-8")
    elif "{{" in template or "{%" in template:
        tokenizer.chat_template = template
    else:
        raise UsageError(f"chat_template {template} is neither a file nor a Jinja template; give one or the other")
    return False


def render_prompt_chat(tokenizer: Any, messages: list[dict[str, str]], column: str, row: int) -> str:
    """The prompt text of a checked chat: its messages in the template, ending with the assistant's cue."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # the template's own raise_exception ("roles must alternate"), or a Jinja error
        raise UsageError(
            f"row {row + 1} of column '{column}' does not render with the chat template: {first_line(e)}"
        ) from None
