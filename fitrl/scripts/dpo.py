"""DPO: the RLHF menu's shortcut. A LoRA adapter on the frozen (8-bit) model learns straight from
preference pairs, without a reward model and without sampling (trl's `DPOTrainer`).

The loss raises the policy's log-ratio to the reference on the chosen text above the rejected one's:
-log sigmoid(beta * ([log pi(c) - log ref(c)] - [log pi(r) - log ref(r)])). The reference is the
same model with the adapter off, so no second copy is loaded; `precompute_ref_log_probs` scores every
pair with it once before training instead of in every step.

    # the embedded demo, on a CPU in about a minute
    accelerate launch scripts/dpo.py --config configs/demo/dpo.yaml
    # gpt-neox-20b in 8-bit on one 24 GB card, on the merged SFT model
    accelerate launch scripts/dpo.py --config configs/neox20b-24gb/dpo.yaml
    # continue a stopped run from its last checkpoint
    accelerate launch scripts/dpo.py --config configs/neox20b-24gb/dpo.yaml --resume_from_checkpoint latest

Writes to `output_dir`: the adapter, the tokenizer, `eval.json` (held-out pairs: the implicit reward's
accuracy and margin, both 0-based at the start), `run_config.yaml`, `run_info.json`, `metrics.jsonl`,
`dpo_curves.png`. Checkpoints (`save_steps`) go to `<output_dir>.checkpoints/`. The `eval_dpo` stage
then answers held-out prompts with the policy and its reference, as PPO's evaluation does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fitrl.artifacts import DPOEval, carved_note, to_dict
from fitrl.checkpoints import checkpoint_root
from fitrl.config import config_of
from fitrl.data import carved_from, split_name
from fitrl.demo import DemoArguments
from fitrl.ending import TrainingEnd, finish_training
from fitrl.hf_trainer import (
    TrainerRun,
    quiet_progress,
    reference_guard,
    start_metrics,
    trainer_arguments,
    trainer_callbacks,
)
from fitrl.hf_trainer import train as train_with_guards
from fitrl.hub import push_output
from fitrl.memory import memory_report
from fitrl.modeling import LoraArguments, ModelArguments, add_lora, load_causal_lm
from fitrl.outputs import staged_output_dir
from fitrl.planner import planned_peak_mb
from fitrl.process import entrypoint
from fitrl.stages.dpo import STAGE, DPOArguments
from fitrl.tasks.preferences import PairInputs, PreferenceArguments, pad_multiple, pair_inputs


@dataclass
class Run(TrainerRun):
    """What lives for the whole run: configs, inputs, and the trainer once built."""

    model_args: ModelArguments
    lora_args: LoraArguments
    data_args: PreferenceArguments
    args: DPOArguments
    demo_args: DemoArguments
    inputs: PairInputs

    @property
    def configs(self) -> tuple[Any, ...]:
        return (self.model_args, self.lora_args, self.data_args, self.args, self.demo_args)


def preflight(configs: tuple[Any, ...]) -> Run:
    """Every input checked before anything heavy loads: the output, the checkpoint, the model, every pair."""
    return Run(*configs, pair_inputs(configs, config_of(configs, DPOArguments), STAGE.checkpoint_prefix, "DPO"))


def build(run: Run) -> None:
    """The frozen (8-bit) base, a fresh LoRA adapter (off: the reference), and trl's `DPOTrainer`."""
    from transformers import set_seed
    from trl import DPOConfig, DPOTrainer

    args = run.args
    model = load_causal_lm(
        run.model_args,
        path=run.inputs.model_path,
        gradient_checkpointing=args.gradient_checkpointing,
        pad_token_id=run.inputs.tokenizer.pad_token_id,
    )
    set_seed(args.seed)
    model = add_lora(model, run.lora_args)
    training_args = DPOConfig(
        beta=args.beta,
        # RPO when sft_weight > 0: trl sums the listed losses with these weights.
        loss_type=[args.loss_type, "sft"] if args.sft_weight > 0 else [args.loss_type],
        loss_weights=[1.0, args.sft_weight] if args.sft_weight > 0 else None,
        label_smoothing=args.label_smoothing,
        precompute_ref_log_probs=args.precompute_ref_log_probs,
        pad_to_multiple_of=pad_multiple(run.data_args),
        max_length=None,  # `preflight` dropped and counted the long pairs; trl would cut them silently
        per_device_eval_batch_size=args.per_device_train_batch_size,
        logging_first_step=True,
        **trainer_arguments(args, run.model_args, output_dir=str(checkpoint_root(args.output_dir))),
    )
    run.metrics = start_metrics(run.out, training_args.process_index == 0, run.inputs.resume)
    run.planned_peak_mb = planned_peak_mb(STAGE, run.configs, run.inputs.model_path, training_args.world_size)
    run.trainer = DPOTrainer(
        model=model,
        args=training_args,
        train_dataset=run.inputs.train_pairs,
        eval_dataset=run.inputs.eval_pairs,
        processing_class=run.inputs.tokenizer,
        callbacks=trainer_callbacks(run.configs, run.metrics, run.step_peak, args.output_dir, run.out, run.health),
    )
    # trl's first rewards are beta x each pair's log-ratio to the reference: per token of max_length here.
    scale = args.beta * run.data_args.max_length
    reference_guard(run.trainer, run.health, ["rewards/chosen", "rewards/rejected"], scale, "per token")
    quiet_progress(run.trainer)


def evaluate(run: Run) -> DPOEval:
    """Held-out pairs under the trained policy: how often its implicit reward, beta x the log-ratio to the
    reference, ranks chosen above rejected, and by how much (both measured against 0: at the start the
    policy is the reference)."""
    found = run.trainer.evaluate()
    rows = run.metrics.rows
    if rows and any(key.startswith("eval_") for key in rows[-1]):  # the evaluation's row: eval.json has it
        rows.pop()
        run.metrics.rewrite()
    return DPOEval(
        split=split_name(run.data_args.dataset, run.data_args.eval_split),
        carved_from=carved_from(run.data_args.dataset, run.data_args.eval_split),
        n_pairs=len(run.inputs.eval_pairs),
        accuracy=found["eval_rewards/accuracies"],
        margin=found["eval_rewards/margins"],
        reward_chosen=found["eval_rewards/chosen"],
        reward_rejected=found["eval_rewards/rejected"],
        beta=run.args.beta,
    )


def finish(run: Run) -> None:
    """The held-out evaluation; the ranks agree; the adapter, tokenizer, settings, run_info, evaluation
    and curves are written."""
    from peft import get_peft_model_state_dict

    trainer = run.trainer
    model = trainer.accelerator.unwrap_model(trainer.model)
    report = evaluate(run)
    end = TrainingEnd(
        stage=STAGE.name,
        configs=run.configs,
        model_path=run.inputs.model_path,
        world_size=trainer.args.world_size,
        trained=get_peft_model_state_dict(model),
        save_weights=lambda out: trainer.save_model(str(out)),
        tokenizer=run.inputs.tokenizer,
        trainable_parameters=sum(p.numel() for p in model.parameters() if p.requires_grad),
        memory=memory_report(run.planned_peak_mb, run.step_peak),
        metrics=run.metrics.rows,
        resumed_from=run.inputs.resume,
        health=run.health,
        curves=["loss", "rewards/margins", "rewards/accuracies", "rewards/chosen", "rewards/rejected"],
        plot=STAGE.plot,
        title=f"DPO: {run.model_args.model_name_or_path} on {run.data_args.dataset}",
        summary=(
            f"DPO done: held-out implicit-reward accuracy {report.accuracy:.1%}, margin {report.margin:.3f} "
            f"on {report.n_pairs} pairs{carved_note(report.split, report.carved_from)}; adapter written to "
            f"{run.args.output_dir}"
        ),
        details={
            "train_pairs": len(run.inputs.train_pairs),
            "dropped_long_pairs": run.inputs.dropped,
            "eval": to_dict(report),
        },
    )
    finish_training(end, run.out, trainer.is_world_process_zero())
    if trainer.is_world_process_zero():
        report.write(run.out)


@entrypoint
def main(argv: list[str] | None = None) -> None:
    run = preflight(STAGE.parse(argv))
    with staged_output_dir(run.args.output_dir, run.args.overwrite_output_dir, stage=STAGE.name) as run.out:
        build(run)
        train_with_guards(
            run.trainer, run.metrics, run.inputs.resume, run.args.output_dir, run.inputs.checkpoints_existed
        )
        finish(run)
    push_output(run.args, run.args.output_dir, STAGE.name)


if __name__ == "__main__":
    main()
