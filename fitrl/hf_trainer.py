"""Glue for the stages that run on transformers' Trainer (trl's SFTTrainer and GRPOTrainer).

SFT and GRPO share most of their training settings; `trainer_arguments` maps them onto the
`TrainingArguments` fields in one place, with one rule for mixed precision (`trainer_precision`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fitrl.config import save_run_config
from fitrl.distributed import cpu_only
from fitrl.memory import StepPeak, optimizer_state_tensors
from fitrl.modeling import ModelArguments, torch_dtype
from fitrl.outputs import METRICS_NAME, MetricsLog, write_jsonl


def trainer_precision(model_args: ModelArguments) -> dict[str, bool]:
    """bf16 autocast exactly when the compute dtype resolves to bfloat16 (`dtype: auto` on a bf16 GPU too)."""
    return {"bf16": torch_dtype(model_args.dtype) == torch.bfloat16}


def trainer_arguments(args: Any, model_args: ModelArguments, output_dir: str) -> dict[str, Any]:
    """The `TrainingArguments` keywords SFT and GRPO share, from a stage's own settings `args`."""
    return {
        "output_dir": output_dir,
        "learning_rate": args.learning_rate,
        "num_train_epochs": args.num_train_epochs,
        "max_steps": args.max_steps,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        # The loader already turned on (non-reentrant) checkpointing on the base where asked.
        "activation_checkpointing": args.gradient_checkpointing,
        "activation_checkpointing_kwargs": {"use_reentrant": False},
        "optim": args.optim,
        "lr_scheduler_type": args.lr_scheduler_type,
        "warmup_steps": args.warmup_ratio,  # a float below 1 is a ratio of the steps
        "weight_decay": args.weight_decay,
        "max_grad_norm": args.max_grad_norm,
        "logging_steps": args.logging_steps,
        "save_strategy": "steps" if args.save_steps > 0 else "no",
        "save_steps": args.save_steps or 500,
        "report_to": args.report_to,
        "seed": args.seed,
        "use_cpu": cpu_only(),  # without it, DDP on a CPU-only machine silently runs as N lone processes
        "ddp_find_unused_parameters": False,
        **trainer_precision(model_args),
    }


def quiet_progress(trainer: Any) -> None:
    """Keep the Trainer's progress bar but not its printing of every log dict (metrics.jsonl has them)."""
    from transformers.trainer_callback import ProgressCallback

    class _BarOnly(ProgressCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kw: Any) -> None:
            pass

    if trainer.pop_callback(ProgressCallback) is not None:
        trainer.add_callback(_BarOnly())


def checkpoint_extras(configs: tuple[Any, ...], metrics: MetricsLog) -> Any:
    """A callback that adds to every Trainer checkpoint the run's settings and its metrics so far.

    A resume checks its settings against the first (`fitrl.checkpoints.check_resume_config`) and
    starts its `metrics.jsonl` from the second, so a resumed run reports its whole history.
    """
    from transformers import TrainerCallback

    class _Extras(TrainerCallback):
        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.is_world_process_zero:
                checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
                save_run_config(checkpoint, *configs)
                write_jsonl(checkpoint / METRICS_NAME, metrics.rows)

    return _Extras()


def whole_run_train_loss(rows: list[dict[str, Any]], resumed_at: int) -> float | None:
    """The mean training loss over every step, for a run resumed at step `resumed_at`.

    The Trainer's own `train_loss` averages only the steps this process ran; the steps before the
    resume are in the logged rows, each `loss` covering the steps since the previous log.
    """
    summary = next((r for r in rows if "train_loss" in r), None)
    if summary is None or summary["step"] <= resumed_at:
        return None
    before, last = 0.0, 0
    for r in rows:
        if "loss" in r and r["step"] <= resumed_at:
            before += r["loss"] * (r["step"] - last)
            last = r["step"]
    return (before + summary["train_loss"] * (summary["step"] - resumed_at)) / summary["step"]


def step_peak_callback(step_peak: StepPeak) -> Any:
    """Track the first step that starts with optimizer states in memory (the second of a fresh run)."""
    from transformers import TrainerCallback

    class _TrackStep(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            model, optimizer = kwargs.get("model"), kwargs.get("optimizer")
            if state.global_step >= 1 and step_peak.peak_bytes is None and model is not None and optimizer is not None:
                step_peak.start([*model.parameters(), *model.buffers(), *optimizer_state_tensors(optimizer)])

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            step_peak.stop()

    return _TrackStep()
