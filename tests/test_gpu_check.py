"""`bench/gpu_check.py` is ready before a GPU is: the same code on the CPU with tiny models, the
wheels it installs on a machine without network, and its one-line refusals."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT

SCRIPT = ROOT / "bench" / "gpu_check.py"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _wheel(folder: Path, name: str = "fitrl_probe", version: str = "0.1") -> Path:
    """A minimal pure-Python wheel, as pip builds one: the module, METADATA, WHEEL and RECORD."""
    folder.mkdir()
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}.py": "PROBE = 1\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{f},,\n" for f in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for f, text in {**files, f"{info}/RECORD": record}.items():
            z.writestr(f, text)
    return path


@pytest.mark.slow
def test_every_row_runs_on_cpu_with_tiny_models_and_the_wheels_given(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    _wheel(tmp_path / "wheels")
    cmd = [sys.executable, str(SCRIPT), "--tiny", "--wheels", str(tmp_path / "wheels"), "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(out.read_text())
    # The wheels were installed (no network, no dependencies) and the check ran again with them.
    assert found["installed"] == ["fitrl_probe-0.1"]
    rows = found["rows"]
    assert [r["row"] for r in rows] == [r.name for r in _module().ROWS]
    for row in rows:
        assert "error" not in row, row
        # The profile's own settings reached the step: the shipped optimizer, the configured base.
        assert ("4bit base" if row["row"].endswith("-4bit") else "") in row["workload"]
        # Real bitsandbytes layers against the plan's stand-ins, phase by phase, within 3% (as in
        # test_planner) plus the 0.1 MiB the rows round to (the tiny rows hold a few MiB).
        for phase, measured in row["measured_phase_mb"].items():
            assert abs(row["planned_phase_mb"][phase] - measured) <= 0.03 * measured + 0.1, (row["row"], phase, row)
        assert row["micro_step_seconds"] > 0 and row["trained_tokens_per_s"] > 0
    by_name = {r["row"]: r for r in rows}
    assert by_name["neox20b-24gb/ppo"]["generated_tokens_per_s"] > 0  # the rollout ran
    assert by_name["neox20b-24gb/ppo"]["reward_model_mb"] > 0  # PPO's classifier, counted beside
    assert "adamw_bnb_8bit" in by_name["neox20b-24gb/sft"]["workload"]
    assert "generated_tokens_per_s" not in by_name["neox20b-24gb/sft"]  # SFT generates nothing


def test_an_unknown_row_is_refused_before_anything_runs(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    cmd = [sys.executable, str(SCRIPT), "--tiny", "--rows", "neox20b-24gb/ppo,llama1b-16gb/dpo", "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "unknown row(s) llama1b-16gb/dpo in --rows" in result.stderr
    assert not out.exists()


def test_a_missing_package_is_named_in_one_line(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    check = _module()
    monkeypatch.setattr(check, "NEEDED", ("torch", "no_such_package_here"))
    monkeypatch.delenv(check.INSTALLED_ENV, raising=False)
    with pytest.raises(SystemExit) as stop:
        check.check_packages(None, [])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: this machine lacks no_such_package_here; give --wheels DIR (bash bench/gpu_wheels.sh DIR makes it)"
    ]


def test_a_wheel_folder_without_wheels_is_refused(tmp_path: Path, capsys) -> None:
    check = _module()
    with pytest.raises(SystemExit) as stop:
        check.install_wheels(tmp_path, [])
    assert stop.value.code == 2
    assert capsys.readouterr().err.startswith(f"error: no .whl files in {tmp_path}; make them with")


def test_the_bounds_read_the_card_from_its_name() -> None:
    check = _module()
    assert check.peaks("NVIDIA H100 80GB HBM3") == (3.35e12, 989e12)
    assert check.peaks("NVIDIA H100 PCIe") == (2.0e12, 756e12)
    assert check.peaks("NVIDIA GeForce RTX 4090") == (1.008e12, 165e12)
    assert check.peaks("Some Other Card") is None
