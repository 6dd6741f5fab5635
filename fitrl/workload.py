"""What one training step allocates depends on: a stage's settings as shapes, in tokens and sequences.

A leaf (no torch): each stage module (`fitrl.stages`) builds its `Workload` from its typed config,
`fitrl.memtrace` runs that step under a tracker and `fitrl.planner` sums it up.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Step(enum.Enum):
    """The loss one training micro-step computes, as the trainer behind a stage computes it: what
    `fitrl.memtrace` traces. A stage's `Workload` names its step; nothing reads a stage's name for it."""

    NEXT_TOKEN = "next_token"  # trl's SFTTrainer: the mean negative log-prob from its fused LM head
    PAIRWISE_SCORE = "bradley_terry"  # trl's RewardTrainer: a scalar head, Bradley-Terry on chosen/rejected
    DPO = "dpo_loss"  # trl's DPOTrainer: the policy's log-probs, then the reference's (adapter off)
    PPO = "ppo_clip"  # fitrl's `ppo_step.micro_step_loss` on experience, after a no-grad pass
    GRPO = "grpo_loss"  # trl's GRPOTrainer (its dapo loss), after the reference's log-probs when it has one


@dataclass(frozen=True)
class Workload:
    """What one step of a stage allocates depends on: the settings and shapes, in tokens and sequences."""

    stage: str  # the stage's name, as the plan is titled
    step: Step  # what its training micro-step computes
    quantization: str = "none"  # none | 8bit | 4bit
    dtype: str = "bfloat16"  # the compute dtype: float32 | bfloat16 | float16
    finetuning: str = "lora"  # lora | full
    lora_r: int = 16
    lora_targets: tuple[str, ...] = ("all-linear",)
    optimizer: str = "adamw"  # adamw | adamw_8bit | paged_adamw_8bit | paged_adamw_32bit | adafactor
    gradient_checkpointing: bool = False
    micro_batch: int = 1  # sequences per training forward
    prompt_len: int = 0  # PPO query / GRPO prompt tokens; 0 for SFT
    completion_len: int = 512  # PPO response / GRPO completion tokens; SFT: the block size
    gen_batch: int = 0  # sequences generated at once (0: no generation)
    nograd_batch: int = 0  # sequences per no-grad pass (0: none)
    reference_pass: bool = False  # log-probs with the adapter off
    value_head: bool = False  # PPO's value head on the last hidden state
    # PPO scoring with an rm adapter on its own backbone: a second, frozen adapter of the policy's shape
    # (the shipped rm configs use the policy's LoRA settings); its scoring pass is no larger than the
    # no-grad pass
    reward_adapter: bool = False
    temperature: float = 1.0
    # bitsandbytes' 8-bit product keeps its input for backward; fitrl's on a CPU keeps none (FrozenInt8Product)
    int8_keeps_input: bool = True

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.completion_len

    @property
    def quantized(self) -> bool:
        return self.quantization != "none"
