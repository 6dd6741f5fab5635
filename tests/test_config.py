"""Config parsing: YAML + CLI overrides, and bad values stopped with one line and exit code 2."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest
import yaml

from fitrl import stages
from fitrl.config import UsageError, check, help_field, load_run_config, parse_config, save_run_config

from conftest import CONFIGS, error_line, run_script


@dataclass
class Toy:
    name: str = help_field("a", "a name")
    rate: float = help_field(0.1, "a rate")
    count: int = help_field(2, "a count")
    mode: Literal["x", "y"] = help_field("x", "a mode")
    flag: bool = help_field(False, "a flag")
    items: list[str] | None = help_field(None, "some items")

    def validate(self) -> None:
        check(self.rate > 0, "rate", "> 0")


def _yaml(tmp_path: Path, content: dict) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(content))
    return str(path)


def test_yaml_then_cli_override(tmp_path: Path) -> None:
    cfg = _yaml(tmp_path, {"rate": "2e-5", "count": 7, "mode": "y", "items": ["q", "v"]})
    (toy,) = parse_config([Toy], ["--config", cfg, "--count", "9"])
    assert (toy.rate, toy.count, toy.mode, toy.items) == (2e-5, 9, "y", ["q", "v"])


@pytest.mark.parametrize(
    ("content", "argv", "message"),
    [
        ({"colour": 1}, [], "unknown key 'colour'"),
        ({"count": 1.5}, [], "invalid value for 'count': must be int"),
        ({"count": True}, [], "invalid value for 'count': must be int"),
        ({"mode": "z"}, [], "invalid value for 'mode': must be one of x, y"),
        ({}, ["--rate", "0"], "invalid value for 'rate': must be > 0"),
        ({}, ["--count", "abc"], "invalid int value"),
        ({}, ["--nope", "1"], "unknown flag"),
        ({}, ["--rate", "-1e-3"], "invalid value for 'rate': must be > 0"),  # a negative number, not a flag
        # an abbreviation is no flag: the YAML refuses the same key (GRPO read `--num_samples` as
        # `--num_samples_to_show`)
        ({}, ["--cou", "3"], r"unknown flag\(s\) \['--cou', '3'\]"),
        ({}, ["--rat=0.5"], "unknown flag"),
    ],
)
def test_bad_values_raise_one_line(tmp_path: Path, content: dict, argv: list[str], message: str) -> None:
    with pytest.raises(UsageError, match=message) as info:
        parse_config([Toy], ["--config", _yaml(tmp_path, content), *argv])
    assert "\n" not in str(info.value)


def test_config_equals_file_is_read_as_config_file(tmp_path: Path) -> None:
    cfg = _yaml(tmp_path, {"count": 7})
    (toy,) = parse_config([Toy], [f"--config={cfg}", "--rate", "0.5"])
    assert (toy.count, toy.rate) == (7, 0.5)
    with pytest.raises(UsageError, match="unknown key 'colour'"):
        parse_config([Toy], [f"--config={_yaml(tmp_path, {'colour': 1})}"])


def test_the_pipeline_and_planner_take_no_abbreviation() -> None:
    from fitrl.config import ArgumentParser

    parser = ArgumentParser(prog="x")
    parser.add_argument("--stages", nargs="*")
    with pytest.raises(UsageError, match="unrecognized arguments: --stage"):
        parser.parse_args(["--stage", "sft"])


def test_missing_config_file() -> None:
    with pytest.raises(UsageError, match="config file not found"):
        parse_config([Toy], ["--config", "/nonexistent/c.yaml"])


def test_run_config_round_trips(tmp_path: Path) -> None:
    (toy,) = parse_config([Toy], ["--rate", "0.5", "--items", "a", "b"])
    save_run_config(tmp_path, toy)
    assert load_run_config(tmp_path)["items"] == ["a", "b"]
    (again,) = parse_config([Toy], ["--config", str(tmp_path / "run_config.yaml")])
    assert again == toy


def test_every_profile_parses() -> None:
    """Each shipped YAML fills its stage's dataclasses without an unknown key or a bad value."""
    for path in sorted(CONFIGS.glob("*/*.yaml")):
        if path.parent.name == "accelerate":
            continue
        parse_config(stages.get(path.stem).config_types, ["--config", str(path)])


# As a user sees it: the script exits 2 with one line, before any model loads.
@pytest.mark.parametrize(
    ("override", "message"),
    [
        (["--learning_rate", "-1"], "invalid value for 'learning_rate': must be > 0"),
        (["--lora_r", "0"], "invalid value for 'lora_r': must be an integer >= 1"),
        (["--quantization", "3bit"], "invalid choice"),
        (["--no_such_key", "1"], "unknown flag"),
    ],
)
def test_sft_script_rejects_bad_config(override: list[str], message: str) -> None:
    result = run_script("sft.py", "--config", CONFIGS / "demo" / "sft.yaml", *override)
    assert result.returncode == 2
    assert message in error_line(result)


@pytest.mark.parametrize(("script", "text"), [("sft.py", "~30% slower"), ("grpo.py", "~30% slower")])
def test_help_shows_every_help_string_as_written(script: str, text: str) -> None:
    result = run_script(script, "--help")
    assert result.returncode == 0, result.stderr[-2000:]
    assert text in " ".join(result.stdout.split())


@pytest.mark.parametrize(
    ("stage", "flag", "value", "message"),
    [
        ("sft", "--learning_rate", "inf", "'learning_rate': must be a finite number"),
        ("sft", "--weight_decay", "nan", "'weight_decay': must be a finite number"),
        ("sft", "--weight_decay", "-0.1", "'weight_decay': must be >= 0"),
        ("sft", "--seed", "-1", "'seed': must be >= 0"),
        ("ppo", "--vf_coef", "-1", "'vf_coef': must be >= 0"),
        ("ppo", "--ratio_threshold", "-1", "'ratio_threshold': must be > 0"),
        ("ppo", "--init_kl_coef", "inf", "'init_kl_coef': must be a finite number"),
        ("grpo", "--adam_beta1", "1.5", "'adam_beta1': must be in [0, 1)"),
        ("grpo", "--weight_decay", "-0.1", "'weight_decay': must be >= 0"),
        ("eval_gsm8k", "--seed", "-1", "'seed': must be >= 0"),
    ],
)
def test_every_numeric_setting_is_checked_for_range_and_finiteness(stage: str, flag: str, value: str, message: str):
    """Values nothing checked before: nan and inf pass every comparison a range check makes (or most),
    a negative weight decay trained and exited 0, a negative seed died in a traceback."""
    config = CONFIGS / "demo" / f"{stage}.yaml"
    with pytest.raises(UsageError, match=re.escape(message)):
        stages.get(stage).parse(["--config", str(config), flag, value])
