"""fitrl as its peers install: a wheel, installed without the checkout on the path, and run from an empty
directory: `fitrl --help`, a stage with the user's own config, the shipped demo profile's first stages
through the pipeline, `fitrl plan` and `fitrl doctor`. Everything it needs (the stages' programs, the
shipped configs, the demo's assets) is inside the wheel."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import yaml

from conftest import CONFIGS, ROOT


def _wheel(tmp_path: Path) -> Path:
    """The wheel, built from a copy of what it is made of (the package, configs/, pyproject.toml, the
    README), so the build writes nothing into the checkout."""
    source = tmp_path / "source"
    source.mkdir()
    shutil.copytree(ROOT / "fitrl", source / "fitrl", symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(CONFIGS, source / "configs")
    for name in ["pyproject.toml", "README.md"]:
        shutil.copy(ROOT / name, source / name)
    out = tmp_path / "dist"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(source)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (wheel,) = out.glob("fitrl-*.whl")
    return wheel


def _venv(tmp_path: Path, wheel: Path) -> Path:
    """A fresh virtual environment with the wheel installed. Its dependencies come from this interpreter's
    site-packages through a path file (no hub, no index): that adds the directory alone, not the editable
    checkout that this environment's own `.pth` files would put on the path."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True
    ).stdout.strip()
    Path(site, "fitrl-test-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    cmd = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return venv


@pytest.mark.slow
def test_the_wheel_installs_and_runs_a_stage_and_the_pipeline_from_an_empty_directory(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    for needed in ["fitrl/scripts/sft.py", "fitrl/configs/demo/sft.yaml", "fitrl/demo/assets/lm/model.safetensors"]:
        assert needed in names, needed
    venv = _venv(tmp_path, wheel)
    work = tmp_path / "empty"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}:{env['PATH']}"

    def run(*args: str | Path, timeout: int = 900) -> subprocess.CompletedProcess:
        return subprocess.run(list(map(str, args)), cwd=work, env=env, capture_output=True, text=True, timeout=timeout)

    where = run(venv / "bin" / "python", "-c", "import fitrl, fitrl.scripts.sft; print(fitrl.__file__)")
    assert where.returncode == 0, where.stderr[-2000:]
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout  # the wheel's, not the checkout's
    fitrl = venv / "bin" / "fitrl"
    usage = run(fitrl, "--help")
    assert usage.returncode == 0 and "fitrl.scripts.sft" in usage.stdout, usage.stdout + usage.stderr

    # a stage with the user's own config, its paths read from here
    (work / "mine").mkdir()
    config = yaml.safe_load((CONFIGS / "demo" / "sft.yaml").read_text()) | {"max_steps": 2, "logging_steps": 1}
    (work / "mine" / "sft.yaml").write_text(yaml.safe_dump(config | {"output_dir": "out/sft"}))
    sft = run(fitrl, "sft", "--config", "mine/sft.yaml")
    assert sft.returncode == 0, sft.stderr[-3000:]
    assert (work / "out" / "sft" / "adapter_model.safetensors").is_file()

    plan = run(fitrl, "plan", "--config", "mine/sft.yaml", "--brief")
    assert plan.returncode == 0 and plan.stdout.startswith("memory plan: peak"), plan.stderr[-2000:]
    doctor = run(fitrl, "doctor", "--profile", "demo")
    assert doctor.returncode == 0 and doctor.stdout.strip().endswith("ready"), doctor.stdout + doctor.stderr

    # the shipped demo profile's first stages, by name, into a run directory here
    pipeline = run(fitrl, "pipeline", "--profile", "demo", "--stages", "sft", "merge", "--run_dir", "runs/demo")
    assert pipeline.returncode == 0, pipeline.stderr[-3000:]
    assert (work / "runs" / "demo" / "merged" / "config.json").is_file()
    assert (work / "runs" / "demo" / "report.md").is_file()
    assert sorted(p.name for p in work.iterdir()) == ["mine", "out", "runs"]  # nothing else written here
