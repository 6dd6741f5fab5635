"""Inputs a user can get wrong, or files a crash left damaged, as found by a battery of bad inputs: each
is one `error:` line and exit 2, nothing written, and no code from a model folder or checkpoint runs.

Every case runs the stage in this process (`run_main`) and fails before training starts, so the file
costs seconds."""

from __future__ import annotations

import json
import pickle
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CONFIGS, ROOT, Payload, bash_pipeline, run_main


def _fails(capsys: pytest.CaptureFixture, script: str, *args: str | Path) -> str:
    """Run a stage that must refuse its input: exit 2 and one `error:` line, which is returned."""
    code = run_main(script, *args)
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1, (code, errors)
    return errors[0]


def _sft(capsys: pytest.CaptureFixture, tmp_path: Path, demo_assets: Path, *extra: str | Path) -> str:
    out = tmp_path / "out"
    line = _fails(capsys, "sft.py", "--config", CONFIGS / "demo" / "sft.yaml", "--demo_assets", demo_assets,
                  "--output_dir", out, "--max_steps", "1", *extra)  # fmt: skip
    assert not out.exists() and not (tmp_path / ".out.partial").exists()
    return line


def _model_copy(demo_assets: Path, tmp_path: Path, name: str = "lm") -> Path:
    copy = tmp_path / f"my-{name}"
    shutil.copytree(demo_assets / name, copy)
    return copy


# --- model folders ----------------------------------------------------------------------------------


def test_a_model_that_needs_its_own_code_is_refused_without_running_it(
    tmp_path: Path, demo_assets: Path, capsys: pytest.CaptureFixture
) -> None:
    model = _model_copy(demo_assets, tmp_path)
    config = json.loads((model / "config.json").read_text())
    config.update(model_type="my_custom", architectures=["MyCustomForCausalLM"])
    config["auto_map"] = {"AutoConfig": "custom.MyConfig", "AutoModelForCausalLM": "custom.MyModel"}
    (model / "config.json").write_text(json.dumps(config))
    marker = tmp_path / "custom-code-ran"
    (model / "custom.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    line = _sft(capsys, tmp_path, demo_assets, "--model_name_or_path", model)
    assert "cannot load a tokenizer" in line or "needs its own Python code" in line, line
    plan = _fails(capsys, "plan.py", "--config", CONFIGS / "demo" / "sft.yaml", "--model_name_or_path", model)
    assert "cannot plan for model" in plan and "config.json cannot be read" in plan
    assert not marker.exists()


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("crafted .bin", "its weights hold objects other than tensors and were refused"),
        ("truncated weights", "cannot load model"),
        ("a classifier", "cannot load model"),
        (
            "heads that do not divide the width",
            "transformers refuses its config.json (The hidden size is not divisible",
        ),
    ],
)
def test_a_model_folder_that_cannot_load_is_one_line(
    tmp_path: Path, demo_assets: Path, capsys: pytest.CaptureFixture, damage: str, message: str
) -> None:
    marker = tmp_path / "payload-ran"
    model = _model_copy(demo_assets, tmp_path, "classifier" if damage == "a classifier" else "lm")
    weights = model / "model.safetensors"
    if damage == "crafted .bin":
        weights.unlink()
        (model / "pytorch_model.bin").write_bytes(pickle.dumps(Payload(marker)))
    elif damage == "truncated weights":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage.startswith("heads"):  # transformers 5 validates the config as it reads it
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "num_attention_heads": 3}))
    assert message in _sft(capsys, tmp_path, demo_assets, "--model_name_or_path", model)
    assert not marker.exists()
    if damage.startswith("heads"):
        plan = _fails(capsys, "plan.py", "--config", CONFIGS / "demo" / "sft.yaml", "--model_name_or_path", model)
        assert "transformers refuses its config.json (The hidden size" in plan


def test_a_malformed_config_json_is_one_line_for_the_stage_and_the_planner(
    tmp_path: Path, demo_assets: Path, capsys: pytest.CaptureFixture
) -> None:
    model = _model_copy(demo_assets, tmp_path)
    (model / "config.json").write_text('{"model_type": "gpt_neox", ')
    assert "not a valid JSON file" in _sft(capsys, tmp_path, demo_assets, "--model_name_or_path", model)
    plan = _fails(capsys, "plan.py", "--config", CONFIGS / "demo" / "sft.yaml", "--model_name_or_path", model)
    assert "config.json cannot be read" in plan


# --- data, names, flags ---------------------------------------------------------------------------


def test_a_jsonl_row_that_is_not_utf8_names_its_line(
    tmp_path: Path, demo_assets: Path, capsys: pytest.CaptureFixture
) -> None:
    data = tmp_path / "reviews.jsonl"
    data.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9 ' + b"a good film " * 30 + b'"}\n')
    line = _sft(capsys, tmp_path, demo_assets, "--dataset", data)
    assert "line 2 is not UTF-8 text (byte 0xe9" in line and "save the file as UTF-8" in line


def test_an_sft_chat_row_that_is_no_chat_names_its_row(
    tmp_path: Path, demo_assets: Path, capsys: pytest.CaptureFixture
) -> None:
    data = tmp_path / "chats.jsonl"
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    data.write_text(json.dumps({"messages": chat}) + "\n" + json.dumps({"messages": [{"content": "Hi"}]}) + "\n")
    line = _sft(capsys, tmp_path, demo_assets, "--dataset", data, "--text_column", "messages")
    assert "row 2 of column 'messages' is not a chat" in line


def test_an_output_name_longer_than_a_file_name_can_be(
    tmp_path: Path, demo_assets: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / ("x" * 250)
    line = _fails(capsys, "sft.py", "--config", CONFIGS / "demo" / "sft.yaml", "--demo_assets", demo_assets,
                  "--output_dir", out)  # fmt: skip
    assert "is 250 bytes long" in line and "shorten it" in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(__import__("importlib").util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_a_tracker_whose_package_is_missing_is_refused_before_loading(
    tmp_path: Path, demo_assets: Path, capsys: pytest.CaptureFixture
) -> None:
    line = _sft(capsys, tmp_path, demo_assets, "--report_to", "wandb")
    assert "report_to wandb needs the wandb package" in line


# --- the files a stage reads from the stage before ------------------------------------------------


@pytest.fixture
def adapter(tmp_path: Path, demo_assets: Path) -> Path:
    """A real LoRA adapter on the demo LM, written as the SFT stage writes it."""
    import yaml
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(demo_assets / "lm")
    directory = tmp_path / "sft"
    get_peft_model(model, LoraConfig(r=2, target_modules=["query_key_value"])).save_pretrained(directory)
    (directory / "run_config.yaml").write_text(yaml.safe_dump({"model_name_or_path": "demo://lm"}))
    (directory / "run_info.json").write_text(json.dumps({"stage": "sft"}))
    return directory


def _merge(capsys: pytest.CaptureFixture, adapter: Path, demo_assets: Path) -> str:
    out = adapter.parent / "merged"
    line = _fails(capsys, "merge.py", "--config", CONFIGS / "demo" / "merge.yaml", "--demo_assets",
                  demo_assets, "--adapter_dir", adapter, "--output_dir", out)  # fmt: skip
    assert not out.exists()
    return line


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("run_config.yaml", "model_name_or_path: [demo://lm\n", "is not valid YAML"),
        ("run_config.yaml", "- a\n- b\n", "does not hold settings"),
        ("run_info.json", '{"stage": "sf', "is not JSON"),
        ("adapter_config.json", '{"peft_type": "LO', "is not JSON"),
    ],
)
def test_a_damaged_file_of_the_previous_stage_is_one_line(
    adapter: Path, demo_assets: Path, capsys: pytest.CaptureFixture, name: str, text: str, message: str
) -> None:
    (adapter / name).write_text(text)
    line = _merge(capsys, adapter, demo_assets)
    assert message in line and name in line


@pytest.mark.parametrize("damage", ["no weights", "truncated weights", "crafted .bin"])
def test_an_adapter_whose_weights_cannot_load_is_one_line_before_the_model_loads(
    adapter: Path, demo_assets: Path, capsys: pytest.CaptureFixture, damage: str
) -> None:
    weights, marker = adapter / "adapter_model.safetensors", adapter.parent / "payload-ran"
    if damage == "truncated weights":
        weights.write_bytes(weights.read_bytes()[:100])
    else:
        weights.unlink()
    if damage == "crafted .bin":
        (adapter / "adapter_model.bin").write_bytes(pickle.dumps(Payload(marker)))
    (adapter / "run_info.json").write_text(json.dumps({"stage": "grpo"}))  # as the GSM8K evaluation wants
    out = adapter.parent / "eval"
    args = ["--config", CONFIGS / "demo" / "eval_gsm8k.yaml", "--demo_assets", demo_assets, "--output_dir", out]
    line = _fails(capsys, "eval_gsm8k.py", *args, "--model_name_or_path", "demo://lm", "--adapter", adapter)
    expected = {"no weights": "has no adapter_model.safetensors", "truncated weights": "damaged"}
    assert expected.get(damage, "holds objects other than tensors") in line, line
    assert not marker.exists() and not out.exists()


# --- the pipeline's run directory ----------------------------------------------------------------


def test_a_truncated_timings_file_does_not_break_later_runs(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / ".fitrl-run.json").write_text("{}")
    (run_dir / "logs" / "timings.json").write_text('{"sft": 12.')
    result = bash_pipeline(ROOT, "--run_dir", str(run_dir), DRY_RUN="1")
    assert result.returncode == 0, result.stderr
    assert "timings.json was damaged" in result.stderr


def test_a_run_directory_that_cannot_be_made_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = bash_pipeline(ROOT, "--run_dir", str(blocker / "run"), DRY_RUN="0")
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr
    assert "cannot write in run directory" in errors[0]


# --- the planner -----------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_the_planner_refuses_a_gpu_size_that_is_no_number(
    value: str, demo_assets: Path, capsys: pytest.CaptureFixture
) -> None:
    line = _fails(capsys, "plan.py", "--config", CONFIGS / "demo" / "sft.yaml", "--demo_assets", demo_assets,
                  "--gpu_memory_gb", value)  # fmt: skip
    assert "must be a finite number > 0" in line


def test_the_planner_says_when_shapes_overflow(
    tmp_path: Path, demo_assets: Path, capsys: pytest.CaptureFixture
) -> None:
    model = _model_copy(demo_assets, tmp_path)
    config = json.loads((model / "config.json").read_text())
    config.update(hidden_size=2**40, intermediate_size=2**45, vocab_size=2**40, num_attention_heads=2**10)
    (model / "config.json").write_text(json.dumps(config))
    line = _fails(capsys, "plan.py", "--config", CONFIGS / "demo" / "sft.yaml", "--model_name_or_path", model)
    assert "overflow 64-bit sizes" in line


def test_a_plan_allocates_nothing_in_proportion_to_the_model(demo_assets: Path) -> None:
    """A LoRA rank of ten million is 5 GB of adapter weights on the demo LM: the plan must trace it on
    `meta` like the base, not make it for real. Run under an address-space cap the real weights would
    break; the plan must come out (exit 1: it does not fit)."""
    cap = 4 * 2**30  # torch's own mappings take about 1.5 GB of it

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    cmd = [sys.executable, str(ROOT / "scripts" / "plan.py"), "--config", str(CONFIGS / "demo" / "sft.yaml")]
    result = subprocess.run(
        [*cmd, "--demo_assets", str(demo_assets), "--lora_r", "10000000", "--brief"],
        capture_output=True,
        text=True,
        preexec_fn=limit,
        timeout=600,
    )
    assert result.returncode == 1, result.stderr[-2000:]
    assert "does NOT fit" in result.stdout


# --- a full disk ----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("script", "flags"),
    [
        ("ppo.py", ["--model_name_or_path", "demo://lm", "--reward_adapter", "", "--steps", "2"]),
        ("grpo.py", ["--max_steps", "2", "--guard_heldout_every", "0"]),
    ],
)
def test_a_checkpoint_that_cannot_be_written_is_one_line_and_leaves_nothing_half_written(
    tmp_path: Path, demo_assets: Path, script: str, flags: list[str]
) -> None:
    """A file-size limit (as a full disk would) hit while the first checkpoint is written: one line naming
    the cause and what is kept, exit 1, no half-written checkpoint for `latest` to find."""
    out = tmp_path / "out"
    config = CONFIGS / "demo" / script.replace(".py", ".yaml")
    cmd = [sys.executable, str(ROOT / "scripts" / script), "--config", str(config), "--demo_assets", str(demo_assets),
           "--output_dir", str(out), "--save_steps", "1", *flags]  # fmt: skip

    def limited() -> None:  # more than the logs, less than an adapter
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))

    result = subprocess.run(cmd, preexec_fn=limited, capture_output=True, text=True, timeout=600)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 1 and len(errors) == 1, result.stderr[-3000:]
    assert errors[0].startswith("error: saving a checkpoint failed (") and "File too large" in errors[0]
    assert errors[0].endswith("at step 1; no checkpoint was saved; free space, then run it again")
    assert "Traceback" not in result.stderr and not out.exists()
    assert not list((tmp_path / "out.checkpoints").glob("*-1*"))  # (trl leaves its model card there)
