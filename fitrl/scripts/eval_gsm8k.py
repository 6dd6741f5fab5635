"""GSM8K accuracy of a model, with or without a (GRPO) LoRA adapter: greedy, or pass@k when sampling.

Completions are generated in batches from the same prompt as training (system message asking for
`<reasoning>` then `<answer>`), scored by fitrl's `evaluate` metric (`fitrl/metrics/gsm8k_accuracy`,
loaded from its local path, so offline works) with the rewards' own number parsing.

    # the demo: the GRPO adapter against the model it started from, on the held-out problems
    python scripts/eval_gsm8k.py --config configs/demo/eval_gsm8k.yaml
    # Llama-3.2-1B-Instruct + the GRPO adapter on the GSM8K test split
    python scripts/eval_gsm8k.py --config configs/llama1b-16gb/eval_gsm8k.yaml
    # the base model alone: no adapter
    python scripts/eval_gsm8k.py --config configs/llama1b-16gb/eval_gsm8k.yaml \
        --adapter null --output_dir outputs/llama1b-16gb/eval_gsm8k-base

Writes to `output_dir`: `completions.jsonl` (question, gold, completion, parsed answer, correct, format
per completion), `summary.json` (accuracy, pass@k, format compliance, counts) and `run_config.yaml`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fitrl.artifacts import GSM8KScores, GSM8KSummary, written_by
from fitrl.checkpoints import check_adapter_base, check_adapter_files
from fitrl.config import save_run_config
from fitrl.data import carved_from, split_name
from fitrl.modeling import load_causal_lm, load_tokenizer, resolve_model_path
from fitrl.outputs import check_output_dir, staged_output_dir
from fitrl.process import entrypoint
from fitrl.reward.functions import reward_functions, trl_keywords
from fitrl.rollout import complete_chats
from fitrl.stages.eval_gsm8k import STAGE
from fitrl.tasks.answer_format import ensure_chat_template
from fitrl.tasks.grading import extract_answer, is_correct, is_strict_format
from fitrl.tasks.gsm8k import (
    add_prompts,
    failure_kind,
    fewshot_examples,
    grade,
    load_accuracy_metric,
    load_problems,
)


def check_adapter(adapter: str | None) -> Path | None:
    if adapter is None or adapter.lower() in ("", "null", "none"):  # `--adapter null` on the command line
        return None
    path = Path(adapter).expanduser()
    check_adapter_files(path, "GRPO (or PPO)")
    return path


@dataclass
class Inputs:
    """What the evaluation reads, checked before the model loads."""

    model_path: str
    adapter: Path | None
    tokenizer: Any
    dataset: Any  # problems with their chat prompts
    skipped: list[dict[str, Any]]
    n_too_long: int
    reward_funcs: list[Any]  # `fitrl.reward.functions.Checked`, as GRPO calls them


def preflight(model_args: Any, data_args: Any, args: Any, demo_args: Any) -> Inputs:
    inputs = [args.adapter, model_args.model_name_or_path, data_args.dataset]
    check_output_dir(args.output_dir, args.overwrite_output_dir, inputs, demo_args.demo_assets)
    adapter = check_adapter(args.adapter)
    reward_funcs = reward_functions(args.reward_funcs)
    model_path = resolve_model_path(model_args.model_name_or_path, demo_args.demo_assets)
    if adapter is not None:  # evaluating an adapter on another base is a silent mistake
        made_by = written_by(adapter)  # GRPO's policy, or PPO's on the same problems
        producer = made_by if made_by in STAGE.judges else STAGE.reads[1]
        check_adapter_base(adapter, model_args.model_name_or_path, model_path, STAGE.name, args.force, producer)
    problems, skipped = load_problems(data_args, demo_args.demo_assets)
    # The adapter's directory holds the tokenizer (and chat template) the policy was trained with.
    tokenizer = load_tokenizer(str(adapter or model_path), model_args.trust_remote_code, padding_side="left")
    ensure_chat_template(tokenizer)
    examples = fewshot_examples(data_args, args.num_fewshot, args.fewshot_seed, demo_args.demo_assets)
    dataset, n_too_long = add_prompts(
        problems, tokenizer, data_args.system_prompt, data_args.max_prompt_length, examples
    )
    for function in reward_funcs:  # called as GRPO calls them, with these columns
        function.check(dataset.column_names)
    return Inputs(model_path, adapter, tokenizer, dataset, skipped, n_too_long, reward_funcs)


def load_model(model_args: Any, inputs: Inputs) -> Any:
    model = load_causal_lm(
        model_args, path=inputs.model_path, for_training=False, pad_token_id=inputs.tokenizer.pad_token_id
    )
    if inputs.adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(inputs.adapter))
    return model.eval()


def score(model: Any, inputs: Inputs, args: Any) -> tuple[list[list[str]], GSM8KScores, GSM8KScores | None]:
    """The completions with the adapter, their scores, and the scores with the adapter off (if asked)."""
    import torch
    from tqdm.auto import tqdm

    metric, golds = load_accuracy_metric(), inputs.dataset["gold"]

    def complete(desc: str) -> list[list[str]]:
        torch.manual_seed(args.seed)  # the base and the adapter see the same sampling noise
        with tqdm(total=len(inputs.dataset), desc=desc, unit="problem") as bar:
            return complete_chats(
                model,
                inputs.tokenizer,
                inputs.dataset["prompt"],
                args.max_new_tokens,
                num_samples=args.num_samples,
                temperature=args.temperature,
                batch_size=args.batch_size,
                progress=bar,
            )

    def scored(completions: list[list[str]]) -> GSM8KScores:
        found = {**metric.compute(predictions=completions, references=golds), **grade(completions, golds)}
        if inputs.reward_funcs:
            found["rewards"] = reward_means(inputs.reward_funcs, inputs.dataset, completions, inputs.tokenizer)
        return GSM8KScores(**found)

    completions = complete("with adapter" if inputs.adapter else "generating")
    scores, base_scores = scored(completions), None
    if inputs.adapter is not None and args.compare_to_base:
        with model.disable_adapter():
            base_scores = scored(complete("adapter off"))
    return completions, scores, base_scores


def reward_means(
    funcs: list[Any], dataset: Any, completions: list[list[str]], tokenizer: Any
) -> dict[str, float | None]:
    """Each reward function's mean over every completion, called as GRPO calls it: chat completions, trl's
    keywords (`completion_ids` too) and the dataset's columns, one row per completion (None where it
    abstains everywhere)."""
    rows = [(i, c) for i, cs in enumerate(completions) for c in cs]
    chats = [[{"role": "assistant", "content": c}] for _, c in rows]
    columns = {k: [dataset[i][k] for i, _ in rows] for k in dataset.column_names if k != "prompt"}
    ids = [tokenizer(c, add_special_tokens=False).input_ids for _, c in rows]
    keywords = trl_keywords([dataset[i]["prompt"] for i, _ in rows], ids)
    means = {}
    for f in funcs:
        values = [v for v in f(chats, **keywords, **columns) if v is not None]
        means[f.__name__] = sum(values) / len(values) if values else None
    return means


@entrypoint
def main(argv: list[str] | None = None) -> None:
    model_args, data_args, args, demo_args = STAGE.parse(argv)
    inputs = preflight(model_args, data_args, args, demo_args)
    with staged_output_dir(args.output_dir, args.overwrite_output_dir, stage=STAGE.name) as out:
        completions, scores, base_scores = score(load_model(model_args, inputs), inputs, args)
        write_completions(out / "completions.jsonl", inputs.dataset, completions)
        summary = GSM8KSummary(
            model=model_args.model_name_or_path,
            adapter=str(inputs.adapter) if inputs.adapter else None,
            dataset=data_args.dataset,
            split=split_name(data_args.dataset, data_args.dataset_split),
            num_fewshot=args.num_fewshot,
            problems=len(inputs.dataset),
            skipped_non_numeric_gold=len(inputs.skipped),
            dropped_long_prompts=inputs.n_too_long,
            decoding="greedy" if args.temperature == 0 else f"sampled, temperature {args.temperature}",
            scores=scores,
            without_adapter=base_scores,
            carved_from=carved_from(data_args.dataset, data_args.dataset_split),
        )
        summary.write(out)
        save_run_config(out, model_args, data_args, args, demo_args)
    print_summary(summary, inputs.skipped, args.output_dir, data_args.max_prompt_length)


def write_completions(path: Path, dataset: Any, completions: list[list[str]]) -> None:
    """One row per completion: what it answered, how it was graded, and why it failed if it did."""
    with path.open("w") as f:
        for question, gold, comps in zip(dataset["question"], dataset["gold"], completions):
            for sample, text in enumerate(comps):
                row = {
                    "question": question,
                    "gold": gold,
                    "sample": sample,
                    "completion": text,
                    "parsed_answer": extract_answer(text),
                    "correct": is_correct(text, gold),
                    "failure": failure_kind(text, gold),
                    "strict_format": is_strict_format(text),
                }
                f.write(json.dumps(row) + "\n")


def print_summary(summary: GSM8KSummary, skipped: list, output_dir: str, max_prompt_length: int) -> None:
    s, k = summary.scores, summary.scores.k
    line = f"GSM8K {summary.split}: accuracy {s.accuracy:.1%}"
    if k > 1:
        line += f", pass@{k} {s.pass_at_k:.1%}"
    print(f"{line}, format compliance {s.format_compliance:.1%} on {summary.problems} problems")
    print(
        f"  lm-evaluation-harness extractions: strict-match {s.harness_strict_match:.1%}, "
        f"flexible-extract {s.harness_flexible_extract:.1%}; failures {s.failures}"
    )
    if s.rewards is not None:
        print("  rewards: " + ", ".join(f"{k} {v:.3f}" if v is not None else f"{k} -" for k, v in s.rewards.items()))
    base = summary.without_adapter
    if base is not None:
        print(
            f"  without the adapter: accuracy {base.accuracy:.1%}, "
            f"format compliance {base.format_compliance:.1%}, "
            f"flexible-extract {base.harness_flexible_extract:.1%}"
        )
    if skipped:
        print(f"skipped {len(skipped)} problems whose gold answer is not a number, e.g. {skipped[0]['gold']!r}")
    if summary.dropped_long_prompts:
        print(f"dropped {summary.dropped_long_prompts} prompts longer than {max_prompt_length} tokens")
    print(f"per-example completions in {Path(output_dir) / 'completions.jsonl'}")


if __name__ == "__main__":
    main()
