"""The stages of fitrl, in pipeline order: the one list every tool reads.

Each module holds a stage's argument dataclasses and its `STAGE` record (`fitrl.stages.base.Stage`):
its place in the pipeline, its memory workload and suggestions, its report figures. Its script in
`scripts/` tells the stage's story. `docs/architecture.md` says how to add one.
"""

from __future__ import annotations

from pathlib import Path

from fitrl.config import UsageError
from fitrl.stages import dpo, eval_dpo, eval_gsm8k, eval_sentiment, grpo, merge, ppo, rm, sft
from fitrl.stages.base import Stage, StageMemory

STAGES: tuple[Stage, ...] = (
    sft.STAGE,
    merge.STAGE,
    rm.STAGE,
    ppo.STAGE,
    eval_sentiment.STAGE,
    dpo.STAGE,
    eval_dpo.STAGE,
    grpo.STAGE,
    eval_gsm8k.STAGE,
)
NAMES = tuple(s.name for s in STAGES)
PLANNABLE = tuple(s.name for s in STAGES if s.memory is not None)


def get(name: str) -> Stage:
    """The stage called `name`; an unknown name is a usage error listing the known ones."""
    for stage in STAGES:
        if stage.name == name:
            return stage
    raise UsageError(f"unknown stage '{name}'; known: {' '.join(NAMES)}")


def stage_args(stage: Stage, profile: Path, run_dir: Path) -> list[str]:
    """A stage's arguments in a run of `profile` (a folder of `<stage>.yaml`): its config, its output
    in `run_dir`, and its input from the stage before it there when the profile has that stage."""
    args = ["--config", str(profile / f"{stage.name}.yaml"), "--output_dir", str(run_dir / stage.output_dir)]
    if stage.reads is not None:
        key, producer = stage.reads
        if (profile / f"{producer}.yaml").is_file():  # else the config names its own input
            args += [f"--{key}", str(run_dir / get(producer).output_dir)]
    return args


__all__ = ["NAMES", "PLANNABLE", "STAGES", "Stage", "StageMemory", "get", "stage_args"]
