"""The eval_gsm8k stage: GSM8K accuracy with and without the GRPO adapter (greedy, or pass@k).

Script: `scripts/eval_gsm8k.py`. Writes `completions.jsonl` and `summary.json`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fitrl.artifacts import GSM8KSummary, carved_note
from fitrl.config import check, config_of, help_field, load_run_config, parse_config
from fitrl.data import HELDOUT_SPLIT
from fitrl.demo import DemoArguments
from fitrl.modeling import ModelArguments
from fitrl.stages.base import Stage, field_names
from fitrl.tasks.gsm8k import GSM8KDataArguments


@dataclass
class GSM8KEvalArguments:
    """What to evaluate and how to decode."""

    adapter: str | None = help_field(
        None, "LoRA adapter directory (a GRPO output, or one of its checkpoints) on the model; null: none."
    )
    output_dir: str = help_field("outputs/eval_gsm8k", "Where completions.jsonl and summary.json go.")
    overwrite_output_dir: bool = help_field(False, "Replace a non-empty output_dir.")
    num_samples: int = help_field(
        1, "Completions per problem: 1 at temperature 0 is greedy accuracy; k > 1 gives pass@k."
    )
    temperature: float = help_field(0.0, "0: greedy decoding; > 0: sampling at this temperature (needed for k > 1).")
    max_new_tokens: int = help_field(786, "Longest completion in tokens.")
    batch_size: int = help_field(64, "Problems per generation batch.")
    num_fewshot: int = help_field(
        0, "Solved train problems shown before each question (published base-model baselines use 8)."
    )
    fewshot_seed: int = help_field(1234, "Which train problems the few-shot examples are.")
    compare_to_base: bool = help_field(True, "With an adapter, also score the model with the adapter off.")
    seed: int = help_field(0, "Random seed of the sampling.")
    force: bool = help_field(False, "Evaluate even if the adapter says it was trained on another model or stage.")
    reward_funcs: list[str] = help_field(
        [],
        "Also score every completion with these reward functions, as GRPO's reward_funcs names them (registry "
        "names, module:function, file.py:function): their means go into summary.json under 'rewards'.",
    )

    def validate(self) -> None:
        check(self.num_samples >= 1, "num_samples", ">= 1")
        check(self.temperature >= 0, "temperature", ">= 0")
        check(self.num_samples == 1 or self.temperature > 0, "temperature", "> 0 when num_samples > 1 (pass@k samples)")
        check(self.max_new_tokens >= 1, "max_new_tokens", ">= 1")
        check(self.batch_size >= 1, "batch_size", ">= 1")
        check(self.num_fewshot >= 0, "num_fewshot", ">= 0")
        check(self.seed >= 0 and self.fewshot_seed >= 0, "seed", ">= 0 (and fewshot_seed too)")


CONFIG_TYPES = (ModelArguments, GSM8KDataArguments, GSM8KEvalArguments, DemoArguments)


def trained_settings(argv: list[str]) -> dict:
    """Held-out problems (`test`, unless set), and where the adapter's run wrote a `run_config.yaml` (a
    GRPO output or checkpoint), the model and problem settings it trained with: the evaluation prompts
    as the policy was trained to, unless the config or a flag says otherwise."""
    adapter = config_of(parse_config(CONFIG_TYPES, argv), GSM8KEvalArguments).adapter
    trained = {} if adapter in (None, "", "null", "none") else load_run_config(Path(adapter).expanduser())
    inherited = field_names(ModelArguments, GSM8KDataArguments) - {"dataset_split", "max_samples"}
    return {"dataset_split": HELDOUT_SPLIT} | {k: v for k, v in trained.items() if k in inherited}


def figures(out: Path) -> list[str]:
    summary = GSM8KSummary.read(out)
    if summary is None:
        return []
    s, base = summary.scores, summary.without_adapter
    line = f"accuracy {s.accuracy:.1%} with the adapter"
    if base is not None:
        line += f", {base.accuracy:.1%} without"
    carved = carved_note(summary.split, summary.carved_from)
    problems = f"problems{carved}" if carved else f"{summary.split} problems"
    return [
        line + f" ({summary.problems} {problems})",
        f"format compliance {s.format_compliance:.0%}"
        + (f" (without: {base.format_compliance:.0%})" if base is not None else ""),
    ]


STAGE = Stage(
    name="eval_gsm8k",
    judges=("grpo", "ppo"),
    module="fitrl.scripts.eval_gsm8k",
    config_types=CONFIG_TYPES,
    output_dir="eval_gsm8k",
    figures=figures,
    reads=("adapter", "grpo"),
    inherited=trained_settings,
)
