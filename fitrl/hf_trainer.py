"""Glue for the stages that run on transformers' Trainer (trl's SFT, Reward, DPO and GRPO trainers).

They share most of their training settings (`fitrl.stages.base.TrainerSettings`); `trainer_arguments` maps them onto the
`TrainingArguments` fields in one place, with one rule for mixed precision (`trainer_precision`).
The callbacks hold fitrl's promises on top of trl's loop: checkpoints that are complete or skipped
(`checkpoint_extras`), a stop at the first non-finite value (`finite_guard`), the guards against a
run that trains silently wrong (`guard_callback`, `fitrl.guards`), a checkpoint and a clean stop on
SIGTERM (`train`).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fitrl import signals
from fitrl.checkpoints import (
    COMPLETE_FILE,
    check_checkpoint_files,
    checkpoint_root,
    is_complete,
    is_write_failure,
    save_failed,
    stopped,
)
from fitrl.config import RunFailed, Terminated, UsageError, save_run_config
from fitrl.distributed import cpu_only
from fitrl.guards import (
    GradientGuard,
    Health,
    Limit,
    Monitors,
    check_reference,
    check_reward_signal,
    check_trainable,
)
from fitrl.memory import StepPeak, optimizer_state_tensors
from fitrl.modeling import ModelArguments, torch_dtype
from fitrl.outputs import METRICS_NAME, MetricsLog, metrics_callback, read_jsonl, write_jsonl
from fitrl.signals import StopRequest


@dataclass(kw_only=True)
class TrainerRun:
    """What every stage on a trl trainer holds for the whole run beside its configs and inputs (the
    subclass's own fields, positional): the output being written, the trainer once built, its metrics,
    the memory plan and measurement, and what the guards saw."""

    out: Path | None = None
    trainer: Any = None
    metrics: MetricsLog | None = None
    planned_peak_mb: float | None = None
    step_peak: StepPeak = field(default_factory=StepPeak)
    health: Health = field(default_factory=Health)


def trainer_precision(model_args: ModelArguments) -> dict[str, bool]:
    """bf16 autocast exactly when the compute dtype resolves to bfloat16 (`dtype: auto` on a bf16 GPU too)."""
    return {"bf16": torch_dtype(model_args.dtype) == torch.bfloat16}


def trainer_arguments(args: Any, model_args: ModelArguments, output_dir: str) -> dict[str, Any]:
    """The `TrainingArguments` keywords every trl stage shares, from a stage's own settings `args`."""
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
        "logging_nan_inf_filter": False,  # a NaN loss must show (and stop the run: `finite_guard`)
        "save_strategy": "steps" if args.save_steps > 0 else "no",
        "save_steps": args.save_steps or 500,
        "report_to": args.report_to,
        "seed": args.seed,
        "use_cpu": cpu_only(),  # without it, DDP on a CPU-only machine silently runs as N lone processes
        "ddp_find_unused_parameters": False,
        **trainer_precision(model_args),
    }


TENSORBOARD_DIR_ENV = "TENSORBOARD_LOGGING_DIR"  # the one way transformers 5 takes the tensorboard directory


def trainer_callbacks(
    configs: tuple[Any, ...],
    metrics: MetricsLog,
    step_peak: StepPeak,
    output_dir: str,
    out: Path,
    health: Health,
    extra: Callable[[], dict[str, Any]] | None = None,
    reward_std_key: str | None = None,
    limits: list[Limit] | None = None,
) -> list[Any]:
    """What every trl stage adds to the Trainer: its metrics log (with `extra()` per row), complete
    checkpoints, the stop at a non-finite value, the guards (`health`; `reward_std_key`: the logged
    reward spread a policy stage learns from; `limits`: its in-run monitors) and the step-peak tracker.
    The tensorboard logs go into the staged output `out` (`<output_dir>/runs`, as PPO's), not beside
    the checkpoints; `train` unsets that again."""
    os.environ[TENSORBOARD_DIR_ENV] = str(out / "runs")
    health.strict = any(getattr(c, "strict_guards", False) for c in configs)
    return [
        metrics_callback(metrics, extra=extra),
        checkpoint_extras(configs, metrics),
        finite_guard(output_dir, fix="lower learning_rate or max_grad_norm"),
        guard_callback(health, reward_std_key, limits or []),
        step_peak_callback(step_peak),
    ]


def quiet_progress(trainer: Any) -> None:
    """Keep the Trainer's progress bar but not its printing of every log dict (metrics.jsonl has them)."""
    from transformers.trainer_callback import ProgressCallback

    class _BarOnly(ProgressCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kw: Any) -> None:
            pass

    if trainer.pop_callback(ProgressCallback) is not None:
        trainer.add_callback(_BarOnly())


def checkpoint_extras(configs: tuple[Any, ...], metrics: MetricsLog) -> Any:
    """A callback that completes every Trainer checkpoint: the run's metrics so far, a read-back of what
    the trainer wrote, then the run's settings as the last file (`fitrl.checkpoints.COMPLETE_FILE`).

    A save cut off by `kill -9` or a full disk leaves no settings file, so `latest` skips that checkpoint.
    A resume checks its settings against the saved ones (`fitrl.checkpoints.check_resume_config`) and
    starts its `metrics.jsonl` from the saved rows, so a resumed run reports its whole history.
    """
    from transformers import TrainerCallback

    def checkpoint(args: Any, state: Any) -> Path:
        return Path(args.output_dir) / f"checkpoint-{state.global_step}"

    class _Extras(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            # A save about to overwrite a checkpoint (a resumed run passing the same step) makes it
            # incomplete until it is done.
            if control.should_save and state.is_world_process_zero:
                (checkpoint(args, state) / COMPLETE_FILE).unlink(missing_ok=True)

        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.is_world_process_zero:
                path = checkpoint(args, state)
                write_jsonl(path / METRICS_NAME, metrics.rows)
                try:
                    check_checkpoint_files(path)
                except UsageError as e:
                    raise RunFailed(f"the checkpoint just saved does not read back: {e}") from None
                save_run_config(path, *configs)

    return _Extras()


def finite_guard(output_dir: str | Path, fix: str) -> Any:
    """A callback that stops the run at the first non-finite loss, gradient norm or trainable weight.

    transformers would log a NaN loss as the mean of the earlier ones (`logging_nan_inf_filter`, off in
    `trainer_arguments`) and train on; the weights are checked before the step's checkpoint is saved,
    so no checkpoint and no output holds a non-finite adapter.
    """
    from transformers import TrainerCallback

    def fail(what: str, state: Any) -> Exception:
        return stopped(f"non-finite {what}", state.global_step, output_dir, "checkpoint", fix)

    class _Finite(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            trainable = [p for p in model.parameters() if p.requires_grad] if model is not None else []
            if trainable and not all(bool(torch.isfinite(p).all()) for p in trainable):
                raise fail("trainable weights", state)

        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kw: Any) -> None:
            for key in ("loss", "grad_norm"):
                value = (logs or {}).get(key)
                if isinstance(value, (int, float)) and not math.isfinite(value):
                    raise fail(f"{key} ({value})", state)

    return _Finite()


def guard_callback(health: Health, reward_std_key: str | None = None, limits: Sequence[Limit] = ()) -> Any:
    """`fitrl.guards` on trl's loop: something to train before the first step, gradients before the
    first optimizer steps of this process, the first logged reward's spread (`reward_std_key`), and
    the in-run monitors (`limits`) on every logged row."""
    from transformers import TrainerCallback

    monitors = Monitors(health, list(limits))

    class _Guards(TrainerCallback):
        gradients: GradientGuard | None = None

        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            self.gradients = GradientGuard(health, sharded=bool(args.deepspeed or args.fsdp))
            if model is not None:
                check_trainable(model, health)

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            if model is not None and self.gradients is not None:
                self.gradients(model)

        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kw: Any) -> None:
            logs = logs or {}
            monitors(logs, state.global_step)
            if reward_std_key in logs and "reward_signal" not in health.seen:
                rewards = [logs.get("reward", 0.0)]
                std = float(logs[reward_std_key])
                check_reward_signal(rewards, health, state.global_step, std=std, where="logged step")

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            monitors.finish()

    return _Guards()


def reference_guard(trainer: Any, health: Health, keys: Sequence[str], scale: float, unit: str) -> None:
    """The `reference` guard on a trl trainer whose loss compares the policy with the adapter-off
    reference: at the first optimizer step of a fresh run, before any update, trl's first measured
    values of `keys` (DPO's beta-scaled log-ratios, GRPO's per-token KL) are ~0 once divided by `scale`.

    It reads the trainer's per-step metric lists (`_metrics`, trl's own accumulator, kept until the
    step's log): the logged row averages `logging_steps` steps, updates included."""
    from transformers import TrainerCallback

    class _Reference(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step != 1:  # a resumed run starts after updates
                return
            measured = getattr(trainer, "_metrics", {}).get("train", {})  # reading them costs nothing
            values = [measured[k][0] / scale for k in keys if measured.get(k)]
            if values:
                check_reference(max(values, key=abs), health, 1, what=f"{' / '.join(keys)}", unit=unit)

    trainer.add_callback(_Reference())


def stop_callback(request: StopRequest) -> Any:
    """A callback that, once SIGTERM came (on any rank), saves a checkpoint at the step's end and stops."""
    from transformers import TrainerCallback

    class _Stop(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if request.requested():
                control.should_save = True
                control.should_training_stop = True

    return _Stop()


def start_metrics(out: Path, is_main: bool, resume: str | None) -> MetricsLog:
    """The run's metrics log; a resumed run starts from the history its checkpoint kept."""
    metrics = MetricsLog(out, enabled=is_main)
    if resume is not None and (Path(resume) / METRICS_NAME).is_file():
        for row in read_jsonl(Path(resume) / METRICS_NAME):
            metrics.log(row)
    return metrics


def train(trainer: Any, metrics: MetricsLog, resume: str | None, output_dir: str, checkpoints_existed: bool) -> None:
    """trl's loop, from the checkpoint to resume from if any, stopping cleanly on SIGTERM; afterwards the
    run's loss over all its steps, and no empty checkpoint folder left behind."""
    resumed_at = int(Path(resume).name.rpartition("-")[2]) if resume is not None else 0
    keep_adapter_dtype_on_resume(trainer)
    try:
        with signals.stop_at_step_end() as request:
            trainer.add_callback(stop_callback(request))
            trainer.train(resume_from_checkpoint=resume)
    except Exception as e:
        if is_write_failure(e):  # what trl half-wrote goes (it has no completion mark: never `latest`)
            half = checkpoint_root(output_dir) / f"checkpoint-{trainer.state.global_step}"
            if half.is_dir() and not is_complete(half) and trainer.is_world_process_zero():
                shutil.rmtree(half, ignore_errors=True)
            raise save_failed(e, trainer.state.global_step, output_dir, "checkpoint") from None
        raise
    finally:
        os.environ.pop(TENSORBOARD_DIR_ENV, None)
        if not checkpoints_existed and trainer.is_world_process_zero():
            with contextlib.suppress(OSError):  # the trainer made it and saved nothing into it
                checkpoint_root(output_dir).rmdir()
    step = trainer.state.global_step
    if request.signal is not None:
        saved = checkpoint_root(output_dir) / f"checkpoint-{step}"
        raise Terminated(
            f"stopped by {request.signal} after step {step}; saved {saved}; resume with --resume_from_checkpoint latest"
        )
    if step <= resumed_at:
        raise RunFailed(
            "no optimizer step ran (the data fill less than one step of per_device_train_batch_size x "
            "gradient_accumulation_steps x processes); give more data, lower those, or set max_steps"
        )
    if resume is not None:
        loss = whole_run_train_loss(metrics.rows, resumed_at)
        if loss is not None:
            next(r for r in metrics.rows if "train_loss" in r)["train_loss"] = loss
            metrics.rewrite()


def keep_adapter_dtype_on_resume(trainer: Any) -> None:
    """A resumed run trains the adapter in the dtype the run began with.

    trl casts a quantized model's adapter to bf16 as it builds the trainer; peft's `load_adapter`, which
    the Trainer resumes with, casts the loaded adapter back to float32. Without this, a resumed run
    would go on in another precision than the run it continues (the optimizer state, loaded later,
    follows the parameters' dtype).
    """
    load = trainer._load_from_checkpoint

    def load_keeping_dtypes(*args: Any, **kwargs: Any) -> Any:
        dtypes = {n: p.dtype for n, p in trainer.model.named_parameters() if p.requires_grad}
        result = load(*args, **kwargs)
        for name, p in trainer.model.named_parameters():
            if name in dtypes and p.dtype != dtypes[name]:
                p.data = p.data.to(dtypes[name])
        return result

    trainer._load_from_checkpoint = load_keeping_dtypes


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
