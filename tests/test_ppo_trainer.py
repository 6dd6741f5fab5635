"""The PPO engine on its own (`fitrl.ppo.trainer`), no stage program: a tiny policy, prompts as token ids
and a reward written here. Its state is what a checkpoint holds, and a run resumed from one is the run
that never stopped, bit for bit."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from fitrl.guards import Health, Monitors
from fitrl.modeling import LoraArguments, add_lora, load_tokenizer, make_optimizer
from fitrl.outputs import MetricsLog
from fitrl.ppo import metrics
from fitrl.ppo.step import PolicyAndValue
from fitrl.ppo.trainer import PPOState, PPOTrainer, Prompts, Sampling
from fitrl.stages.ppo import PPOArguments

LM = Path(__file__).parents[1] / "fitrl" / "demo" / "assets" / "lm"
PROMPTS = ["The film was", "I thought the acting", "This movie is", "The plot", "What a", "The ending felt"]


class VowelReward:
    """A `Reward` of this test's own: the share of vowels in each response, plus a per-prompt bonus read
    from the prompts' `bonus` column (so a column reaching the reward is seen in the scores)."""

    tokenizer = None
    rendered = False  # it reads the text as a user sees it

    def __init__(self) -> None:
        self.seen: list[tuple[str, float]] = []

    def score(
        self, queries: Sequence[str], responses: Sequence[str], columns: Mapping[str, Sequence[Any]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.seen += list(zip(queries, columns["bonus"]))
        shares = [sum(c in "aeiou" for c in r) / max(len(r), 1) for r in responses]
        scores = torch.tensor([s + b for s, b in zip(shares, columns["bonus"])])
        return scores, scores > 0

    def tensors(self) -> list[torch.Tensor]:
        return []


def trainer_for(out: Path, steps: int = 4, save_steps: int = 2) -> tuple[PPOTrainer, VowelReward]:
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(str(LM))
    args = PPOArguments(
        output_dir=str(out),
        steps=steps,
        batch_size=4,
        mini_batch_size=2,
        forward_batch_size=2,
        ppo_epochs=2,
        learning_rate=1e-2,
        init_kl_coef=0.05,
        target_kl=1.0,
        kl_horizon=50,
        score_scaling="normalize",
        save_steps=save_steps,
        report_to="none",
        log_samples=2,
        seed=3,
    )
    lm = AutoModelForCausalLM.from_pretrained(LM, dtype=torch.float32)
    torch.manual_seed(args.seed)
    model = PolicyAndValue(add_lora(lm, LoraArguments(lora_r=4, lora_dropout=0.0)), lm.config.hidden_size)
    prompts = Prompts([tokenizer(p).input_ids for p in PROMPTS], {"bonus": [float(i) for i in range(len(PROMPTS))]})
    reward, health = VowelReward(), Health()
    out.mkdir(parents=True, exist_ok=True)
    trainer = PPOTrainer(
        model,
        make_optimizer(model, "adamw", args.learning_rate),
        Accelerator(cpu=True),
        args,
        tokenizer,
        prompts,
        reward,
        Sampling(3, 6),
        health=health,
        monitors=Monitors(health, []),
        metrics_log=MetricsLog(out),
        configs=(args,),
        checkpoint_prefix="step",
    )
    trainer.guards["readings"] = Readings()
    return trainer, reward


class Readings:
    """A caller's guard with a state of its own (as the reward-hacking guard's first reading)."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def state_dict(self) -> dict[str, Any]:
        return {"seen": list(self.seen)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = list(state["seen"])


def run(trainer: PPOTrainer) -> None:
    while trainer.state.step < trainer.args.steps:
        trainer.guards["readings"].seen.append(trainer.state.step)
        trainer.record(trainer.step())


def comparable(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows without the wall-clock figures."""
    clock = {metrics.TOKENS_PER_SECOND, metrics.TIME_GENERATE, metrics.TIME_SCORE}
    clock |= {metrics.TIME_FORWARD, metrics.TIME_OPTIMISE}
    return [{k: v for k, v in row.items() if k not in clock} for row in rows]


@pytest.mark.filterwarnings("ignore::UserWarning")  # the guards' warnings on a run this short
def test_a_run_resumed_from_a_checkpoint_is_the_run_that_never_stopped(tmp_path: Path) -> None:
    whole, reward = trainer_for(tmp_path / "whole")
    run(whole)
    rows = comparable(whole.state.metrics)
    assert [r[metrics.STEP] for r in rows] == [1, 2, 3, 4]
    assert len({r[metrics.REWARD_MEAN] for r in rows}) > 1, "the steps saw different batches"
    # The prompts' column reached the reward beside each prompt's own text.
    assert {(q.strip(), b) for q, b in reward.seen} <= {(p, float(i)) for i, p in enumerate(PROMPTS)}
    checkpoint = tmp_path / "whole.checkpoints" / "step-2"
    assert sorted(p.name for p in checkpoint.iterdir()) == [
        "adapter",
        "optimizer.pt",
        "run_config.yaml",
        "trainer_state.json",
        "value_head.safetensors",
    ]

    resumed, _ = trainer_for(tmp_path / "resumed")
    resumed.load(checkpoint)
    assert resumed.state.step == resumed.start_step == 2
    assert resumed.guards["readings"].seen == [0, 1]  # the caller's guard state came back with the rest
    assert comparable(resumed.state.metrics) == rows[:2]
    run(resumed)

    assert comparable(resumed.state.metrics) == rows  # every figure of steps 3 and 4, exactly
    for name, tensor in whole.trained_tensors().items():
        assert torch.equal(tensor, resumed.trained_tensors()[name]), name
    assert resumed.state.to_json()["kl_controller"] == whole.state.to_json()["kl_controller"]
    assert resumed.state.score_stats.state_dict() == whole.state.score_stats.state_dict()
    assert resumed.state.samples == whole.state.samples and set(whole.state.samples) == {"first", "last"}
    assert resumed.guards["readings"].seen == whole.guards["readings"].seen == [0, 1, 2, 3]
    assert (tmp_path / "resumed" / "metrics.jsonl").read_text().count("\n") == 4  # replayed rows, then new ones


def test_the_state_round_trips_through_its_checkpoint_form() -> None:
    args = PPOArguments(adaptive_kl=True, init_kl_coef=0.2, target_kl=2.0, kl_horizon=100)
    state = PPOState.fresh(args)
    state.step, state.samples, state.metrics = 7, {"first": [{"query": "q", "response": "r", "reward": 1.0}]}, [{}]
    state.kl_controller.update(5.0, 8)  # well above target: the coefficient grows by 0.2 * 8 / 100
    state.score_stats.update(torch.tensor([1.0, 2.0, 4.0]))
    again = PPOState.fresh(args)
    again.load_json(state.to_json())
    assert again.to_json() == state.to_json()
    assert again.kl_controller.value == pytest.approx(0.2 * (1 + 0.2 * 8 / 100))
    assert again.score_stats.mean == pytest.approx(7 / 3)
    fixed = PPOState.fresh(dataclasses.replace(args, adaptive_kl=False))
    fixed.kl_controller.update(5.0, 8)
    assert fixed.kl_controller.value == 0.2
