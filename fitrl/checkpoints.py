"""Where a stage's resumable checkpoints live and which one `--resume_from_checkpoint` means, and
which base model and stage an adapter came from (`check_adapter_base`).

Checkpoints go to `<output_dir>.checkpoints/`, a sibling of the staged output, so a stopped run keeps
them. PPO names them `step-N`, trl's trainers `checkpoint-N`; both hold a `trainer_state.json`.
A checkpoint is complete once it holds `run_config.yaml`, the last file written into it (PPO writes
its checkpoint aside and renames it into place; for trl's, `fitrl.hf_trainer` adds the file after
reading back what the trainer saved): a save cut off by `kill -9` or a full disk leaves a checkpoint
without it, which `latest` skips and a resume refuses.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fitrl.artifacts import RunInfo, written_by
from fitrl.config import RUN_CONFIG_NAME, RunFailed, UsageError, first_line, load_run_config

STATE_FILE = "trainer_state.json"
ADAPTER = "adapter"  # a PPO checkpoint's policy adapter
COMPLETE_FILE = RUN_CONFIG_NAME


def checkpoint_root(output_dir: str | Path) -> Path:
    out = Path(output_dir).expanduser().absolute()
    return out.with_name(out.name + ".checkpoints")


def _numbered(root: Path, prefix: str) -> dict[int, Path]:
    """The `<prefix>-N` directories in `root`, by N."""
    found = (p for p in root.glob(f"{prefix}-*") if p.name.removeprefix(f"{prefix}-").isdigit())
    return {int(p.name.removeprefix(f"{prefix}-")): p for p in found}


def is_complete(checkpoint: Path) -> bool:
    return (checkpoint / COMPLETE_FILE).is_file() and (checkpoint / STATE_FILE).is_file()


def complete_checkpoints(root: Path, prefix: str) -> dict[int, Path]:
    """The complete `<prefix>-N` directories in `root`, by N."""
    return {n: p for n, p in _numbered(root, prefix).items() if is_complete(p)}


def latest_checkpoint(root: Path, prefix: str) -> Path | None:
    """The complete `<prefix>-N` directory in `root` with the largest N, or None."""
    found = complete_checkpoints(root, prefix)
    return found[max(found)] if found else None


def policy_adapter(directory: Path) -> Path:
    """Where an adapter's files are: a PPO checkpoint's `adapter/` (beside its value head, optimizer and
    state), else `directory` itself."""
    inner = directory / ADAPTER
    return inner if (directory / STATE_FILE).is_file() and (inner / "adapter_config.json").is_file() else directory


def find_checkpoint(resume: str | None, output_dir: str | Path, prefix: str, stage: str) -> Path | None:
    """The checkpoint `resume` names ('latest' or a directory), checked; None when not resuming."""
    if resume is None:
        return None
    if resume == "latest":
        root = checkpoint_root(output_dir)
        latest = latest_checkpoint(root, prefix)
        if latest is None:
            raise UsageError(f"no complete checkpoint to resume in {root}; drop --resume_from_checkpoint")
        for n, skipped in sorted(_numbered(root, prefix).items()):
            if n > int(latest.name.rpartition("-")[2]):
                print(f"skipping {skipped}: its save did not finish (no {COMPLETE_FILE})")
        return latest
    path = Path(resume).expanduser()
    if not (path / STATE_FILE).is_file():
        raise UsageError(f"{path} is not a {stage} checkpoint (no {STATE_FILE})")
    if not is_complete(path):
        raise UsageError(
            f"checkpoint {path} is incomplete (no {COMPLETE_FILE}: its save was cut off, or fitrl did not "
            f"write it){_suggest_previous(path)}"
        )
    return path


def stopped(reason: str, step: int, output_dir: str | Path, prefix: str | None, fix: str) -> Exception:
    """The `RunFailed` of a run that cannot go on: it names the checkpoint to resume from, if any."""
    latest = latest_checkpoint(checkpoint_root(output_dir), prefix) if prefix else None
    kept = f"the last checkpoint, {latest}, is kept" if latest else "no checkpoint was saved"
    return RunFailed(f"{reason} at step {step}; {kept}; {fix}")


def is_write_failure(e: BaseException) -> bool:
    """A save that failed for lack of room: a full disk, a quota, a file-size limit (safetensors' own
    error says it in words)."""
    import errno

    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        return True
    text = str(e)
    return type(e).__name__ == "SafetensorError" and ("File too large" in text or "No space left" in text)


def save_failed(e: BaseException, step: int, output_dir: str | Path, prefix: str) -> Exception:
    """The one line of a checkpoint save that failed for lack of room, naming the last complete one."""
    latest = latest_checkpoint(checkpoint_root(output_dir), prefix)
    return stopped(
        f"saving a checkpoint failed ({first_line(e)}: the disk is full or a file-size limit was hit)",
        step,
        output_dir,
        prefix,
        "free space, then " + ("resume with --resume_from_checkpoint latest" if latest else "run it again"),
    )


def _suggest_previous(path: Path) -> str:
    """'; resume from <the checkpoint before `path`> instead' when there is one."""
    prefix, _, number = path.name.rpartition("-")
    if not number.isdigit():
        return ""
    older = {n: p for n, p in _numbered(path.parent, prefix).items() if n < int(number) and is_complete(p)}
    return f"; resume from {older[max(older)]} instead" if older else ""


def load_state(path: Path, device: Any = "cpu") -> Any:
    """A `torch.save`d state (optimizer, value head) as plain tensors and containers, never as code.

    `weights_only=True` refuses any pickled object that is not a tensor, number, string or container:
    a crafted checkpoint cannot run its payload, it becomes a one-line usage error.
    """
    import pickle

    import torch
    from transformers.trainer_pt_utils import safe_globals

    try:
        with safe_globals():  # numpy's random state, as in the Trainer's rng_state.pth, is data too
            return torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError:
        raise UsageError(
            f"{path} holds objects other than tensors and was refused (a checkpoint must not run code); "
            f"delete it{_suggest_previous(path.parent)}"
        ) from None
    except (OSError, RuntimeError, EOFError) as e:
        raise UsageError(
            f"cannot read {path} ({first_line(e)}); the checkpoint is damaged{_suggest_previous(path.parent)}"
        ) from None


def load_safetensors(path: Path, checkpoint: Path) -> dict[str, Any]:
    """The tensors of `path` in `checkpoint`; a missing or truncated file is a one-line usage error."""
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except Exception as e:  # safetensors raises its own error type for truncated or corrupt files
        raise UsageError(
            f"cannot read {path} ({first_line(e)}); the checkpoint is damaged{_suggest_previous(checkpoint)}"
        ) from None


def check_checkpoint_files(checkpoint: Path) -> None:
    """Read every file of a checkpoint once, so a damaged or crafted one fails before any model loads."""
    try:
        json.loads((checkpoint / STATE_FILE).read_bytes())
    except (ValueError, OSError) as e:
        raise UsageError(
            f"cannot read {checkpoint / STATE_FILE} ({first_line(e)}); the checkpoint is damaged"
            f"{_suggest_previous(checkpoint)}"
        ) from None
    for path in sorted(checkpoint.rglob("*.safetensors")):
        load_safetensors(path, checkpoint)
    for pattern in ("*.pt", "*.pth", "*.bin"):
        for path in sorted(checkpoint.rglob(pattern)):
            if path.name != "training_args.bin":  # the Trainer's pickled settings: a record, never loaded
                load_state(path)


# Settings a resumed run may change: they neither change the model nor the data it sees.
RESUMABLE_CHANGES = {
    "steps",
    "max_steps",
    "num_train_epochs",
    "logging_steps",
    "save_steps",
    "report_to",
    "log_samples",
    "num_samples_to_show",
    "output_dir",
    "overwrite_output_dir",
    "resume_from_checkpoint",
    "verify_frozen_base",
    "demo_assets",
    "push_to_hub",
    "hub_model_id",
    "hub_private",
}


def resume_checkpoint(
    resume: str | None, output_dir: str | Path, prefix: str, stage: str, settings: dict[str, Any]
) -> Path | None:
    """The checkpoint `resume` names, its files readable and `settings` compatible with its own.

    The harmless changes of settings are printed; None when not resuming.
    """
    path = find_checkpoint(resume, output_dir, prefix, stage)
    if path is None:
        return None
    check_checkpoint_files(path)
    for change in check_resume_config(path, settings):
        print(f"resuming {path} with a changed setting: {change}")
    return path


def check_resume_config(checkpoint: Path, current: dict[str, Any]) -> list[str]:
    """Compare the settings a checkpoint was made with (its run_config.yaml) with the current ones.

    A change that alters the model or the data stream is a `UsageError` naming it; the harmless ones
    (`RESUMABLE_CHANGES`) are returned as 'key: old -> new' lines for the log.
    """
    import yaml

    saved = load_run_config(checkpoint)
    if not saved:  # made before checkpoints recorded their settings: nothing to compare
        return []
    current = yaml.safe_load(yaml.safe_dump(current))  # the same types the saved file reads back as
    changed = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
    refused = [k for k in changed if k not in RESUMABLE_CHANGES]
    if refused:
        more = f" (and {len(refused) - 1} more: {', '.join(refused[1:])})" if len(refused) > 1 else ""
        k = refused[0]
        raise UsageError(
            f"checkpoint {checkpoint} was made with {k}={saved.get(k)!r}, now {current.get(k)!r}{more}; "
            "resume with the checkpoint's settings, or start a new run without --resume_from_checkpoint"
        )
    return [f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in changed]


def read_adapter_config(adapter_dir: Path, producer: str) -> dict[str, Any]:
    """peft's `adapter_config.json` of `adapter_dir`; missing or damaged, a one-line usage error."""
    config_path = adapter_dir / "adapter_config.json"
    if not config_path.is_file():
        raise UsageError(f"adapter {adapter_dir} has no adapter_config.json; give the output_dir of a {producer} run")
    try:
        config = json.loads(config_path.read_bytes())
    except (ValueError, OSError) as e:
        raise UsageError(f"{config_path} is not JSON ({first_line(e)}); the adapter is damaged") from None
    if not isinstance(config, dict):
        raise UsageError(f"{config_path} does not hold a JSON object; the adapter is damaged")
    return config


def check_adapter_files(adapter_dir: Path, producer: str) -> None:
    """An adapter's config and weights read once (safetensors, or a `.bin` as tensors only), so that a
    missing, damaged or crafted file is a one-line usage error before any model loads."""
    read_adapter_config(adapter_dir, producer)
    weights = [adapter_dir / name for name in ("adapter_model.safetensors", "adapter_model.bin")]
    present = [w for w in weights if w.is_file()]
    if not present:
        raise UsageError(
            f"adapter {adapter_dir} has no adapter_model.safetensors; give the output_dir of a {producer} run"
        )
    if present[0].suffix == ".safetensors":
        load_safetensors(present[0], adapter_dir)
    else:
        load_state(present[0])


def adapter_bases(adapter_dir: Path, stage: str) -> tuple[set[str], str | None]:
    """What an adapter records of its base (its run's `run_config.yaml` and `run_info.json`, peft's
    `adapter_config.json`), and the name it was trained on (None: it records none)."""
    info, config = RunInfo.read(adapter_dir), load_run_config(adapter_dir)
    peft_base = None
    if (adapter_dir / "adapter_config.json").is_file():
        peft_base = read_adapter_config(adapter_dir, stage).get("base_model_name_or_path")
    recorded = {config.get("model_name_or_path"), info and info.resolved_model_path, peft_base} - {None, ""}
    trained_on = config.get("model_name_or_path") or peft_base or (sorted(recorded)[0] if recorded else None)
    return recorded, trained_on


def is_model(recorded: set[str], model_name: str, model_path: str) -> bool:
    """Whether the names an adapter recorded of its base (`adapter_bases`) are the model `model_name`
    (resolved: `model_path`), as strings or as resolved paths."""
    if {model_name, model_path} & recorded:
        return True
    here = {Path(p).expanduser().resolve() for p in (model_name, model_path) if Path(p).expanduser().exists()}
    there = {Path(p).expanduser().resolve() for p in recorded if Path(p).expanduser().exists()}
    return bool(here & there)


def check_adapter_base(
    adapter_dir: Path,
    model_name: str,
    model_path: str,
    stage: str,
    force: bool,
    producer: str | None = None,
    require_record: bool = True,
    forceable: bool = True,
) -> None:
    """Refuse an adapter that was not trained on this model, or not by the stage that should have made it
    (or whose `adapter_config.json` is damaged).

    What the adapter records of its base (`adapter_bases`) is compared with the model named
    (`model_name`) and its resolved path or hub id (`model_path`). `producer` is the stage whose output
    this stage takes (`run_info.json` says which stage wrote the adapter). `force` skips the check, and
    the messages offer it where the stage has that setting (`forceable`); without `require_record`, an
    adapter that records no base at all passes (the merge checks shapes itself).
    """
    if force:
        return
    made_by = written_by(adapter_dir)
    if producer is not None and made_by is not None and made_by != producer:
        raise UsageError(
            f"{adapter_dir} is the output of the {made_by} stage; {stage} takes the {producer} stage's"
            + (" (or pass --force true)" if forceable else "")
        )
    recorded, trained_on = adapter_bases(adapter_dir, producer or stage)
    if not recorded and not require_record:
        return
    if not recorded:
        fix = f"pass --force true if it fits {model_name}" if forceable else f"give the output_dir of a {producer} run"
        raise UsageError(f"adapter {adapter_dir} records no base model; {fix}")
    if is_model(recorded, model_name, model_path):
        return
    raise UsageError(
        f"adapter {adapter_dir} was trained on {trained_on}, not {model_name}; "
        "set model_name_or_path to its base" + (" (or pass --force true)" if forceable else "")
    )
