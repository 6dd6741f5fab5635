"""How a stage is launched: training stages through `accelerate launch`, the rest as one process, with
the stage's own exit code kept (accelerate reports any failed child as 1; the stage records its code,
2 for bad input, in the file `STATUS_FILE_ENV` names). `fitrl.scripts.pipeline` and the `fitrl` command
both launch this way."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

from fitrl.process import STATUS_FILE_ENV, cpu_cores

# One process, no mixed precision or compilation unless a config asks: what every profile is sized for.
DEFAULT_LAUNCH = "accelerate launch --quiet --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no"


def processes(command: list[str]) -> int:
    """How many processes `command` starts here: its `--num_processes`, else its accelerate `--config_file`'s
    `num_processes`, else one."""
    for flag in ("--num_processes", "--config_file"):
        if flag in command[:-1]:
            value = command[command.index(flag) + 1]
            if flag == "--num_processes":
                return max(1, int(value)) if value.isdigit() else 1
            try:
                found = (yaml.safe_load(Path(value).read_text()) or {}).get("num_processes", 1)
            except (OSError, yaml.YAMLError):
                return 1
            return max(1, found) if isinstance(found, int) else 1
    return 1


def launch_env(command: list[str]) -> dict[str, str]:
    """The environment to launch `command` with: the machine's cores shared among its processes
    (`OMP_NUM_THREADS`, unless the caller set it), the count a direct run of a stage takes too."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if not env.get("OMP_NUM_THREADS"):
        env["OMP_NUM_THREADS"] = str(max(1, cpu_cores() // processes(command)))
    return env


@contextmanager
def status_file(command: list[str]) -> Iterator[tuple[dict[str, str], Path]]:
    """The environment to launch `command` with (`launch_env`; the stage records its exit code in a fresh
    file) and that file."""
    with tempfile.NamedTemporaryFile("w", delete=False, prefix="fitrl-status-") as f:
        path = Path(f.name)
    try:
        yield {**launch_env(command), STATUS_FILE_ENV: str(path)}, path
    finally:
        path.unlink(missing_ok=True)


def stage_exit_code(code: int, path: Path) -> int:
    """The launched stage's own exit code: what it recorded in `path` when the launcher reports a failure."""
    recorded = path.read_text().strip() if path.is_file() else ""
    return int(recorded) if code and recorded.isdigit() else code


def executable(cmd: list[str]) -> list[str]:
    """`python` and `accelerate launch` as this interpreter's, whatever PATH holds."""
    if cmd[:2] == ["accelerate", "launch"]:
        return [sys.executable, "-m", "accelerate.commands.launch", *cmd[2:]]
    return [sys.executable if w == "python" else w for w in cmd]
