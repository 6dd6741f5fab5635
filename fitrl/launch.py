"""How a stage is launched: training stages through `accelerate launch`, the rest as one process, with
the stage's own exit code kept (accelerate reports any failed child as 1; the stage records its code,
2 for bad input, in the file `STATUS_FILE_ENV` names). `fitrl.scripts.pipeline` and the `fitrl` command
both launch this way."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
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


def run(
    command: list[str], on_output: Callable[[bytes, Path], None], merge_stdout: bool
) -> tuple[int, signal.Signals | None]:
    """Run a stage's `command` (`executable`) in a session of its own, passing its stderr (with
    `merge_stdout`, its stdout and stderr together) chunk by chunk to `on_output` with its status file;
    returns its own exit code and the signal that stopped it, if one did.

    Ctrl-C (SIGINT) and SIGTERM reach this process, which sends the stage SIGTERM: a training loop
    turns it into a checkpoint at the end of the step and one line naming it (`fitrl.signals`); this
    keeps reading until the stage has said so. The pipeline and the `fitrl` command both launch stages
    through here."""
    stopped_by: list[signal.Signals] = []
    with status_file(command) as (env, status):
        out = subprocess.PIPE
        proc = subprocess.Popen(
            command,
            stdout=out if merge_stdout else None,
            stderr=subprocess.STDOUT if merge_stdout else out,
            env=env,
            start_new_session=True,
        )

        def forward(signum: int, frame: Any) -> None:
            if not stopped_by:
                stopped_by.append(signal.Signals(signum))
                _stop_stage(proc.pid)

        with _handling((signal.SIGINT, signal.SIGTERM), forward):
            stream = proc.stdout if merge_stdout else proc.stderr
            for chunk in iter(lambda: stream.read1(4096), b""):
                on_output(chunk, status)
            code = proc.wait()
        return stage_exit_code(code, status), (stopped_by[0] if stopped_by else None)


def _stop_stage(pid: int) -> None:
    """SIGTERM to the stage's processes: the ones `accelerate launch` (`pid`) started, or `pid` itself when
    nothing launched it. Not to the launcher: on SIGTERM it gives its children 5 s before killing them,
    less than a training step may need to end and save."""
    try:
        targets = psutil.Process(pid).children(recursive=True) or [psutil.Process(pid)]
    except psutil.NoSuchProcess:
        return
    for target in targets:
        with contextlib.suppress(psutil.NoSuchProcess):
            target.send_signal(signal.SIGTERM)


@contextmanager
def _handling(signals: tuple[signal.Signals, ...], handler: Callable[[int, Any], None]) -> Iterator[None]:
    """`handler` for `signals` for the block (in the main thread; elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
