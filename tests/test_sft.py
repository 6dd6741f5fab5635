"""Stage 1 as a user runs it: the demo SFT learns, writes a loadable adapter, and fails cleanly on bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fitrl.config import load_run_config
from fitrl.distributed import tensor_digest
from fitrl.outputs import read_jsonl

from conftest import (
    CONFIGS,
    accelerate_launch,
    assert_memory_planned_and_measured,
    error_line,
    load_run_info,
    run_script,
)

SFT_YAML = CONFIGS / "demo" / "sft.yaml"


def _sft(out: Path, demo_assets: Path, *extra: str, launcher: list[str] | None = None):
    return run_script(
        "sft.py",
        "--config",
        SFT_YAML,
        "--demo_assets",
        demo_assets,
        "--output_dir",
        out,
        *extra,
        launcher=launcher,
    )


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory: pytest.TempPathFactory, demo_assets: Path) -> Path:
    """A short demo SFT (the whole one runs in the demo pipeline, where test_demo_learns checks its loss)."""
    out = tmp_path_factory.mktemp("sft") / "run"
    result = _sft(out, demo_assets, "--max_steps", "20", "--logging_steps", "5")
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.slow
def test_demo_sft_writes_every_output(sft_run: Path, demo_assets: Path) -> None:
    for name in [
        "adapter_config.json",
        "adapter_model.safetensors",
        "tokenizer.json",
        "run_config.yaml",
        "run_info.json",
        "metrics.jsonl",
        "loss.png",
    ]:
        assert (sft_run / name).is_file(), name
    assert load_run_config(sft_run)["model_name_or_path"] == "demo://lm"
    assert load_run_info(sft_run)["world_size"] == 1
    assert_memory_planned_and_measured(load_run_info(sft_run))
    assert not (sft_run.parent / f".{sft_run.name}.partial").exists()


@pytest.mark.slow
def test_demo_sft_changed_lora_weights_and_adapter_loads(sft_run: Path, demo_assets: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    weights = load_file(sft_run / "adapter_model.safetensors")
    lora_b = [t for k, t in weights.items() if "lora_B" in k]
    # peft initialises lora_B to zero: any non-zero entry was learned.
    assert lora_b and all(t.abs().max() > 0 for t in lora_b)

    base = AutoModelForCausalLM.from_pretrained(demo_assets / "lm").eval()
    x = torch.randint(0, base.config.vocab_size, (1, 12))
    with torch.no_grad():
        base_logits = base(input_ids=x).logits
        tuned = PeftModel.from_pretrained(base, sft_run).eval()
        tuned_logits = tuned(input_ids=x).logits
    assert not torch.allclose(base_logits, tuned_logits, atol=1e-4)
    assert json.loads((sft_run / "adapter_config.json").read_text())["r"] == load_run_config(sft_run)["lora_r"]


@pytest.mark.slow
def test_two_process_ddp_ends_with_identical_adapters(tmp_path: Path, demo_assets: Path) -> None:
    out = tmp_path / "ddp"
    result = _sft(
        out, demo_assets, "--max_steps", "6", "--logging_steps", "2", launcher=accelerate_launch(2, "ddp_cpu_2proc")
    )
    assert result.returncode == 0, result.stderr[-3000:]
    info = load_run_info(out)
    assert info["world_size"] == 2
    digests = info["rank_weight_digests"]
    assert len(digests) == 2 and digests[0] == digests[1]
    # The digest is of the real weights: it matches the adapter file rank 0 wrote.
    assert tensor_digest(load_file(out / "adapter_model.safetensors")) == digests[0]


def _assert_clean_failure(result, out: Path, message: str) -> None:
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in error_line(result)
    assert not out.exists() or not any(out.iterdir())
    assert not (out.parent / f".{out.name}.partial").exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--model_name_or_path", "./no/such/model"], "model path ./no/such/model does not exist"),
        (["--text_column", "body"], "has no column 'body'"),
    ],
)
def test_bad_input_exits_2_and_writes_nothing(tmp_path: Path, demo_assets: Path, extra: list[str], message: str):
    out = tmp_path / "out"
    _assert_clean_failure(_sft(out, demo_assets, *extra), out, message)


def test_empty_dataset_exits_2(tmp_path: Path, demo_assets: Path) -> None:
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    out = tmp_path / "out"
    result = _sft(out, demo_assets, "--dataset", data)
    assert result.returncode == 2 and "dataset" in error_line(result)
    assert not out.exists()


def test_unwritable_output_dir_exits_2(tmp_path: Path, demo_assets: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    out = blocker / "out"
    result = _sft(out, demo_assets)
    assert result.returncode == 2
    assert f"is inside {blocker}, which is a file; choose another path" in error_line(result)


def test_non_empty_output_dir_is_refused_without_overwrite(tmp_path: Path, demo_assets: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    result = _sft(out, demo_assets, "--overwrite_output_dir", "false")
    assert result.returncode == 2 and "not empty" in error_line(result)
    assert (out / "keep.txt").read_text() == "precious"


@pytest.mark.slow
def test_a_direct_run_accelerate_launch_and_the_fitrl_command_write_the_same_adapter(
    tmp_path: Path, demo_assets: Path
) -> None:
    """One thread rule for every way a stage is launched: a direct run without OMP_NUM_THREADS takes the
    machine's cores, and so does the `fitrl` command (installed by the project's install), which
    launches through accelerate with OMP_NUM_THREADS set to them (`fitrl.launch.launch_env`); a bare
    `accelerate launch` takes OMP_NUM_THREADS as given (unset, accelerate would give one thread). The
    runs also hash strings differently (PYTHONHASHSEED), which peft's set of LoRA targets follows."""
    import os
    import subprocess
    import sys

    from fitrl.process import cpu_cores

    args = ["--config", SFT_YAML, "--demo_assets", demo_assets, "--max_steps", "3", "--report_to", "none"]
    script = str(CONFIGS.parent / "scripts" / "sft.py")
    runs = {
        "direct": ([sys.executable, script], {}),
        "accelerate": ([*accelerate_launch(1), script], {"OMP_NUM_THREADS": str(cpu_cores())}),
        "fitrl": ([str(Path(sys.executable).parent / "fitrl"), "sft"], {}),
    }
    for i, (name, (launcher, threads)) in enumerate(runs.items()):
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        cmd = [*launcher, *map(str, args), "--output_dir", str(tmp_path / name)]
        env |= {"PYTHONHASHSEED": str(i), **threads}
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
    for name in ["adapter_model.safetensors", "adapter_config.json"]:
        for run in ["accelerate", "fitrl"]:
            assert (tmp_path / "direct" / name).read_bytes() == (tmp_path / run / name).read_bytes(), (run, name)


@pytest.mark.slow
def test_the_same_seed_gives_the_same_adapter_whatever_ran_before(tmp_path: Path, demo_assets: Path) -> None:
    """The seed covers the LoRA init: two runs after different random draws write identical adapters."""
    from conftest import run_main

    digests = []
    for junk_seed in [0, 1]:
        torch.manual_seed(junk_seed)  # whatever a launcher or an import drew before the stage starts
        torch.rand(7)
        out = tmp_path / f"run{junk_seed}"
        args = ["--config", SFT_YAML, "--demo_assets", demo_assets, "--output_dir", out, "--max_steps", "2"]
        assert run_main("sft.py", *args, "--report_to", "none") == 0
        digests.append((out / "adapter_model.safetensors").read_bytes())
    assert digests[0] == digests[1]


def test_an_output_inside_the_demo_models_folder_is_refused(demo_assets: Path) -> None:
    out = demo_assets / "lm" / "sft"
    result = _sft(out, demo_assets)
    assert result.returncode == 2 and "overlaps the stage's input" in error_line(result)
    assert not out.exists()


@pytest.mark.slow
def test_a_non_finite_loss_stops_the_run_and_writes_no_adapter(tmp_path: Path, demo_assets: Path) -> None:
    """A learning rate of 1e6 blows the weights up in two steps. transformers would log the NaN loss as
    the mean of the earlier ones and train on; fitrl stops with one line naming the last good
    checkpoint, writes no output, and the kept checkpoint holds finite weights."""
    out = tmp_path / "out"
    result = _sft(out, demo_assets, "--learning_rate", "1e6", "--max_steps", "6", "--save_steps", "1")
    assert result.returncode == 1, result.stderr[-3000:]
    line = error_line(result)
    assert "non-finite" in line and "checkpoint-1, is kept" in line and "lower learning_rate" in line
    assert not out.exists() and not (tmp_path / ".out.partial").exists()
    kept = tmp_path / "out.checkpoints" / "checkpoint-1"
    assert (kept / "run_config.yaml").is_file()  # complete
    assert all(torch.isfinite(t).all() for t in load_file(kept / "adapter_model.safetensors").values())


@pytest.mark.slow
def test_sft_resumes_from_its_latest_checkpoint(tmp_path: Path, demo_assets: Path) -> None:
    """SFT checkpoints live beside the output (a crash keeps them) and `latest` resumes the newest: the
    resumed run reports the whole history and writes the adapter an uninterrupted run writes."""
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert _sft(whole, demo_assets, "--max_steps", "4", "--logging_steps", "1").returncode == 0
    first = _sft(part, demo_assets, "--max_steps", "4", "--logging_steps", "1", "--save_steps", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    import shutil

    shutil.rmtree(part)  # as if the run had died after its checkpoint at step 4...
    shutil.rmtree(part.with_name("part.checkpoints") / "checkpoint-4")  # ...no, at step 2
    resumed = _sft(part, demo_assets, "--max_steps", "4", "--logging_steps", "1", "--resume_from_checkpoint", "latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in read_jsonl(part / "metrics.jsonl") if "loss" in r] == [1, 2, 3, 4]
    assert load_run_info(part)["resumed_from"].endswith("checkpoint-2")
    a = load_file(whole / "adapter_model.safetensors")
    b = load_file(part / "adapter_model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)  # the same precision too: trl's bf16 adapter stays bf16
