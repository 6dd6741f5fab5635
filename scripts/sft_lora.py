"""Stage 1 of the RLHF pipeline: LoRA causal-LM fine-tuning of a frozen (8-bit) base on movie reviews.

The recipe of "Fine-tuning 20B LLMs with RLHF on a 24GB consumer GPU": the base model is loaded in
8-bit and frozen, a LoRA adapter on the attention projections learns to continue IMDB reviews, and
the reviews are packed into fixed-length blocks so no compute is spent on padding.

    # the embedded demo, on a CPU in about a minute
    accelerate launch scripts/sft_lora.py --config configs/demo/sft.yaml
    # the real job: gpt-neox-20b in 8-bit on one 24 GB card
    accelerate launch scripts/sft_lora.py --config configs/neox20b-24gb/sft.yaml
    # two processes with DDP (also on a CPU machine, over gloo)
    accelerate launch --multi_gpu --num_processes 2 scripts/sft_lora.py --config configs/demo/sft.yaml

Any key of the YAML file can be overridden on the command line, e.g. `--max_steps 50`.
Writes to `output_dir`: the adapter (peft), the tokenizer, `run_config.yaml`, `metrics.jsonl`, `loss.png`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fitrl.config import check, config_dict, entrypoint, help_field, parse_config, save_run_config, save_run_info
from fitrl.data import load_text_dataset
from fitrl.demo import DemoArguments
from fitrl.distributed import check_ranks_in_sync
from fitrl.hf_trainer import quiet_progress, step_peak_callback, trainer_arguments
from fitrl.memory import StepPeak, memory_report
from fitrl.modeling import LoraArguments, ModelArguments, add_lora, load_causal_lm, load_tokenizer, resolve_model_path
from fitrl.outputs import MetricsLog, check_output_dir, metrics_callback, plot_curves, staged_output_dir
from fitrl.planner import planned_peak_mb


@dataclass
class SFTArguments:
    """Data and training settings of the SFT stage."""

    dataset: str = help_field(
        "stanfordnlp/imdb", "Hub dataset id, a local .jsonl/.csv/.parquet file or directory, or demo://reviews."
    )
    dataset_split: str = help_field("train", "Split to train on.")
    text_column: str = help_field("text", "Column holding the review text.")
    max_samples: int | None = help_field(None, "Use at most this many reviews (all when empty).")
    block_size: int = help_field(512, "Tokens per packed training block: reviews are concatenated and cut.")
    output_dir: str = help_field("outputs/sft", "Where the adapter, tokenizer, config, metrics and plot go.")
    overwrite_output_dir: bool = help_field(False, "Replace a non-empty output_dir.")
    learning_rate: float = help_field(2e-4, "Peak learning rate of the LoRA weights.")
    num_train_epochs: float = help_field(1.0, "Passes over the data (ignored when max_steps > 0).")
    max_steps: int = help_field(-1, "Stop after this many optimizer steps (-1: run num_train_epochs).")
    per_device_train_batch_size: int = help_field(4, "Blocks per device per forward pass.")
    gradient_accumulation_steps: int = help_field(1, "Forward passes summed into one optimizer step.")
    gradient_checkpointing: bool = help_field(True, "Recompute activations in backward: far less memory, ~30% slower.")
    optim: Literal["adamw_torch", "adamw_bnb_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "adafactor"] = help_field(
        "adamw_torch", "Optimizer; the 8-bit ones keep Adam's state in 8 bits (bitsandbytes)."
    )
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = help_field(
        "linear", "Learning-rate schedule."
    )
    warmup_ratio: float = help_field(0.0, "Fraction of the steps spent warming the learning rate up.")
    weight_decay: float = help_field(0.0, "AdamW weight decay.")
    max_grad_norm: float = help_field(1.0, "Clip the gradient norm to this (0 disables clipping).")
    logging_steps: int = help_field(10, "Log (metrics.jsonl, progress bar) every this many steps.")
    save_steps: int = help_field(0, "Save a resumable Trainer checkpoint every this many steps (0: only at the end).")
    report_to: Literal["none", "tensorboard", "wandb"] = help_field("none", "Extra tracker for the training log.")
    seed: int = help_field(42, "Random seed (LoRA init, data order, dropout).")

    def validate(self) -> None:
        check(self.learning_rate > 0, "learning_rate", "> 0")
        check(self.block_size >= 8, "block_size", "an integer >= 8")
        check(self.per_device_train_batch_size >= 1, "per_device_train_batch_size", ">= 1")
        check(self.gradient_accumulation_steps >= 1, "gradient_accumulation_steps", ">= 1")
        check(self.max_steps == -1 or self.max_steps >= 1, "max_steps", "-1 or >= 1")
        check(self.num_train_epochs > 0, "num_train_epochs", "> 0")
        check(self.max_samples is None or self.max_samples >= 1, "max_samples", "empty or >= 1")
        check(self.logging_steps >= 1, "logging_steps", ">= 1")
        check(self.save_steps >= 0, "save_steps", ">= 0")
        check(0 <= self.warmup_ratio < 1, "warmup_ratio", "in [0, 1)")
        check(self.max_grad_norm >= 0, "max_grad_norm", ">= 0")


CONFIG_TYPES = [ModelArguments, LoraArguments, SFTArguments, DemoArguments]


@entrypoint
def main(argv: list[str] | None = None) -> None:
    configs = parse_config(CONFIG_TYPES, argv)
    model_args, lora_args, args, demo_args = configs

    # Check every input before loading anything heavy: a typo should cost a second, not a model load.
    check_output_dir(args.output_dir, args.overwrite_output_dir, [model_args.model_name_or_path, args.dataset])
    model_path = resolve_model_path(model_args.model_name_or_path, demo_args.demo_cache_dir)
    dataset = load_text_dataset(
        args.dataset, args.dataset_split, args.text_column, demo_args.demo_cache_dir, args.max_samples
    )
    tokenizer = load_tokenizer(model_path, model_args.trust_remote_code)

    from peft import get_peft_model_state_dict
    from transformers import set_seed
    from trl import SFTConfig, SFTTrainer

    with staged_output_dir(args.output_dir, args.overwrite_output_dir, stage="sft") as out:
        model = load_causal_lm(
            model_args,
            path=model_path,
            gradient_checkpointing=args.gradient_checkpointing,
            pad_token_id=tokenizer.pad_token_id,
        )
        # A fresh LoRA adapter is the only trainable part; the (8-bit) base stays frozen. Its init is
        # drawn from the seed, so the same config gives the same adapter whatever ran before.
        set_seed(args.seed)
        model = add_lora(model, lora_args)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())

        training_args = SFTConfig(
            dataset_text_field="text",
            # "wrapped" packing: concatenate all reviews (EOS between them) and cut fixed-size blocks.
            packing=True,
            packing_strategy="wrapped",
            max_length=args.block_size,
            logging_first_step=True,
            **trainer_arguments(args, model_args, output_dir=str(out)),
        )
        metrics = MetricsLog(out, enabled=training_args.process_index == 0)
        planned_mb = planned_peak_mb("sft", config_dict(*configs), model_path, training_args.world_size)
        step_peak = StepPeak()
        trainer = SFTTrainer(
            model=model,
            args=training_args,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[metrics_callback(metrics), step_peak_callback(step_peak)],
        )
        quiet_progress(trainer)
        trainer.train()

        # Under DDP every rank must end with the same adapter: check it rather than assume it.
        adapter = get_peft_model_state_dict(trainer.accelerator.unwrap_model(trainer.model))
        digests = check_ranks_in_sync(adapter, "LoRA adapter weights")
        if trainer.is_world_process_zero():
            trainer.save_model(str(out))  # the adapter only: adapter_config.json + adapter_model.safetensors
            tokenizer.save_pretrained(out)
            save_run_config(out, model_args, lora_args, args, demo_args)
            save_run_info(
                out,
                {
                    "stage": "sft",
                    "resolved_model_path": model_path,
                    "train_blocks": len(trainer.train_dataset),
                    "trainable_parameters": trainable,
                    "total_parameters": total,
                    "world_size": training_args.world_size,
                    "rank_adapter_digests": digests,
                    "memory": memory_report(planned_mb, step_peak),
                },
            )
            plot_curves(
                metrics.rows,
                ["loss", "learning_rate", "grad_norm"],
                out / "loss.png",
                title=f"SFT: {model_args.model_name_or_path} on {args.dataset}",
            )
            losses = [r["loss"] for r in metrics.rows if "loss" in r]
            if losses:
                print(f"SFT done: loss {losses[0]:.3f} -> {losses[-1]:.3f}; adapter written to {args.output_dir}")


if __name__ == "__main__":
    main()
