"""GRPO on GSM8K: a LoRA adapter learns to reason in a fixed format and get the number right.

The recipe that took Llama-3.2-1B-Instruct from about 19% to about 40% GSM8K accuracy in one epoch,
set up to fit a 16 GB card. For each question the policy samples `num_generations` completions; three
rewards (`fitrl.rewards`: strict format 0.5, soft format 0.5, accuracy 2.0) score them; each
completion's advantage is its reward relative to its group's. trl's `GRPOTrainer` runs the loop;
fitrl loads the model (bf16, 8-bit or 4-bit base, frozen) and builds the prompts and rewards. With
`beta > 0` the reference log-probs come from the same model with the adapter disabled.

    # the embedded demo, on a CPU in a few minutes (a tiny model that has seen the answer format)
    accelerate launch scripts/grpo_gsm8k.py --config configs/demo/grpo.yaml
    # Llama-3.2-1B-Instruct on one 16 GB card
    accelerate launch scripts/grpo_gsm8k.py --config configs/llama1b-16gb/grpo.yaml
    # continue a stopped run from its last checkpoint
    accelerate launch scripts/grpo_gsm8k.py --config configs/llama1b-16gb/grpo.yaml --resume_from_checkpoint latest

vLLM generation (`--use_vllm true`, colocated on the training GPU) is optional and off by default:
it needs `pip install vllm` and a CUDA GPU, and nothing else in fitrl depends on it.

Writes to `output_dir`: the adapter, the tokenizer, `run_config.yaml`, `run_info.json`,
`metrics.jsonl`, `grpo_curves.png` and `samples.md` (greedy completions before and after training).
Trainer checkpoints go to `<output_dir>.checkpoints/`, outside the staged output, so a stopped run keeps them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fitrl.answer_format import ensure_chat_template
from fitrl.checkpoints import checkpoint_root, resume_checkpoint
from fitrl.config import (
    UsageError,
    check,
    config_dict,
    entrypoint,
    first_line,
    help_field,
    parse_config,
    save_run_config,
    save_run_info,
)
from fitrl.demo import DemoArguments
from fitrl.distributed import check_ranks_in_sync, cpu_only
from fitrl.gsm8k import GSM8KDataArguments, add_prompts, load_problems
from fitrl.hf_trainer import (
    checkpoint_extras,
    quiet_progress,
    step_peak_callback,
    trainer_arguments,
    whole_run_train_loss,
)
from fitrl.memory import StepPeak, memory_report, peak_memory_mb
from fitrl.modeling import (
    GRPO_LORA_TARGETS,
    LoraArguments,
    ModelArguments,
    load_causal_lm,
    load_tokenizer,
    lora_config,
    resolve_model_path,
)
from fitrl.outputs import (
    METRICS_NAME,
    MetricsLog,
    check_output_dir,
    metrics_callback,
    plot_curves,
    read_jsonl,
    staged_output_dir,
)
from fitrl.planner import planned_peak_mb
from fitrl.rewards import REWARD_FUNCTIONS
from fitrl.rollout import complete_chats

# GRPOArguments that trl's GRPOConfig takes under the same name (the shared trainer ones aside).
GRPO_SETTINGS = [
    "adam_beta1",
    "adam_beta2",
    "num_generations",
    "max_completion_length",
    "temperature",
    "steps_per_generation",
    "generation_batch_size",
    "beta",
    "num_iterations",
    "epsilon",
    "loss_type",
    "use_vllm",
    "vllm_gpu_memory_utilization",
]
CURVES = [
    "reward",
    "rewards/accuracy_reward/mean",
    "rewards/strict_format_reward/mean",
    "rewards/soft_format_reward/mean",
    "completions/mean_length",
    "kl",
]


@dataclass
class GRPOArguments:
    """Training settings of the GRPO stage (defaults: the Llama-1B blog's)."""

    output_dir: str = help_field("outputs/grpo", "Where the adapter, config, metrics, curves and samples go.")
    overwrite_output_dir: bool = help_field(False, "Replace a non-empty output_dir.")
    learning_rate: float = help_field(5e-6, "Peak learning rate of the LoRA weights.")
    adam_beta1: float = help_field(0.9, "AdamW beta1.")
    adam_beta2: float = help_field(0.99, "AdamW beta2.")
    weight_decay: float = help_field(0.1, "AdamW weight decay.")
    warmup_ratio: float = help_field(0.1, "Fraction of the steps spent warming the learning rate up.")
    lr_scheduler_type: Literal["cosine", "linear", "constant", "constant_with_warmup"] = help_field(
        "cosine", "Learning-rate schedule."
    )
    max_grad_norm: float = help_field(0.1, "Clip the gradient norm to this.")
    optim: Literal["adamw_torch", "adamw_bnb_8bit", "paged_adamw_8bit", "paged_adamw_32bit"] = help_field(
        "adamw_torch", "Optimizer; the 8-bit and paged ones (bitsandbytes) keep Adam's state small or pageable."
    )
    num_train_epochs: float = help_field(1.0, "Passes over the problems (ignored when max_steps > 0).")
    max_steps: int = help_field(-1, "Stop after this many optimizer steps (-1: run num_train_epochs).")
    per_device_train_batch_size: int = help_field(4, "Completions per device per forward/backward pass.")
    gradient_accumulation_steps: int = help_field(1, "Passes summed into one optimizer step.")
    num_generations: int = help_field(4, "Completions sampled per question: the group GRPO normalises over.")
    max_completion_length: int = help_field(786, "Longest completion in tokens.")
    temperature: float = help_field(1.0, "Sampling temperature of the completions.")
    steps_per_generation: int | None = help_field(
        None, "Optimizer steps each generated batch serves (empty: gradient_accumulation_steps)."
    )
    generation_batch_size: int | None = help_field(
        None, "Completions generated at once (empty: per_device_train_batch_size x processes x steps_per_generation)."
    )
    num_iterations: int = help_field(1, "Passes over each generated batch (GRPO's mu); > 1 clips the ratio.")
    epsilon: float = help_field(0.2, "Clip range of the policy ratio when num_iterations > 1.")
    beta: float = help_field(0.0, "KL penalty to the reference (adapter off); 0 skips the reference pass entirely.")
    loss_type: Literal["grpo", "dapo", "dr_grpo", "bnpo"] = help_field(
        "dapo", "How token losses are averaged: 'grpo' per sequence (length-biased), 'dapo' per token."
    )
    gradient_checkpointing: bool = help_field(True, "Recompute activations in backward: far less memory, ~30% slower.")
    use_vllm: bool = help_field(False, "Generate with vLLM colocated on the GPU (needs vllm installed and CUDA).")
    vllm_gpu_memory_utilization: float = help_field(0.3, "Share of the GPU vLLM may take when use_vllm is on.")
    logging_steps: int = help_field(1, "Log (metrics.jsonl, progress bar) every this many steps.")
    save_steps: int = help_field(0, "Save a resumable checkpoint every this many steps (0: none).")
    resume_from_checkpoint: str | None = help_field(None, "A checkpoint directory, or 'latest', to continue from.")
    num_samples_to_show: int = help_field(4, "Questions whose greedy completions are shown before and after.")
    report_to: Literal["none", "tensorboard", "wandb"] = help_field("none", "Extra tracker for the training log.")
    seed: int = help_field(42, "Random seed (LoRA init, data order, sampling).")

    def validate(self) -> None:
        check(self.learning_rate > 0, "learning_rate", "> 0")
        check(self.num_generations >= 2, "num_generations", ">= 2 (GRPO compares completions within a group)")
        check(self.max_completion_length >= 1, "max_completion_length", ">= 1")
        check(self.temperature > 0, "temperature", "> 0")
        check(self.per_device_train_batch_size >= 1, "per_device_train_batch_size", ">= 1")
        check(self.gradient_accumulation_steps >= 1, "gradient_accumulation_steps", ">= 1")
        check(self.max_steps == -1 or self.max_steps >= 1, "max_steps", "-1 or >= 1")
        check(self.beta >= 0, "beta", ">= 0")
        check(self.num_iterations >= 1, "num_iterations", ">= 1")
        check(self.epsilon > 0, "epsilon", "> 0")
        check(0 <= self.warmup_ratio < 1, "warmup_ratio", "in [0, 1)")
        check(self.save_steps >= 0, "save_steps", ">= 0")
        check(self.num_samples_to_show >= 0, "num_samples_to_show", ">= 0")


CONFIG_TYPES = [ModelArguments, LoraArguments, GSM8KDataArguments, GRPOArguments, DemoArguments]


def samples_markdown(questions: list[str], golds: list[str], before: list[str], after: list[str]) -> str:
    parts = ["# Greedy completions before and after GRPO\n"]
    for i, (q, g, b, a) in enumerate(zip(questions, golds, before, after)):
        parts.append(f"## {i + 1}. {q}\n\ngold: {g}\n\nbefore:\n```\n{b}\n```\n\nafter:\n```\n{a}\n```\n")
    return "\n".join(parts)


@entrypoint
def main(argv: list[str] | None = None) -> None:
    configs = parse_config(CONFIG_TYPES, argv)
    model_args, lora_args, data_args, args, demo_args = configs

    # Every input is checked before the model loads: a typo should cost a second.
    inputs = [model_args.model_name_or_path, data_args.dataset, args.resume_from_checkpoint]
    check_output_dir(args.output_dir, args.overwrite_output_dir, inputs)
    resume_path = resume_checkpoint(
        args.resume_from_checkpoint, args.output_dir, "checkpoint", "GRPO", config_dict(*configs)
    )
    resume = str(resume_path) if resume_path else None
    checkpoints_existed = checkpoint_root(args.output_dir).exists()
    model_path = resolve_model_path(model_args.model_name_or_path, demo_args.demo_cache_dir)
    problems, skipped = load_problems(data_args, demo_args.demo_cache_dir)
    tokenizer = load_tokenizer(model_path, model_args.trust_remote_code, padding_side="left")
    plain_template = ensure_chat_template(tokenizer)
    dataset, n_too_long = add_prompts(problems, tokenizer, data_args.system_prompt, data_args.max_prompt_length)
    if args.use_vllm and cpu_only():
        raise UsageError("use_vllm needs a CUDA GPU; set use_vllm false on this machine")

    from peft import get_peft_model_state_dict
    from transformers import set_seed
    from trl import GRPOTrainer

    training_args = grpo_config(args, model_args)
    is_main = training_args.process_index == 0
    planned_mb, step_peak = (
        planned_peak_mb("grpo", config_dict(*configs), model_path, training_args.world_size),
        StepPeak(),
    )
    if is_main:
        print(
            f"GRPO: {len(dataset)} problems from {data_args.dataset} ({len(skipped)} skipped: gold not a number, "
            f"{n_too_long} dropped: prompt over {data_args.max_prompt_length} tokens)"
        )
        for row in skipped[:5]:
            print(f"  skipped row {row['row']}: gold answer {row['gold']!r} is not a number")

    with staged_output_dir(args.output_dir, args.overwrite_output_dir, stage="grpo") as out:
        model, peft_config, targets = load_base_and_lora(model_args, lora_args, args, model_path, tokenizer)

        shown = dataset.select(range(min(args.num_samples_to_show, len(dataset))))
        samples_before = [c[0] for c in complete_chats(model, tokenizer, shown["prompt"], args.max_completion_length)]

        metrics = start_metrics(out, is_main, resume)
        set_seed(args.seed)  # the trainer builds the LoRA adapter from `peft_config`: seed its init
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=list(REWARD_FUNCTIONS.values()),
            args=training_args,
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=peft_config,
            callbacks=[
                metrics_callback(metrics, extra=lambda: {"peak_memory_mb": round(peak_memory_mb(), 1)}),
                checkpoint_extras(configs, metrics),
                step_peak_callback(step_peak),
            ],
        )
        keep_adapter_in_float32(trainer, model_args)
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        quiet_progress(trainer)
        trainer.train(resume_from_checkpoint=resume)
        if resume is not None:
            correct_train_loss(metrics, int(Path(resume).name.rpartition("-")[2]))
        if not checkpoints_existed and args.save_steps == 0 and is_main:
            with contextlib.suppress(OSError):  # the trainer made it; nothing was saved into it
                checkpoint_root(args.output_dir).rmdir()

        # Under DDP every rank must end with the same adapter: check it rather than assume it.
        policy = trainer.accelerator.unwrap_model(trainer.model)
        digests = check_ranks_in_sync(get_peft_model_state_dict(policy), "LoRA adapter weights")
        if trainer.is_world_process_zero():
            samples_after = [
                c[0] for c in complete_chats(policy, tokenizer, shown["prompt"], args.max_completion_length)
            ]
            trainer.save_model(str(out))
            tokenizer.save_pretrained(out)
            save_run_config(out, model_args, lora_args, data_args, args, demo_args)
            (out / "samples.md").write_text(
                samples_markdown(shown["question"], shown["gold"], samples_before, samples_after)
            )
            info = {
                "stage": "grpo",
                "resolved_model_path": model_path,
                "problems": len(dataset),
                "skipped_non_numeric_gold": skipped,
                "dropped_long_prompts": n_too_long,
                "plain_chat_template": plain_template,
                "lora_target_modules": targets,
                "trainable_parameters": trainable,
                "memory": memory_report(planned_mb, step_peak),
                "world_size": training_args.world_size,
                "resumed_from": resume,
                "rank_adapter_digests": digests,
            }
            report(out, info, metrics.rows, samples_after, model_args, args)


def keep_adapter_in_float32(trainer: Any, model_args: ModelArguments) -> None:
    """trl stores a quantized model's adapter in bf16 (the QLoRA-on-GPU convention); with a float32
    compute dtype (the CPU demo) small updates would round away, so keep the adapter in float32."""
    if model_args.dtype == "float32":
        for p in trainer.model.parameters():
            if p.requires_grad:
                p.data = p.data.float()


def load_base_and_lora(model_args: Any, lora_args: Any, args: Any, model_path: str, tokenizer: Any) -> tuple:
    """The frozen (quantized) base, and the LoRA config trl wraps it with (the blog's targets by default)."""
    model = load_causal_lm(
        model_args,
        path=model_path,
        gradient_checkpointing=args.gradient_checkpointing,
        pad_token_id=tokenizer.pad_token_id,
    )
    targets = lora_args.lora_target_modules or GRPO_LORA_TARGETS.get(model.config.model_type, ["all-linear"])
    peft_config = lora_config(dataclasses.replace(lora_args, lora_target_modules=targets), model.config.model_type)
    return model, peft_config, targets


def start_metrics(out: Path, is_main: bool, resume: str | None) -> MetricsLog:
    """The run's metrics log; a resumed run starts from the history its checkpoint kept."""
    metrics = MetricsLog(out, enabled=is_main)
    if resume is not None and (Path(resume) / METRICS_NAME).is_file():
        for row in read_jsonl(Path(resume) / METRICS_NAME):
            metrics.log(row)
    return metrics


def correct_train_loss(metrics: MetricsLog, resumed_at: int) -> None:
    """The summary's train_loss over the whole run, not only the steps after the resume."""
    loss = whole_run_train_loss(metrics.rows, resumed_at)
    if loss is not None:
        next(r for r in metrics.rows if "train_loss" in r)["train_loss"] = loss
        metrics.rewrite()


def grpo_config(args: GRPOArguments, model_args: ModelArguments) -> Any:
    """trl's `GRPOConfig`: the shared trainer settings plus GRPO's own; trl's refusals are usage errors."""
    from trl import GRPOConfig

    try:
        return GRPOConfig(
            **{key: getattr(args, key) for key in GRPO_SETTINGS},
            vllm_mode="colocate",
            **trainer_arguments(args, model_args, output_dir=str(checkpoint_root(args.output_dir))),
        )
    except ValueError as e:  # batch sizes that do not divide into groups, and the like
        raise UsageError(first_line(e)) from None


def report(out: Path, info: dict, rows: list[dict], samples_after: list[str], model_args: Any, args: Any) -> None:
    """run_info.json (with the peak memory), the curves, and the reward's rise on the terminal."""
    import torch

    info["peak_memory_mb"] = round(peak_memory_mb(), 1)
    info["peak_memory_kind"] = "cuda allocated" if torch.cuda.is_available() else "process RSS"
    save_run_info(out, info)
    plot_curves(rows, CURVES, out / "grpo_curves.png", title=f"GRPO: {model_args.model_name_or_path}")
    rewards = [r["reward"] for r in rows if "reward" in r]
    if rewards:
        k = max(1, len(rewards) // 5)
        first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
        print(f"GRPO done: mean reward {first:.3f} (first {k} logs) -> {last:.3f} (last {k})")
    print(f"sample after training:\n{samples_after[0] if samples_after else ''}")
    print(f"adapter written to {args.output_dir}")


if __name__ == "__main__":
    main()
