"""Shared fixtures: offline mode, the shipped demo assets, and running scripts as a user would."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

# Never touch a hub from the tests: everything they load is built locally.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under pytest-xdist (`make test` runs two workers) every worker and the scripts it launches use one
# thread: two processes of two BLAS/OpenMP threads each on two cores spin against each other and
# ran a GRPO run 5x slower than alone.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


@pytest.fixture(scope="session")
def demo_assets() -> Path:
    """The demo assets shipped inside fitrl (`fitrl/demo/assets`): every test reads them, none writes there."""
    from fitrl import demo

    return demo.SHIPPED


def load_run_info(directory: Path) -> dict:
    """A stage's `run_info.json` read through its schema (`fitrl.artifacts.RunInfo`), as the object the
    file holds ({} when there is none)."""
    from fitrl.artifacts import RunInfo, to_dict

    info = RunInfo.read(directory)
    return {} if info is None else to_dict(info)


def run_main(script: str, *args: str | Path) -> int:
    """Run `scripts/<script>` in this process as Python runs a script (`__main__`, `sys.argv` set); its
    exit code (0 when it returns). Faster than a subprocess where a test runs a light stage many times."""
    import runpy

    argv = sys.argv
    sys.argv = [str(ROOT / "scripts" / script), *map(str, args)]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = argv
    return 0


def run_script(
    *args: str | Path, timeout: int = 600, launcher: list[str] | None = None, cwd: Path = ROOT
) -> subprocess.CompletedProcess:
    """Run `scripts/<args[0]>` with the rest as CLI arguments, in a subprocess in `cwd`, as a user would."""
    script, *rest = args
    cmd = [*(launcher or [sys.executable]), str(ROOT / "scripts" / script), *map(str, rest)]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=os.environ.copy())


def sigterm_when(*args: str | Path, watch: Path, rows: int, timeout: int = 600) -> tuple[int, str]:
    """Run `scripts/<args[0]>` in a subprocess, send it SIGTERM once `watch` has `rows` lines (mid-run, as
    a preempted machine would), and return its exit code and its one `error:` line."""
    import signal
    import tempfile
    import time

    script, *rest = args
    cmd = [sys.executable, str(ROOT / "scripts" / script), *map(str, rest)]
    with tempfile.TemporaryFile("w+") as log:  # a pipe could fill up and stall the child
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log, env=os.environ.copy())
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            if watch.is_file() and len(watch.read_text().splitlines()) >= rows:
                break
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=timeout)
        log.seek(0)
        stderr = log.read()
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, f"expected one 'error:' line, got stderr:\n{stderr[-3000:]}"
    return proc.returncode, lines[0]


class Payload:
    """What a crafted pickle (a checkpoint, weights) smuggles in: unpickling it would create `path`.
    fitrl loads such files as tensors only, so `path` must never appear."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def free_port() -> str:
    """A TCP port nobody listens on now: DDP tests on parallel test workers must not share one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def accelerate_launch(num_processes: int, config_file: str | None = None) -> list[str]:
    """`accelerate launch` with flags, or with one of configs/accelerate/ (`config_file`, e.g. 'ddp_cpu_2proc')."""
    exe = Path(sys.executable).with_name("accelerate")
    if config_file is not None:
        path = CONFIGS / "accelerate" / f"{config_file}.yaml"
        return [str(exe), "launch", "--config_file", str(path), "--main_process_port", free_port()]
    cmd = [str(exe), "launch", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    if num_processes > 1:
        cmd += ["--multi_gpu", "--num_processes", str(num_processes), "--main_process_port", free_port()]
    else:
        cmd += ["--num_processes", "1"]
    return cmd


def error_line(result: subprocess.CompletedProcess) -> str:
    """The one line a failed script printed for the user."""
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, f"expected one 'error:' line, got stderr:\n{result.stderr[-3000:]}"
    return lines[0]


def assert_memory_planned_and_measured(info: dict) -> None:
    """`run_info.json` holds the planner's peak for the run beside the tensor peak it measured on one step.

    The plan takes the longest queries and responses the settings allow, a real step is usually shorter:
    measured may be below the plan, and never more than 10% above it.
    """
    memory = info["memory"]
    assert memory["device"] == "cpu" and memory["peak_rss_mb"] > 0
    planned, measured = memory["planned_peak_mb"], memory["measured_peak_mb"]
    assert planned > 0 and measured > 0, memory
    assert 0.7 < measured / planned < 1.10, memory


def demo_project(
    root: Path,
    demo_assets: Path,
    profile: str,
    overrides: dict[str, dict] | None = None,
    stages: list[str] | None = None,
) -> Path:
    """A project directory at `root` with the checkout's `pipeline.sh` and launchers, whose one profile is
    the demo's configs (each stage's `overrides` applied; only `stages` if given) under the name
    `profile`, reading the shipped demo assets. The stages run from the package (`fitrl.scripts`)."""
    import yaml

    (root / "pipeline.sh").symlink_to(ROOT / "pipeline.sh")
    (root / "configs").mkdir()
    (root / "configs" / "accelerate").symlink_to(CONFIGS / "accelerate")
    configs = root / "configs" / profile
    configs.mkdir()
    for config in sorted((CONFIGS / "demo").glob("*.yaml")):
        if stages is not None and config.stem not in stages:
            continue
        values = yaml.safe_load(config.read_text())
        values.update((overrides or {}).get(config.stem, {}), demo_assets=str(demo_assets))
        (configs / config.name).write_text(yaml.safe_dump(values, sort_keys=False))
    return root


def pipeline_env(**extra: str) -> dict[str, str]:
    """This interpreter's environment first on PATH: `pipeline.sh` and `accelerate` run with it."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", **extra}


def bash_pipeline(cwd: Path, *args: str, timeout: int = 900, **env: str) -> subprocess.CompletedProcess:
    """`bash pipeline.sh ARGS` in the project directory `cwd`, as a user runs it."""
    return subprocess.run(
        ["bash", str(cwd / "pipeline.sh"), *args],
        cwd=cwd,
        env=pipeline_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
