"""Where a stage's resumable checkpoints live and which one `--resume_from_checkpoint` means.

Checkpoints go to `<output_dir>.checkpoints/`, a sibling of the staged output, so a stopped run keeps
them. PPO names them `step-N`, trl's trainers `checkpoint-N`; both hold a `trainer_state.json`.
"""

from __future__ import annotations

from pathlib import Path

from fitrl.config import UsageError

STATE_FILE = "trainer_state.json"


def checkpoint_root(output_dir: str | Path) -> Path:
    out = Path(output_dir).expanduser().absolute()
    return out.with_name(out.name + ".checkpoints")


def latest_checkpoint(root: Path, prefix: str) -> Path | None:
    """The `<prefix>-N` directory in `root` with the largest N, or None."""
    found = [p for p in root.glob(f"{prefix}-*") if p.name.removeprefix(f"{prefix}-").isdigit()]
    return max(found, key=lambda p: int(p.name.removeprefix(f"{prefix}-")), default=None)


def find_checkpoint(resume: str | None, output_dir: str | Path, prefix: str, stage: str) -> Path | None:
    """The checkpoint `resume` names ('latest' or a directory), checked; None when not resuming."""
    if resume is None:
        return None
    if resume == "latest":
        root = checkpoint_root(output_dir)
        latest = latest_checkpoint(root, prefix)
        if latest is None:
            raise UsageError(f"no checkpoint to resume in {root}; drop --resume_from_checkpoint")
        return latest
    path = Path(resume).expanduser()
    if not (path / STATE_FILE).is_file():
        raise UsageError(f"{path} is not a {stage} checkpoint (no {STATE_FILE})")
    return path
