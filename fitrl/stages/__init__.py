"""The stages of fitrl, in pipeline order: the one list every tool reads.

Each module holds a stage's argument dataclasses and its `STAGE` record (`fitrl.stages.base.Stage`):
its place in the pipeline, its memory workload and suggestions, its report figures. Its program in
`fitrl/scripts/` tells the stage's story. `docs/architecture.md` says how to add one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fitrl.config import UsageError
from fitrl.demo import is_demo_uri
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
# The shipped profiles: in a checkout `fitrl/configs` links to its `configs/`, and a wheel holds a copy of it.
SHIPPED_CONFIGS = Path(__file__).resolve().parents[1] / "configs"
PLANNABLE = tuple(s.name for s in STAGES if s.memory is not None)


def get(name: str) -> Stage:
    """The stage called `name`; an unknown name is a usage error listing the known ones."""
    for stage in STAGES:
        if stage.name == name:
            return stage
    raise UsageError(f"unknown stage '{name}'; known: {' '.join(NAMES)}")


def _config_roots() -> list[Path]:
    """Where profiles live: the project the command runs in (`configs/` here), then the checkout's."""
    return [Path("configs"), SHIPPED_CONFIGS]


def profiles() -> list[str]:
    """The profiles there are: the folders of those configs/, their launchers aside."""
    found = {p.name for root in _config_roots() if root.is_dir() for p in root.iterdir() if p.is_dir()}
    return sorted(found - {"accelerate"})


def launchers() -> dict[str, Path]:
    """The named launcher configs, `configs/accelerate/<name>.yaml`: this project's, else the checkout's."""
    found: dict[str, Path] = {}
    for root in _config_roots():
        for path in sorted((root / "accelerate").glob("*.yaml")):
            found.setdefault(path.stem, path)
    return dict(sorted(found.items()))


def profile_dir(profile: str) -> Path:
    """The folder of `<stage>.yaml` files `profile` names: a folder of the user's (a path from here), or a
    profile's `configs/<profile>` (this project's, else the checkout's)."""
    path = Path(profile).expanduser()
    if path.is_dir():
        return path
    for root in _config_roots():
        if profile != "accelerate" and (root / profile).is_dir():
            return root / profile
    raise UsageError(
        f"no profile configs/{profile}; pick one of: {' '.join(profiles())}, or give a folder of <stage>.yaml files"
    )


def starting_model(configs: tuple[Any, ...]) -> str | None:
    """The model a stage starts from: its `model_name_or_path`, or the merge's `base_model`."""
    for config in configs:
        for key in ("model_name_or_path", "base_model"):
            if getattr(config, key, None):
                return getattr(config, key)
    return None


def architecture_source(stage: Stage, configs: tuple[Any, ...], config_file: Path | None) -> str | None:
    """The model whose architecture `stage` loads: the one it starts from, or, where an earlier stage
    writes that model and has not run yet (PPO's merged model), the model that stage starts from, read
    from its config beside `config_file` (a profile's folder)."""
    name = starting_model(configs)
    while name and not is_demo_uri(name) and not Path(name).expanduser().exists() and config_file is not None:
        producer = stage.producer_of("model_name_or_path")
        earlier = config_file.parent / f"{producer}.yaml" if producer else None
        if earlier is None or not earlier.is_file():
            break
        stage, config_file = get(producer), earlier
        name = starting_model(stage.parse(["--config", str(earlier)]))
    return name


def inputs(stage: Stage, profile: Path) -> list[tuple[str, str]]:
    """(setting, stage) for each input `stage` takes from another stage's output in a run of `profile` (a
    folder of `<stage>.yaml`): where the profile has that stage (else the config names its own input),
    and for `reads_if_set`, where the stage's config sets the setting."""
    import yaml

    found = [stage.reads] if stage.reads is not None else []
    if stage.reads_if_set and (profile / f"{stage.name}.yaml").is_file():
        config = yaml.safe_load((profile / f"{stage.name}.yaml").read_text()) or {}
        found += [(key, producer) for key, producer in stage.reads_if_set if config.get(key)]
    return [(key, producer) for key, producer in found if (profile / f"{producer}.yaml").is_file()]


def stage_args(stage: Stage, profile: Path, run_dir: Path) -> list[str]:
    """A stage's arguments in a run of `profile`: its config, its output in `run_dir`, and its inputs
    from the stages before it there (`inputs`)."""
    args = ["--config", str(profile / f"{stage.name}.yaml"), "--output_dir", str(run_dir / stage.output_dir)]
    for key, producer in inputs(stage, profile):
        args += [f"--{key}", str(run_dir / get(producer).output_dir)]
    return args


__all__ = [
    "NAMES",
    "PLANNABLE",
    "SHIPPED_CONFIGS",
    "STAGES",
    "Stage",
    "StageMemory",
    "get",
    "architecture_source",
    "inputs",
    "profile_dir",
    "profiles",
    "stage_args",
    "starting_model",
]
