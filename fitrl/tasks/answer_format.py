"""The answer format GRPO teaches and `fitrl.tasks.grading` checks: `<reasoning>` then `<answer>`.

A leaf module (it imports nothing from fitrl): the prompt a model sees, the chat template for
tokenizers that have none, and a GSM8K answer rewritten in the format. The GRPO and evaluation
scripts, `fitrl.tasks.gsm8k` and the demo builder (which teaches its tiny model the format) all use it.
"""

from __future__ import annotations

import re
from typing import Any

# The format's tags. A large vocabulary spells each in a few tokens; the demo's 1024-token BPE took six
# or seven, so its reasoner has them as one token each (`fitrl.demo.models.build_reasoner`).
FORMAT_TAGS = ("<reasoning>", "</reasoning>", "<answer>", "</answer>")

SYSTEM_PROMPT = "Respond in the following format:\n<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>"

# For tokenizers without a chat template (base models such as gpt-neox, the demo's tiny model): the
# system text, the question, then the answer cue. Instruct models (Llama-3.2-1B-Instruct) keep theirs.
PLAIN_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{ message['content'] + '\\n\\n' }}"
    "{%- elif message['role'] == 'user' -%}{{ 'Question: ' + message['content'] + '\\n' }}"
    "{%- elif message['role'] == 'assistant' -%}{{ 'Answer:\\n' + message['content'] + eos_token }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'Answer:\\n' }}{%- endif -%}"
)


def asks_for_answer_block(system_prompt: str | None) -> bool:
    """Whether a system prompt asks for the format's `<answer>` block (its completions are answers in the
    format, not prose: the reward pre-flight's format probes apply, its cut measure does not)."""
    return FORMAT_TAGS[2] in (system_prompt or "")


_CALCULATOR = re.compile(r"<<[^>]*>>")  # GSM8K's calculator annotations, e.g. <<14+11=25>>


def format_solution(answer: str) -> str:
    """A GSM8K answer rewritten in the trained format: its worked steps, then the gold number."""
    steps, gold = answer.rsplit("####", 1)
    reasoning = _CALCULATOR.sub("", steps).strip()
    return f"<reasoning>\n{reasoning}\n</reasoning>\n<answer>\n{gold.strip()}\n</answer>"


def prompt_messages(
    question: str, system_prompt: str = SYSTEM_PROMPT, examples: list[tuple[str, str]] = ()
) -> list[dict[str, str]]:
    """The chat a model answers: the format instruction as the system message, then the question.

    `examples` (question, solution in the format) come first as earlier turns: few-shot prompting.
    """
    shots = [{"role": r, "content": c} for q, a in examples for r, c in (("user", q), ("assistant", a))]
    return [{"role": "system", "content": system_prompt}, *shots, {"role": "user", "content": question}]


def ensure_chat_template(tokenizer: Any) -> bool:
    """Give a tokenizer without a chat template the plain one; True when it had to."""
    if getattr(tokenizer, "chat_template", None):
        return False
    tokenizer.chat_template = PLAIN_CHAT_TEMPLATE
    return True


def render_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """The prompt text, ending with the generation cue, in the tokenizer's chat template."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
