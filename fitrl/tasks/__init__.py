"""Tasks: each owns its data, prompts and grading, and knows nothing of the engines that train on it.

- `sentiment`: review prompts for PPO and its evaluation, the corpus-word measure, the judge;
- `gsm8k`: GSM8K problems (or any question/answer dataset), few-shot examples, the harness's extraction;
- `grading`: reading a numeric answer and the format, accuracy and GRPO's reward functions;
- `answer_format`: the `<reasoning>`/`<answer>` format, its prompt and chat template;
- `preferences`: preference pairs for the rm and DPO stages.
"""
