"""The `fitrl` command (`fitrl/cli.py`), as installed by the project's install: every stage and tool by
name, and a stage's own exit code and one `error:` line where a bare `accelerate launch` gives exit 1
and its traceback. A stage run through it writing what a direct run writes: tests/test_sft.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fitrl.stages import NAMES

from conftest import CONFIGS

FITRL = Path(sys.executable).parent / "fitrl"


def _fitrl(*args: str | Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(FITRL), *map(str, args)], capture_output=True, text=True, timeout=timeout)


def test_help_names_every_stage_and_tool() -> None:
    result = _fitrl("--help")
    assert result.returncode == 0, result.stderr
    for name in [*NAMES, "pipeline", "plan", "doctor", "report"]:
        assert f"\n  {name} " in result.stdout, name
    assert _fitrl().returncode == 2  # nothing to run: the usage, exit 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["sftt"], "error: unknown stage or tool 'sftt'; known: sft merge"),
        (["sft", "--num_processes"], "error: --num_processes needs a value"),
        (["ppo", "--config_file", "no/such.yaml"], "error: accelerate config no/such.yaml does not exist"),
    ],
)
def test_a_bad_command_line_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    result = _fitrl(*args)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and result.stderr.startswith(message)


def test_a_stage_refusing_its_config_under_accelerate_keeps_its_exit_code_and_one_line(tmp_path: Path) -> None:
    """A bare `accelerate launch` turns the stage's exit 2 into 1 and appends its own traceback."""
    result = _fitrl("sft", "--config", CONFIGS / "demo" / "sft.yaml", "--learning_rate", "-1",
                    "--output_dir", tmp_path / "sft")  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == ["error: invalid value for 'learning_rate': must be > 0"]
    assert not (tmp_path / "sft").exists()


def test_the_stderr_filter_keeps_bars_live_and_says_an_error_line_once() -> None:
    from fitrl.cli import StderrFilter

    passed = StderrFilter()
    # a progress bar passes as it comes, mid-line; an error line is held until it ends
    assert passed(b"10%|#  \r20%|## ", failed=False) == b"10%|#  \r20%|## "
    assert passed(b"\rdone\nerr", failed=False) == b"\rdone\n"
    assert passed(b"or: bad value", failed=False) == b""
    assert passed(b"\n", failed=False) == b"error: bad value\n"
    # the second rank's same line, then accelerate's traceback once the stage has failed
    assert passed(b"error: bad value\nTraceback (most recent call last):\n  File", failed=True) == b""
    assert passed(b' "x.py"\nerror: another\n', failed=True) == b"error: another\n"
    # a bar passed mid-line, then the stage fails: its line is ended before the error line starts
    bar = StderrFilter()
    assert bar(b"PPO:   1%| 2/500", failed=False) == b"PPO:   1%| 2/500"
    assert (
        bar(b"\nerror: stopped by SIGTERM after step 2\n", failed=True) == b"\nerror: stopped by SIGTERM after step 2\n"
    )


def test_ppo_under_a_sharding_config_is_refused_in_one_line(tmp_path: Path) -> None:
    """FSDP2 over two CPU processes: each rank refuses, and the line is said once."""
    fsdp2 = CONFIGS / "accelerate" / "fsdp2.yaml"
    result = _fitrl("ppo", "--config", CONFIGS / "demo" / "ppo.yaml", "--model_name_or_path", "demo://lm",
                    "--output_dir", tmp_path / "ppo", "--config_file", fsdp2)  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [
        "error: PPO does not run under FSDP: its policy, reference, value head and reward adapter share one backbone "
        "that sharding would split; launch on one device or with DDP (configs/accelerate/single_gpu.yaml, "
        "ddp_2gpu.yaml)"
    ]
    assert not (tmp_path / "ppo").exists()


def test_tools_run_with_their_own_options(demo_assets: Path) -> None:
    result = _fitrl("plan", "--config", CONFIGS / "demo" / "sft.yaml", "--demo_assets", demo_assets, "--brief")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("memory plan: peak")


def test_every_launch_shares_the_machines_cores_among_its_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a direct run of a stage takes (`fitrl.process.thread_rule`: every core), a launched one gets too:
    the cores divided among the processes its command starts, unless OMP_NUM_THREADS says otherwise."""
    from fitrl import launch

    monkeypatch.setattr(launch, "cpu_cores", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    config = tmp_path / "ddp.yaml"
    config.write_text("distributed_type: MULTI_GPU\nnum_processes: 4\n")
    commands = {
        "python scripts/merge.py": 8,
        "accelerate launch --quiet --num_processes 1 scripts/sft.py": 8,
        "accelerate launch --num_processes 2 scripts/sft.py": 4,
        f"accelerate launch --config_file {config} scripts/sft.py": 2,
        f"accelerate launch --config_file {tmp_path / 'missing.yaml'} scripts/sft.py": 8,
        "accelerate launch --num_processes 16 scripts/sft.py": 1,
    }
    for command, threads in commands.items():
        assert launch.launch_env(command.split())["OMP_NUM_THREADS"] == str(threads), command
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert launch.launch_env("accelerate launch --num_processes 2 x.py".split())["OMP_NUM_THREADS"] == "3"


@pytest.mark.slow
def test_ctrl_c_stops_a_stage_at_the_end_of_its_step_with_one_line_naming_the_checkpoint(
    tmp_path: Path, demo_assets: Path
) -> None:
    """Ctrl-C reaches the `fitrl` command (the terminal's foreground group): the stage, in a session of
    its own, gets SIGTERM from it, finishes the step, saves a checkpoint and says where; no traceback."""
    import os
    import signal
    import tempfile
    import time

    out = tmp_path / "run"
    args = ["ppo", "--config", CONFIGS / "demo" / "ppo.yaml", "--model_name_or_path", "demo://lm"]
    args += ["--reward_adapter", "", "--demo_assets", demo_assets, "--output_dir", out, "--steps", "500"]
    args += ["--batch_size", "8", "--forward_batch_size", "8", "--mini_batch_size", "8"]
    watch = tmp_path / ".run.partial" / "metrics.jsonl"
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            [str(FITRL), *map(str, args)], stdout=subprocess.DEVNULL, stderr=log, start_new_session=True
        )
        deadline = time.monotonic() + 600
        while proc.poll() is None and not (watch.is_file() and watch.read_text()) and time.monotonic() < deadline:
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal sends its foreground group
        proc.wait(timeout=600)
        log.seek(0)
        stderr = log.read()
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 143 and len(lines) == 1, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    step = int(lines[0].split("after step ")[1].split(";")[0])
    assert f"saved {tmp_path / 'run.checkpoints' / f'step-{step}'}" in lines[0]
