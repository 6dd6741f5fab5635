"""The reward-model stage of RLHF: a LoRA adapter and a scalar score head on the frozen (8-bit) model PPO
will start from learn, from preference pairs, which of two continuations people prefer.

The Bradley-Terry loss of trl's `RewardTrainer`: -log sigmoid(r(chosen) - r(rejected)), minus a margin
when the data give one. The score head is trained and saved with the adapter (peft's
`modules_to_save`), so the reward model is an adapter of a few MB on the policy's own base: PPO can
score with it without loading a second model.

    # the embedded demo, on a CPU in under a minute
    accelerate launch scripts/rm.py --config configs/demo/rm.yaml
    # gpt-neox-20b in 8-bit on one 24 GB card, on the merged SFT model
    accelerate launch scripts/rm.py --config configs/neox20b-24gb/rm.yaml
    # continue a stopped run from its last checkpoint
    accelerate launch scripts/rm.py --config configs/neox20b-24gb/rm.yaml --resume_from_checkpoint latest

Writes to `output_dir`: the adapter with the score head, the tokenizer, `eval.json` (held-out pair
accuracy, reward margins, per-pair rewards, calibration error), `rewards_hist.png`, `calibration.png`,
`run_config.yaml`, `run_info.json` (with the reload check), `metrics.jsonl`, `loss.png`. Checkpoints
(`save_steps`) go to `<output_dir>.checkpoints/`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fitrl.artifacts import RMEval, carved_note, to_dict
from fitrl.checkpoints import checkpoint_root
from fitrl.config import RunFailed, config_of
from fitrl.data import carved_from, split_name
from fitrl.demo import DemoArguments
from fitrl.ending import TrainingEnd, finish_training
from fitrl.hf_trainer import TrainerRun, quiet_progress, start_metrics, trainer_arguments, trainer_callbacks
from fitrl.hf_trainer import train as train_with_guards
from fitrl.hub import push_output
from fitrl.memory import memory_report
from fitrl.modeling import (
    SCORE_HEAD,
    LoraArguments,
    ModelArguments,
    load_causal_lm,
    lora_config,
    unloaded_bitsandbytes_hidden,
)
from fitrl.outputs import plot_histograms, staged_output_dir
from fitrl.planner import planned_peak_mb
from fitrl.process import entrypoint
from fitrl.reward import probes
from fitrl.reward.adapter import score_texts
from fitrl.stages.rm import STAGE, RMArguments
from fitrl.tasks.preferences import PairInputs, PreferenceArguments, pad_multiple, pair_inputs, pair_texts


@dataclass
class Run(TrainerRun):
    """What lives for the whole run: configs, inputs, and the trainer once built."""

    model_args: ModelArguments
    lora_args: LoraArguments
    data_args: PreferenceArguments
    args: RMArguments
    demo_args: DemoArguments
    inputs: PairInputs

    @property
    def configs(self) -> tuple[Any, ...]:
        return (self.model_args, self.lora_args, self.data_args, self.args, self.demo_args)


def preflight(configs: tuple[Any, ...]) -> Run:
    """Every input checked before anything heavy loads: the output, the checkpoint, the model, every pair."""
    return Run(*configs, pair_inputs(configs, config_of(configs, RMArguments), STAGE.checkpoint_prefix, "reward model"))


def build(run: Run) -> None:
    """The frozen (8-bit) base with a scalar score head, a fresh LoRA adapter that trains the head too,
    and trl's `RewardTrainer`."""
    from peft import get_peft_model
    from transformers import set_seed
    from trl import RewardConfig, RewardTrainer

    args = run.args
    model = load_causal_lm(
        run.model_args,
        path=run.inputs.model_path,
        gradient_checkpointing=args.gradient_checkpointing,
        pad_token_id=run.inputs.tokenizer.pad_token_id,
        score_head=True,
    )
    # The score head is drawn from the seed, as the LoRA init is: the same config gives the same model.
    set_seed(args.seed)
    model.score.reset_parameters()
    with unloaded_bitsandbytes_hidden():
        # SEQ_CLS: peft trains and saves the score head beside the adapter (modules_to_save).
        model = get_peft_model(model, lora_config(run.lora_args, model.config.model_type, task_type="SEQ_CLS"))
    training_args = RewardConfig(
        pad_to_multiple_of=pad_multiple(run.data_args),
        max_length=None,  # `preflight` dropped and counted the long pairs; trl would drop them silently
        center_rewards_coefficient=args.center_rewards_coefficient,
        logging_first_step=True,
        **trainer_arguments(args, run.model_args, output_dir=str(checkpoint_root(args.output_dir))),
    )
    run.metrics = start_metrics(run.out, training_args.process_index == 0, run.inputs.resume)
    run.planned_peak_mb = planned_peak_mb(STAGE, run.configs, run.inputs.model_path, training_args.world_size)
    run.trainer = RewardTrainer(
        model=model,
        args=training_args,
        train_dataset=run.inputs.train_pairs,
        processing_class=run.inputs.tokenizer,
        callbacks=trainer_callbacks(run.configs, run.metrics, run.step_peak, args.output_dir, run.out, run.health),
    )
    # trl casts a quantized model's trainable weights to bf16 (QLoRA's advice for the adapter); the score
    # head reads the fp32 hidden states of the k-bit-prepared model, and one scalar needs the precision.
    for name, p in run.trainer.model.named_parameters():
        if p.requires_grad and SCORE_HEAD in name.split("."):
            p.data = p.data.float()
    quiet_progress(run.trainer)


@torch.no_grad()
def score(model: Any, tokenizer: Any, texts: list[str], batch_size: int) -> torch.Tensor:
    """The reward of each text, scored as trl trains it and as PPO's reward adapter scores (one function)."""
    model.eval()
    return score_texts(model, tokenizer, texts, batch_size, next(p for p in model.parameters()).device)


def evaluate(run: Run) -> RMEval:
    """Held-out pairs: how often the chosen text scores higher, by how much, and every pair's rewards."""
    model = run.trainer.accelerator.unwrap_model(run.trainer.model)
    chosen, rejected = zip(*(pair_texts(row) for row in run.inputs.eval_pairs))
    r_chosen = score(model, run.inputs.tokenizer, list(chosen), run.args.eval_batch_size)
    r_rejected = score(model, run.inputs.tokenizer, list(rejected), run.args.eval_batch_size)
    margins = r_chosen - r_rejected
    pairs = [{"chosen": c, "rejected": r} for c, r in zip(r_chosen.tolist(), r_rejected.tolist())]
    return RMEval(
        split=split_name(run.data_args.dataset, run.data_args.eval_split),
        carved_from=carved_from(run.data_args.dataset, run.data_args.eval_split),
        n_pairs=len(margins),
        accuracy=(margins > 0).float().mean().item(),
        margin_mean=margins.mean().item(),
        reward_chosen_mean=r_chosen.mean().item(),
        reward_rejected_mean=r_rejected.mean().item(),
        reward_std=torch.cat([r_chosen, r_rejected]).std().item(),
        pairs=pairs,
        calibration_error=calibration(pairs)[1],
    )


# A reloaded reward model scores as the trained one up to float noise; a head or adapter that did not save
# (a random head, a missing LoRA) is off by orders of magnitude more.
RELOAD_TOLERANCE = 1e-3


def calibration(pairs: list[dict[str, float]], bins: int = 10) -> tuple[list[tuple[float, float, int]], float]:
    """How well the Bradley-Terry probability the reward model implies, sigmoid(r_chosen - r_rejected),
    matches how often the labelled text wins: each pair counted in both orders, grouped in `bins` by that
    probability. Per non-empty bin (mean probability, share won, pairs), and the expected calibration
    error (the bins' gaps weighted by their pairs)."""
    seen = []
    for p in pairs:
        won = 1 / (1 + math.exp(-(p["chosen"] - p["rejected"])))
        seen += [(won, 1.0), (1 - won, 0.0)]
    rows = []
    for b in range(bins):
        inside = [(q, y) for q, y in seen if b / bins <= q < (b + 1) / bins or (b == bins - 1 and q == 1.0)]
        if inside:
            rows.append((sum(q for q, _ in inside) / len(inside), sum(y for _, y in inside) / len(inside), len(inside)))
    error = sum(abs(q - y) * n for q, y, n in rows) / len(seen)
    return rows, error


def plot_calibration(rows: list[tuple[float, float, int]], error: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 4))
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", label="calibrated")
    ax.plot([q for q, _, _ in rows], [y for _, y, _ in rows], marker="o", label=f"reward model (ECE {error:.3f})")
    ax.set_xlabel("sigmoid(reward difference)")
    ax.set_ylabel("share the labelled text won")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


PROBE_PAIRS = 16  # held-out pairs whose chosen texts the pre-flight builds its probes from


def reward_preflight(run: Run, model: Any) -> dict[str, Any]:
    """The reward pre-flight (`fitrl.reward.probes`) on the trained reward model: degenerate continuations
    of held-out prompts (a negated copy among them: can it read a negation?) beside their chosen texts."""
    rows = run.inputs.eval_pairs.select(range(min(PROBE_PAIRS, len(run.inputs.eval_pairs))))
    prompts = [row.get("prompt") or "" for row in rows]

    def scores(indices: list[int], texts: list[str]) -> list[float]:
        whole = [prompts[i] + t for i, t in zip(indices, texts)]
        return score(model, run.inputs.tokenizer, whole, run.args.eval_batch_size).tolist()

    with run.health.timed():
        found = probes.run_probes(scores, prompts, [row["chosen"] for row in rows], True, False)
    probes.check_probes(found, run.health)
    return found.to_json()


def save_reward_model(trainer: Any, out: Path) -> None:
    """The adapter and its score head (trl's save: adapter_config.json, LoRA and head weights)."""
    trainer.save_model(str(out))


def check_reload(run: Run, model: Any, report: RMEval, out: Path) -> dict[str, Any]:
    """The saved adapter and head, loaded back from `out` beside the trained ones, must score the held-out
    pairs as the evaluation did, or nothing is written: a reward model that is not what its figures
    measured would mislead PPO silently. Returns what it found, for run_info.json."""
    chosen, rejected = zip(*(pair_texts(row) for row in run.inputs.eval_pairs))
    evaluated = torch.tensor([[p["chosen"], p["rejected"]] for p in report.pairs])
    model.load_adapter(str(out), adapter_name="reloaded")
    try:
        model.set_adapter("reloaded")
        reloaded = torch.stack(
            [score(model, run.inputs.tokenizer, list(texts), run.args.eval_batch_size) for texts in (chosen, rejected)],
            dim=1,
        )
    finally:
        model.set_adapter("default")
        model.delete_adapter("reloaded")
    diff = (reloaded - evaluated).abs().max().item()
    accuracy = (reloaded[:, 0] > reloaded[:, 1]).float().mean().item()
    if not diff <= RELOAD_TOLERANCE * (1 + evaluated.abs().max().item()):
        raise RunFailed(
            f"the saved reward model does not score as the trained one (held-out accuracy {report.accuracy:.1%} "
            f"trained, {accuracy:.1%} reloaded; rewards differ by up to {diff:.3g}); nothing was written"
        )
    return {"reload_check": {"max_reward_diff": diff, "accuracy": accuracy}}


def finish(run: Run) -> None:
    """The held-out evaluation; the ranks agree; the adapter with its head, tokenizer, settings, run_info,
    evaluation and plots are written."""
    from peft import get_peft_model_state_dict

    trainer = run.trainer
    model = trainer.accelerator.unwrap_model(trainer.model)
    report = evaluate(run)
    preflight = reward_preflight(run, model)
    losses = [r["loss"] for r in run.metrics.rows if "loss" in r]
    end = TrainingEnd(
        stage=STAGE.name,
        configs=run.configs,
        model_path=run.inputs.model_path,
        world_size=trainer.args.world_size,
        trained=get_peft_model_state_dict(model),
        save_weights=lambda out: saved(out),
        tokenizer=run.inputs.tokenizer,
        trainable_parameters=sum(p.numel() for p in model.parameters() if p.requires_grad),
        memory=memory_report(run.planned_peak_mb, run.step_peak),
        metrics=run.metrics.rows,
        resumed_from=run.inputs.resume,
        health=run.health,
        curves=["loss", "accuracy", "margin", "grad_norm"],
        plot=STAGE.plot,
        title=f"Reward model: {run.model_args.model_name_or_path} on {run.data_args.dataset}",
        summary=(
            f"reward model done: held-out pair accuracy {report.accuracy:.1%} on {report.n_pairs} pairs"
            f"{carved_note(report.split, report.carved_from)} (mean margin {report.margin_mean:.2f}); adapter "
            f"written to {run.args.output_dir}"
        ),
        details={
            "train_pairs": len(run.inputs.train_pairs),
            "dropped_long_pairs": run.inputs.dropped,
            "chat_pairs": run.inputs.chat,  # PPO warns when its prompts are not what this read
            probes.DETAILS_KEY: preflight,
            "eval": {k: v for k, v in to_dict(report).items() if k != "pairs"},
            "first_loss": losses[0] if losses else None,
        },
    )

    def saved(out: Path) -> None:
        save_reward_model(trainer, out)
        end.details.update(check_reload(run, model, report, out))

    finish_training(end, run.out, trainer.is_world_process_zero())
    if trainer.is_world_process_zero():
        report.write(run.out)
        plot_histograms(
            {
                "chosen": [p["chosen"] for p in report.pairs],
                "rejected": [p["rejected"] for p in report.pairs],
            },
            run.out / "rewards_hist.png",
            f"reward on held-out pairs ({report.split})",
            "texts",
        )
        plot_calibration(*calibration(report.pairs), run.out / "calibration.png")


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
