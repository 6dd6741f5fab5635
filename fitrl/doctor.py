"""Is this machine ready to run a profile? What would stop a run, in seconds, before any model loads.

    python -m fitrl.doctor                                       # the demo profile
    python -m fitrl.doctor --profile neox20b-24gb --gpu "RTX 4090"
    bash pipeline.sh --check --profile neox20b-24gb              # the same, for the pipeline's run directory

One line per check: `ok`, `note` (worth knowing, stops nothing) or `error:` (would stop a run, with
the fix). Checked: Python and each pinned package against `requirements.txt`; the GPU and
bitsandbytes on it; free disk where the run writes; each model a stage loads (a local directory, a
demo asset, the hub cache, or the hub when it can be reached); the planner's verdict for each
training stage on the card (detected, or `--gpu`); the first rows of each local dataset, read by the
stage's own loader. A stage's input that an earlier stage of the profile writes is not looked for.
Exit 0 when nothing would stop a run, else 2.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import re
import shutil
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fitrl.config import UsageError, first_line

REQUIREMENTS = Path(__file__).resolve().parents[1] / "requirements.txt"  # a checkout's tested pins; a wheel has none
MiB, GiB = 2**20, 2**30
ROWS_CHECKED = 64  # a dataset's first rows, read as the stage reads them
# The settings that name a model a stage loads (a reward model only where no rm adapter replaces it).
MODEL_KEYS = ("model_name_or_path", "base_model", "reward_model", "judge_model", "guard_judge_model")
HUB = ("huggingface.co", 443)


class Findings:
    """The checks' lines, in order; `errors` counts what would stop a run."""

    def __init__(self, out: Any = None) -> None:
        self.out = out or sys.stdout
        self.errors = 0

    def ok(self, text: str) -> None:
        print(f"ok    {text}", file=self.out)

    def note(self, text: str) -> None:
        print(f"note  {text}", file=self.out)

    def error(self, text: str) -> None:
        self.errors += 1
        print(f"error: {text}", file=self.out)


# --- the machine ----------------------------------------------------------------------------------


def pins(requirements: Path) -> dict[str, str]:
    """`name==version` lines of a requirements file, by normalised name."""
    found = {}
    for line in requirements.read_text().splitlines():
        m = re.match(r"^\s*([A-Za-z0-9_.\-]+)==([^\s;#]+)", line)
        if m:
            found[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
    return found


def check_packages(f: Findings, requirements: Path) -> None:
    f.ok(f"python {sys.version.split()[0]}")
    if not requirements.is_file():
        f.note(f"no {requirements.name} beside fitrl: package versions not checked")
        return
    other = []
    for name, pinned in pins(requirements).items():
        try:
            found = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            f.error(f"{name} is not installed; pip install -r {requirements} (or make setup)")
            continue
        if found.split("+")[0] != pinned:  # a local build tag (torch's +cu128) is the same release
            other.append(f"{name} {found} (pinned {pinned})")
    if other:
        f.note("versions other than the pins, untested together: " + ", ".join(other))
    else:
        f.ok(f"every package at its pin ({requirements.name})")


def check_device(f: Findings) -> int | None:
    """The GPU torch sees and bitsandbytes on it; its capacity in bytes, or None on a CPU."""
    import torch

    try:
        import bitsandbytes  # noqa: F401  (its CUDA library loads on import)
    except Exception as e:
        f.error(f"bitsandbytes does not load ({first_line(e)}): 8-bit and 4-bit bases and 8-bit optimizers need it")
        bitsandbytes_ok = False
    else:
        bitsandbytes_ok = True
    if not torch.cuda.is_available():
        f.note("no GPU: stages run on the CPU (the demo's way); the 20B and 1B profiles need one")
        return None
    capacity = torch.cuda.get_device_properties(0).total_memory
    free, _ = torch.cuda.mem_get_info()
    f.ok(f"GPU {torch.cuda.get_device_name()}: {capacity / GiB:.2f} GiB to torch, {free / GiB:.2f} GiB free now")
    if capacity - free > 512 * MiB:
        f.note(f"{(capacity - free) / GiB:.2f} GiB of the card is held already (a display, another process)")
    if bitsandbytes_ok:
        try:
            from bitsandbytes.functional import quantize_blockwise

            quantize_blockwise(torch.ones(64, device="cuda"))
        except Exception as e:
            f.error(f"bitsandbytes cannot run on this GPU ({first_line(e)}); reinstall the pinned bitsandbytes")
    return free


def check_disk(f: Findings, run_dir: Path, need: int) -> None:
    where = run_dir
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    text = f"{free / GiB:.1f} GiB free at {where}, the profile writes about {need / GiB:.1f} GiB"
    if free < need:
        f.error(f"{text}; free space there or give another --run_dir")
    else:
        f.ok(text)


def hub_reachable(timeout: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return False
    try:
        socket.create_connection(HUB, timeout=timeout).close()
        return True
    except OSError:
        return False


# --- the profile ----------------------------------------------------------------------------------


def profile_configs(profile: Path, run_dir: Path) -> Iterator[tuple[Any, tuple[Any, ...]]]:
    """Each stage with a config in `profile`, in pipeline order, with its settings as the pipeline
    gives them: its input is the stage before's output in `run_dir`. Each stage's resolved settings
    are written there as its run would write them, so a stage that inherits them (an evaluation
    reading its policy's run) finds them."""
    from fitrl.config import save_run_config
    from fitrl.stages import STAGES, stage_args

    for stage in STAGES:
        if (profile / f"{stage.name}.yaml").is_file():
            configs = stage.parse(stage_args(stage, profile, run_dir))
            (run_dir / stage.output_dir).mkdir(parents=True, exist_ok=True)
            save_run_config(run_dir / stage.output_dir, *configs)
            yield stage, configs


def models_of(configs: tuple[Any, ...], written: Path) -> list[str]:
    """The models a stage loads, but those an earlier stage of the run writes (under `written`)."""
    found = []
    for config in configs:
        values = dataclasses.asdict(config)
        for key in MODEL_KEYS:
            value = values.get(key)
            if not value or Path(value).is_relative_to(written):
                continue
            if key == "reward_model" and (values.get("reward_adapter") or values.get("reward_function")):
                continue
            found.append(value)
    return found


def check_model(f: Findings, name: str, demo_assets: str, hub: Callable[[], bool]) -> None:
    from fitrl import demo

    if demo.is_demo_uri(name):
        try:
            demo.manifest(demo_assets)
            f.ok(f"{name}: the demo's, in {demo.assets_root(demo_assets)}")
        except UsageError as e:
            f.error(str(e))
        return
    if Path(name).expanduser().exists():
        if (Path(name).expanduser() / "config.json").is_file():
            f.ok(f"{name}: a local directory")
        else:
            f.error(f"{name} has no config.json; give a model directory (save_pretrained's) or a hub id")
        return
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        f.ok(f"{name}: in the hub cache")
    elif hub():
        f.ok(f"{name}: downloads from the hub on first use")
    elif os.environ.get("HF_HUB_OFFLINE") == "1":
        f.error(f"{name} is not in the hub cache and HF_HUB_OFFLINE=1; download it first or unset HF_HUB_OFFLINE")
    else:
        f.error(f"{name} is not in the hub cache and the hub cannot be reached; download it where it can be")


def check_data(f: Findings, stage: Any, configs: tuple[Any, ...], hub: Callable[[], bool], seen: set) -> None:
    """The first rows of each dataset the stage reads, with its own loader: columns, empty or bad rows
    (a dataset split an earlier stage read is not read again)."""
    from fitrl import chat, data, demo
    from fitrl.stages.base import config_of
    from fitrl.tasks import gsm8k, preferences, sentiment

    demo_assets = config_of(configs, demo.DemoArguments).demo_assets
    for config in configs:
        source = getattr(config, "dataset", None)
        if not isinstance(source, str) or (source, config.dataset_split) in seen:
            continue
        seen.add((source, config.dataset_split))
        local = demo.is_demo_uri(source) or Path(source).expanduser().exists()
        if not local and hub():
            f.ok(f"{stage.name} data {source}: downloads from the hub; its rows are checked when the stage loads it")
            continue
        try:
            if isinstance(config, preferences.PreferenceArguments):
                rows = len(preferences.load_pairs(config, config.dataset_split, demo_assets, ROWS_CHECKED))
            elif isinstance(config, gsm8k.GSM8KDataArguments):
                limited = dataclasses.replace(config, max_samples=min(config.max_samples or ROWS_CHECKED, ROWS_CHECKED))
                rows = len(gsm8k.load_problems(limited, demo_assets)[0])
            elif isinstance(config, sentiment.PromptArguments):
                rows = len(sentiment.read_prompts(config, demo_assets, ROWS_CHECKED)[0])
            else:  # SFT: a column of texts, or of chats (`messages`), as the stage reads it (every row)
                values = data.load_column(source, config.dataset_split, config.text_column, demo_assets, carve=False)
                if chat.check_chats(values[:ROWS_CHECKED], config.text_column, prompt=False):
                    rows = sum(v is not None for v in values[:ROWS_CHECKED])
                else:  # the column read once, whichever it holds
                    rows = len(data.texts_in(values, source, config.text_column, ROWS_CHECKED))
        except UsageError as e:
            f.error(f"{stage.name}: {e}")
        else:
            f.ok(f"{stage.name} data {source}: the first {rows} rows read as the stage reads them")


def check_plan(f: Findings, stage: Any, configs: tuple[Any, ...], arch: Any, gpu: int | None, named: bool) -> None:
    from fitrl import planner

    try:
        result = planner.plan_stage(stage, configs, arch, gpu_memory_bytes=gpu or 24 * GiB)
    except UsageError as e:
        f.error(f"{stage.name}: {e}")
        return
    if gpu is None:
        f.ok(f"{stage.name}: {planner.brief(result)} (no GPU here or named with --gpu: 24 GiB assumed)")
    elif result.fits:
        f.ok(f"{stage.name}: {planner.brief(result)}")
    else:
        moves = planner.suggest(stage, configs, arch, gpu_memory_bytes=gpu)
        fix = " ".join(f"--{k} {v}" for k, v in moves[0]["overrides"].items()) if moves else "a larger card"
        where = "the card named" if named else "this GPU"
        f.error(f"{stage.name}: {planner.brief(result)}; it does not fit {where}: try {fix}")


def _architecture(configs: tuple[Any, ...], before: list[tuple[Any, tuple[Any, ...]]], written: Path) -> Any:
    """The architecture of the model the stage loads; a model an earlier stage writes (PPO's merged
    model) has the architecture of the model that stage started from."""
    from fitrl.architectures import architecture
    from fitrl.demo import DemoArguments
    from fitrl.stages import starting_model
    from fitrl.stages.base import config_of

    for cfgs in [configs, *(c for _, c in reversed(before))]:
        name = starting_model(cfgs)
        if name is None or Path(name).is_relative_to(written):
            continue
        return architecture(name, config_of(cfgs, DemoArguments).demo_assets)
    raise UsageError("no stage of the profile names a model whose architecture can be read")


def run_size(merged: Any) -> int:
    """What the profile writes, roughly: adapters, checkpoints and logs (1 GiB), and a merged copy of
    the base (architecture `merged`) in 16 bits when it merges, the largest output by far."""
    if merged is None:
        return GiB
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(merged)
    return sum(p.numel() for p in model.parameters()) * 2 + GiB


def diagnose(profile: Path, run_dir: Path, gpu_name: str | None = None, out: Any = None) -> int:
    """Every check for `profile` (a configs/ folder) writing to `run_dir`; the number of errors."""
    import tempfile

    from fitrl.cards import card
    from fitrl.demo import DemoArguments
    from fitrl.stages.base import config_of

    f = Findings(out)
    check_packages(f, REQUIREMENTS)
    free = check_device(f)
    gpu = int(card(gpu_name).capacity_gib * GiB) if gpu_name else free
    reachable: list[bool] = []

    def hub() -> bool:  # probed once, and only when something needs it
        if not reachable:
            reachable.append(hub_reachable())
        return reachable[0]

    with tempfile.TemporaryDirectory(prefix="fitrl-doctor-") as tmp:
        try:
            stages = list(profile_configs(profile, Path(tmp)))
        except UsageError as e:
            f.error(f"profile {profile}: {e}")
            return f.errors
        merged, seen_models, seen_data = None, set(), set()
        for i, (stage, configs) in enumerate(stages):
            for model in models_of(configs, Path(tmp)):
                if model not in seen_models:
                    seen_models.add(model)
                    check_model(f, model, config_of(configs, DemoArguments).demo_assets, hub)
            check_data(f, stage, configs, hub, seen_data)
            if stage.memory is None and not stage.writes_full_model:
                continue
            try:
                arch = _architecture(configs, stages[:i], Path(tmp))
            except UsageError as e:
                f.note(f"{stage.name}: no memory plan ({e})")
                continue
            if stage.writes_full_model:  # the base it merged into, whole
                merged = arch
            else:
                check_plan(f, stage, configs, arch, gpu, named=gpu_name is not None)
    check_disk(f, run_dir, run_size(merged))
    return f.errors


def run(profile: Path, run_dir: Path, gpu_name: str | None = None) -> int:
    """`diagnose`, then the verdict line; the exit status: 0 ready, 2 when something would stop the run."""
    errors = diagnose(profile, run_dir, gpu_name)
    print("ready" if not errors else f"{errors} problem(s) would stop this run: see the error lines above")
    return 2 if errors else 0


def main(argv: list[str] | None = None) -> None:
    from fitrl.config import ArgumentParser
    from fitrl.stages import profile_dir

    parser = ArgumentParser(prog="python -m fitrl.doctor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="demo", help="configs/<profile>, or a folder of stage configs.")
    parser.add_argument("--run_dir", help="Where the run writes (default: outputs/<profile>).")
    parser.add_argument("--gpu", help="Plan for this card (e.g. 'RTX 4090') instead of the one detected.")
    try:
        args = parser.parse_args(argv)
        profile = profile_dir(args.profile)
        code = run(profile, Path(args.run_dir or f"outputs/{profile.name}"), args.gpu)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    raise SystemExit(code)


if __name__ == "__main__":
    main()
