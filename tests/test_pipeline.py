"""pipeline.sh: which stages a profile runs, in what order, and how it refuses a bad request."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import CONFIGS, ROOT, bash_pipeline, demo_project, load_run_info, pipeline_env


def _pipeline(*args: str, **env: str) -> subprocess.CompletedProcess:
    """`bash pipeline.sh` in the repository, a dry run unless `DRY_RUN` says otherwise."""
    return bash_pipeline(ROOT, *args, **{"DRY_RUN": "1", **env})


def _programs(stdout: str) -> list[str]:
    """The module each command line runs (`-m fitrl.scripts.<stage>`)."""
    found = []
    for line in stdout.splitlines():
        words = line.split()
        if "-m" in words:
            found.append(words[words.index("-m") + 1].removeprefix("fitrl.scripts."))
    return found


# Every stage, in the pipeline's order: the demo's and the Qwen profile's (eval_dpo runs eval's program)
WHOLE_MENU = ["sft", "merge", "rm", "ppo", "eval", "dpo", "eval", "grpo", "eval_gsm8k"]


@pytest.mark.parametrize(
    ("profile", "scripts"),
    [
        ("demo", WHOLE_MENU),
        ("neox20b-24gb", WHOLE_MENU[:6]),  # up to DPO, without its evaluation
        ("llama1b-16gb", ["grpo", "eval_gsm8k"]),
        ("qwen0.5b-16gb", WHOLE_MENU),
        ("demo-arithmetic", ["ppo", "eval_gsm8k"]),  # PPO on GRPO's task, then GRPO's evaluation
    ],
)
def test_profile_runs_every_stage_it_has_a_config_for(profile: str, scripts: list[str]) -> None:
    result = _pipeline(PROFILE=profile)
    assert result.returncode == 0, result.stderr
    assert _programs(result.stdout) == scripts
    for line in result.stdout.splitlines()[:-1]:
        assert f"--config configs/{profile}/" in line
        assert (CONFIGS.parent / line.split("--config ")[1].split()[0]).is_file()


def test_stages_picks_a_subset_and_launch_is_used_for_training() -> None:
    result = _pipeline(STAGES="grpo eval_gsm8k", LAUNCH="accelerate launch --multi_gpu --num_processes 2")
    assert result.returncode == 0, result.stderr
    grpo, evaluation = result.stdout.splitlines()[:2]
    assert grpo.startswith("accelerate launch --multi_gpu --num_processes 2 -m fitrl.scripts.grpo ")
    assert evaluation.startswith("python -m fitrl.scripts.eval_gsm8k ")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"STAGES": "sft bogus"}, "error: unknown stage 'bogus'"),
        ({"PROFILE": "llama1b-16gb", "STAGES": "sft"}, "error: profile 'llama1b-16gb' has no stage 'sft'"),
        ({"PROFILE": "nope"}, "error: no profile configs/nope"),
        ({"PROFILE": "accelerate"}, "error: no profile configs/accelerate"),  # launcher configs, no stages
    ],
)
def test_bad_request_exits_2_with_one_line(env: dict[str, str], message: str) -> None:
    result = _pipeline(**env)
    assert result.returncode == 2
    assert result.stdout == "", "nothing may run before the request is checked"
    assert result.stderr.strip().splitlines()[-1].startswith(message)


@pytest.mark.slow
def test_a_failing_stage_under_accelerate_exits_2_with_one_line(tmp_path: Path, demo_assets: Path) -> None:
    """accelerate reports any failed child as exit 1 with a traceback; the pipeline keeps the stage's own 2."""
    (tmp_path / "configs" / "broken").mkdir(parents=True)
    (tmp_path / "pipeline.sh").symlink_to(ROOT / "pipeline.sh")
    config = (CONFIGS / "demo" / "ppo.yaml").read_text().replace("outputs/demo/merged", str(tmp_path / "no-such-model"))
    config = config.replace("reward_adapter: outputs/demo/rm", "reward_adapter: null")  # the classifier scores
    # the shipped demo assets, named: the reward model is resolved first
    (tmp_path / "configs" / "broken" / "ppo.yaml").write_text(config + f"demo_assets: {demo_assets}\n")
    result = subprocess.run(
        ["bash", str(tmp_path / "pipeline.sh")],
        cwd=tmp_path,
        env={**os.environ, "PROFILE": "broken", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "does not exist" in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr


def test_help_lists_stages_profiles_options_and_examples() -> None:
    result = _pipeline("--help", DRY_RUN="0")
    assert result.returncode == 0, result.stderr
    expected = ["sft merge rm ppo eval dpo eval_dpo grpo eval_gsm8k", "demo", "neox20b-24gb", "ddp_cpu_2proc"]
    expected += ["--from", "--run_dir", "--launcher", "--force", "--dry_run", "bash pipeline.sh --profile llama1b-16gb"]
    for text in expected:
        assert text in result.stdout, text


def test_a_projects_own_launcher_is_listed_and_named_like_a_shipped_one(tmp_path: Path) -> None:
    """`fitrl pipeline` in a project of the user's: its configs/accelerate/<name>.yaml is a launcher by
    name, listed in --help beside the checkout's, and a shipped name it redefines means its own file."""
    (tmp_path / "configs" / "accelerate").mkdir(parents=True)
    shutil.copytree(CONFIGS / "demo", tmp_path / "mine")
    for name in ("mine", "single_gpu"):
        shutil.copy(CONFIGS / "accelerate" / "ddp_cpu_2proc.yaml", tmp_path / "configs" / "accelerate" / f"{name}.yaml")

    def pipeline(*args: str) -> subprocess.CompletedProcess:
        script = [sys.executable, str(ROOT / "scripts" / "pipeline.py"), *args]
        return subprocess.run(script, cwd=tmp_path, env=pipeline_env(), capture_output=True, text=True, timeout=300)

    launchers = next(line for line in pipeline("--help").stdout.splitlines() if line.startswith("launchers: "))
    assert {"mine", "single_gpu", "ddp_cpu_2proc", "fsdp2"} <= set(launchers.split()[1:]), launchers
    for name in ("mine", "single_gpu"):
        result = pipeline("--profile", "mine", "--stages", "sft", "--launcher", name, "--dry_run")
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"--config_file configs/accelerate/{name}.yaml " in result.stdout, result.stdout  # the project's
    shipped = pipeline("--profile", "mine", "--stages", "sft", "--launcher", "fsdp2", "--dry_run")
    from fitrl.stages import SHIPPED_CONFIGS

    assert f"--config_file {SHIPPED_CONFIGS / 'accelerate' / 'fsdp2.yaml'} " in shipped.stdout, shipped.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--profile", "nope"], "error: no profile configs/nope"),
        (["--from", "bogus"], "error: unknown stage 'bogus' for --from"),
        (["--stages", "sft", "--from", "ppo"], "error: give --stages (or STAGES) or --from, not both"),
        (["--launcher", "nosuch"], "error: unknown launcher 'nosuch'"),
        (["--frobnicate"], "error: unrecognized arguments: --frobnicate"),
    ],
)
def test_bad_options_exit_2_with_one_line(args: list[str], message: str) -> None:
    result = _pipeline(*args, DRY_RUN="0")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [result.stderr.strip().splitlines()[-1]]
    assert result.stderr.strip().startswith(message), result.stderr


def test_from_runs_a_stage_and_every_one_after_it() -> None:
    result = _pipeline(PROFILE="demo", STAGES="")
    everything = _programs(result.stdout)
    result = _pipeline("--from", "eval")
    after_ppo = ["eval", "dpo", "eval", "grpo", "eval_gsm8k"]
    assert _programs(result.stdout) == everything[4:] == after_ppo
    assert "--adapter_dir outputs/demo/ppo" in result.stdout.splitlines()[0]  # its input, from the run directory


# The demo profile, cut to what shows the machinery in about two minutes: the stages that feed one
# another in both directions of a run directory (rm and dpo run through the pipeline in test_profiles).
QUICK = {
    "sft": {"max_steps": 6, "logging_steps": 2},
    "merge": {},
    "ppo": {"steps": 4, "save_steps": 1, "reward_adapter": None},  # the demo classifier scores: no rm stage
    "eval": {"n_prompts": 16},
    "grpo": {"max_steps": 2, "per_device_train_batch_size": 16, "max_samples": 64},
    "eval_gsm8k": {"max_samples": 16},
}


@pytest.fixture
def quick_project(tmp_path: Path, demo_assets: Path) -> Path:
    """A project directory whose one profile is a short demo, with the real scripts and launchers."""
    return demo_project(tmp_path, demo_assets, "quick", QUICK, stages=list(QUICK))


def _edit(path: Path, **values: object) -> None:
    import yaml

    path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), **values}, sort_keys=False))


def _status(stderr: str) -> dict[str, str]:
    """Each stage's console verdict: running (why) / skipped."""
    lines = [line for line in stderr.splitlines() if line.startswith("== [")]
    return {line.split("] ")[1].split(":")[0]: line.split(": ", 1)[1] for line in lines}


@pytest.mark.slow
def test_pipeline_runs_skips_reruns_after_a_change_and_resumes_a_killed_stage(quick_project: Path) -> None:
    run_dir = quick_project / "outputs" / "quick"
    first = bash_pipeline(quick_project, "--profile", "quick")
    assert first.returncode == 0, first.stderr[-3000:]
    stages = list(QUICK)
    assert list(_status(first.stderr)) == stages
    for stage in ["merged" if s == "merge" else s for s in stages]:
        assert (run_dir / stage / "run_config.yaml").is_file(), stage
    for stage in stages:
        assert (run_dir / "logs" / f"{stage}.log").stat().st_size > 0, stage
    report = (run_dir / "report.md").read_text()
    figures = ["loss ", "verified: max logit difference", "reward ", "held-out reward", "accuracy ", "wall time"]
    for figure in [*figures, "peak memory planned"]:
        assert figure in report, figure
    assert "data:image/png;base64," in (run_dir / "report.html").read_text()
    assert "memory plan: peak" in first.stderr  # each training stage was planned first

    again = bash_pipeline(quick_project, "--profile", "quick")
    assert again.returncode == 0, again.stderr[-3000:]
    assert all(v.startswith("skipped") for v in _status(again.stderr).values()), again.stderr
    assert "ran: none (all done)" in again.stderr

    _edit(quick_project / "configs" / "quick" / "grpo.yaml", learning_rate=0.002)
    changed = bash_pipeline(quick_project, "--profile", "quick")
    assert changed.returncode == 0, changed.stderr[-3000:]
    status = _status(changed.stderr)
    assert all(status[s].startswith("skipped") for s in ["sft", "merge", "ppo", "eval"]), status
    assert status["grpo"] == "running (settings changed: learning_rate)"
    assert status["eval_gsm8k"] == "running (its input, grpo, re-ran)"

    # Kill PPO once it has saved a checkpoint; the next run resumes from it.
    shutil.rmtree(run_dir / "ppo.checkpoints")  # the first run's: this one starts afresh
    _edit(quick_project / "configs" / "quick" / "ppo.yaml", steps=6, init_kl_coef=0.3)
    proc = subprocess.Popen(
        ["bash", "pipeline.sh", "--profile", "quick", "--stages", "ppo"],
        cwd=quick_project,
        env=pipeline_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    checkpoint = run_dir / "ppo.checkpoints" / "step-2"
    deadline = time.monotonic() + 600
    while not checkpoint.is_dir() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert checkpoint.is_dir()
    resumed = bash_pipeline(quick_project, "--profile", "quick", "--stages", "ppo")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _status(resumed.stderr)["ppo"].startswith("running (resumed from step-")
    assert load_run_info(run_dir / "ppo")["resumed_from"].endswith(("step-2", "step-3", "step-4", "step-5"))


@pytest.mark.parametrize("config", sorted((CONFIGS / "accelerate").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_accelerate_config_loads_and_validates(config: Path) -> None:
    """accelerate reads each launcher config and fills a launch from it, DeepSpeed and FSDP ones included."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    cluster = load_config_from_file(str(config))
    args, _defaults, _mixed = _validate_launch_command(
        launch_command_parser().parse_args(["--config_file", str(config), "scripts/sft.py"])
    )
    assert args.num_processes == cluster.num_processes >= 1
    assert config.read_text().startswith("#"), "each launcher config says when to use it and what it costs"
    sharded = {"deepspeed_zero2": "use_deepspeed", "deepspeed_zero3": "use_deepspeed", "fsdp2": "use_fsdp"}
    if config.stem in sharded:
        assert getattr(args, sharded[config.stem])


def test_a_launcher_config_with_an_unknown_key_is_refused(tmp_path: Path) -> None:
    from accelerate.commands.config.config_args import load_config_from_file

    bad = tmp_path / "bad.yaml"
    bad.write_text((CONFIGS / "accelerate" / "fsdp2.yaml").read_text() + "num_procesess: 4\n")
    with pytest.raises(ValueError, match="unknown keys"):
        load_config_from_file(str(bad))


def test_a_stage_config_the_stage_would_refuse_stops_the_pipeline_with_one_line(tmp_path: Path) -> None:
    for name in ["pipeline.sh"]:
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / "configs" / "bad").mkdir(parents=True)
    (tmp_path / "configs" / "accelerate").symlink_to(CONFIGS / "accelerate")
    (tmp_path / "configs" / "bad" / "sft.yaml").write_text(
        (CONFIGS / "demo" / "sft.yaml").read_text() + "lerning_rate: 1\n"
    )
    result = bash_pipeline(tmp_path, "--profile", "bad", timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [errors[-1]] and "unknown key 'lerning_rate'" in errors[0], result.stderr
    assert not (tmp_path / "outputs" / "bad" / "sft").exists()


@pytest.mark.parametrize("where", ["a user's folder", "home"])
def test_a_run_directory_fitrl_did_not_make_is_refused_and_left_alone(tmp_path: Path, where: str) -> None:
    home = tmp_path / "home"
    run_dir = home / "mine" if where == "a user's folder" else home
    run_dir.mkdir(parents=True)
    (run_dir / "report.md").write_text("a user's report")
    result = _pipeline("--run_dir", str(run_dir), DRY_RUN="0", HOME=str(home))
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("error:") == 1 and "run directory" in result.stderr, result.stderr
    assert (run_dir / "report.md").read_text() == "a user's report"
    assert sorted(p.name for p in run_dir.iterdir()) == ["report.md"]


def test_a_run_directory_with_a_tilde_is_under_home(tmp_path: Path) -> None:
    result = _pipeline("--run_dir=~/runs/t", HOME=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert f"--output_dir {tmp_path}/runs/t/sft" in result.stdout.splitlines()[0]
    assert not (ROOT / "~").exists()


def test_ppo_takes_the_rm_output_only_where_its_config_names_a_reward_adapter(tmp_path: Path) -> None:
    from fitrl.stages import get, stage_args

    for name in ["merge", "rm"]:
        (tmp_path / f"{name}.yaml").write_text("seed: 1\n")
    run = Path("/runs/mine")
    (tmp_path / "ppo.yaml").write_text("reward_adapter: outputs/mine/rm\n")
    assert stage_args(get("ppo"), tmp_path, run)[-4:] == [
        *("--model_name_or_path", str(run / get("merge").output_dir)),
        *("--reward_adapter", str(run / get("rm").output_dir)),
    ]
    (tmp_path / "ppo.yaml").write_text("reward_model: my-classifier\n")  # a classifier: no rm input
    assert "--reward_adapter" not in stage_args(get("ppo"), tmp_path, run)
