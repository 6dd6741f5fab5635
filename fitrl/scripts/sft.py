"""Stage 1 of the RLHF pipeline: LoRA causal-LM fine-tuning of a frozen (8-bit) base on movie reviews.

The recipe of "Fine-tuning 20B LLMs with RLHF on a 24GB consumer GPU": the base model is loaded in
8-bit and frozen, a LoRA adapter on the attention projections learns to continue IMDB reviews, and
the reviews are packed into fixed-length blocks so no compute is spent on padding.

    # the embedded demo, on a CPU in about a minute
    accelerate launch scripts/sft.py --config configs/demo/sft.yaml
    # the real job: gpt-neox-20b in 8-bit on one 24 GB card
    accelerate launch scripts/sft.py --config configs/neox20b-24gb/sft.yaml
    # two processes with DDP (also on a CPU machine, over gloo)
    accelerate launch --multi_gpu --num_processes 2 scripts/sft.py --config configs/demo/sft.yaml
    # continue a stopped run from its last checkpoint
    accelerate launch scripts/sft.py --config configs/neox20b-24gb/sft.yaml --resume_from_checkpoint latest

Any key of the YAML file can be overridden on the command line, e.g. `--max_steps 50`.
Writes to `output_dir`: the adapter (peft), the tokenizer, `run_config.yaml`, `run_info.json`,
`metrics.jsonl`, `loss.png`. Checkpoints (`save_steps`) go to `<output_dir>.checkpoints/`, outside the
staged output, so a stopped run keeps them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fitrl.chat import check_chats, use_chat_template
from fitrl.checkpoints import checkpoint_root, resume_checkpoint
from fitrl.config import config_dict
from fitrl.data import load_dataset_any, require_columns, text_rows
from fitrl.demo import DemoArguments
from fitrl.distributed import process_state
from fitrl.ending import TrainingEnd, finish_training
from fitrl.hf_trainer import TrainerRun, quiet_progress, start_metrics, trainer_arguments, trainer_callbacks
from fitrl.hf_trainer import train as train_with_guards
from fitrl.hub import push_output
from fitrl.memory import memory_report
from fitrl.modeling import LoraArguments, ModelArguments, add_lora, load_causal_lm, load_tokenizer, resolve_model_path
from fitrl.outputs import check_output_dir, staged_output_dir
from fitrl.planner import planned_peak_mb
from fitrl.process import entrypoint
from fitrl.stages.sft import STAGE, SFTArguments


@dataclass
class Run(TrainerRun):
    """What lives for the whole run: configs, inputs, and the trainer once built."""

    model_args: ModelArguments
    lora_args: LoraArguments
    args: SFTArguments
    demo_args: DemoArguments
    model_path: str
    dataset: Any
    tokenizer: Any
    resume: str | None
    checkpoints_existed: bool

    @property
    def configs(self) -> tuple[Any, ...]:
        return (self.model_args, self.lora_args, self.args, self.demo_args)


def preflight(configs: tuple[Any, ...]) -> Run:
    """Every input checked before anything heavy loads: a typo should cost a second, not a model load."""
    model_args, lora_args, args, demo_args = configs
    check_output_dir(
        args.output_dir,
        args.overwrite_output_dir,
        [model_args.model_name_or_path, args.dataset, args.resume_from_checkpoint],
        demo_args.demo_assets,
    )
    resume = resume_checkpoint(
        args.resume_from_checkpoint, args.output_dir, STAGE.checkpoint_prefix, "SFT", config_dict(*configs)
    )
    checkpoints_existed = checkpoint_root(args.output_dir).exists()
    model_path = resolve_model_path(model_args.model_name_or_path, demo_args.demo_assets)
    dataset, chats = examples(args, demo_args.demo_assets)
    tokenizer = load_tokenizer(model_path, model_args.trust_remote_code)
    if chats and use_chat_template(tokenizer, args.chat_template) and process_state().is_main_process:
        print("SFT: the tokenizer has no chat template: the plain Question/Answer one renders the chats")
    return Run(*configs, model_path, dataset, tokenizer, str(resume) if resume else None, checkpoints_existed)


def examples(args: SFTArguments, demo_assets: str) -> tuple[Any, bool]:
    """The training examples, and whether they are chats: a `text` column, or a `messages` column of chats
    (each row checked) that trl renders with the chat template."""
    ds = load_dataset_any(args.dataset, args.dataset_split, demo_assets, carve=False)
    require_columns(ds, [args.text_column], args.dataset)
    if not check_chats(ds[args.text_column], args.text_column, prompt=False):
        return text_rows(ds, args.dataset, args.text_column, args.max_samples), False
    ds = ds.select_columns([args.text_column]).filter(lambda r: r[args.text_column] is not None)
    ds = ds.rename_column(args.text_column, "messages") if args.text_column != "messages" else ds
    return ds.select(range(min(args.max_samples or len(ds), len(ds)))), True


def build(run: Run) -> None:
    """The frozen (8-bit) base, a fresh LoRA adapter on it, and trl's `SFTTrainer` over packed blocks."""
    from transformers import set_seed
    from trl import SFTConfig, SFTTrainer

    args = run.args
    model = load_causal_lm(
        run.model_args,
        path=run.model_path,
        gradient_checkpointing=args.gradient_checkpointing,
        pad_token_id=run.tokenizer.pad_token_id,
    )
    # A fresh LoRA adapter is the only trainable part; the (8-bit) base stays frozen. Its init is
    # drawn from the seed, so the same config gives the same adapter whatever ran before.
    set_seed(args.seed)
    model = add_lora(model, run.lora_args)
    training_args = SFTConfig(
        dataset_text_field="text",
        # "wrapped" packing: concatenate all reviews (EOS between them) and cut fixed-size blocks.
        packing=True,
        packing_strategy="wrapped",
        max_length=args.block_size,
        logging_first_step=True,
        **trainer_arguments(args, run.model_args, output_dir=str(checkpoint_root(args.output_dir))),
    )
    run.metrics = start_metrics(run.out, training_args.process_index == 0, run.resume)
    run.planned_peak_mb = planned_peak_mb(STAGE, run.configs, run.model_path, training_args.world_size)
    run.trainer = SFTTrainer(
        model=model,
        args=training_args,
        train_dataset=run.dataset,
        processing_class=run.tokenizer,
        callbacks=trainer_callbacks(run.configs, run.metrics, run.step_peak, args.output_dir, run.out, run.health),
    )
    quiet_progress(run.trainer)


def finish(run: Run) -> None:
    """The ranks agree; the adapter, tokenizer, settings, run_info and loss curve are written."""
    from peft import get_peft_model_state_dict

    trainer = run.trainer
    model = trainer.accelerator.unwrap_model(trainer.model)
    losses = [r["loss"] for r in run.metrics.rows if "loss" in r]
    end = TrainingEnd(
        stage=STAGE.name,
        configs=run.configs,
        model_path=run.model_path,
        world_size=trainer.args.world_size,
        trained=get_peft_model_state_dict(model),
        save_weights=lambda out: trainer.save_model(str(out)),  # the adapter: adapter_config.json + safetensors
        tokenizer=run.tokenizer,
        trainable_parameters=sum(p.numel() for p in model.parameters() if p.requires_grad),
        memory=memory_report(run.planned_peak_mb, run.step_peak),
        metrics=run.metrics.rows,
        resumed_from=run.resume,
        health=run.health,
        curves=["loss", "learning_rate", "grad_norm"],
        plot=STAGE.plot,
        title=f"SFT: {run.model_args.model_name_or_path} on {run.args.dataset}",
        summary=f"SFT done: loss {losses[0]:.3f} -> {losses[-1]:.3f}; adapter written to {run.args.output_dir}"
        if losses  # rank 0 logs them
        else "SFT done",
        details={
            "train_blocks": len(trainer.train_dataset),
            "total_parameters": sum(p.numel() for p in model.parameters()),
        },
    )
    finish_training(end, run.out, trainer.is_world_process_zero())


@entrypoint
def main(argv: list[str] | None = None) -> None:
    run = preflight(STAGE.parse(argv))
    with staged_output_dir(run.args.output_dir, run.args.overwrite_output_dir, stage=STAGE.name) as run.out:
        build(run)
        train_with_guards(run.trainer, run.metrics, run.resume, run.args.output_dir, run.checkpoints_existed)
        finish(run)
    push_output(run.args, run.args.output_dir, STAGE.name)


if __name__ == "__main__":
    main()
