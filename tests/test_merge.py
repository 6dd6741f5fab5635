"""Stage 2: the streaming merge equals peft's merge_and_unload, stays lean, and refuses bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fitrl.config import UsageError

from conftest import error_line, load_run_info, run_main, run_script


def _tiny(arch: str, tmp: Path, big: bool = False) -> Path:
    """A tiny model of `arch` saved in several safetensors shards."""
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        GPTNeoXConfig,
        GPTNeoXForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
    )

    torch.manual_seed(0)
    h, layers, vocab = (384, 8, 8000) if big else (32, 2, 128)
    if arch == "gpt_neox":
        model = GPTNeoXForCausalLM(
            GPTNeoXConfig(
                vocab_size=vocab,
                hidden_size=h,
                num_hidden_layers=layers,
                num_attention_heads=4,
                intermediate_size=4 * h,
            )
        )
    elif arch == "llama":
        model = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=vocab,
                hidden_size=h,
                num_hidden_layers=layers,
                num_attention_heads=4,
                intermediate_size=2 * h,
            )
        )
    else:
        model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_embd=h, n_layer=layers, n_head=4))
    path = tmp / f"base-{arch}"
    model.save_pretrained(path, max_shard_size="10MB" if big else "20KB")
    return path


def _adapter(base: Path, tmp: Path, targets: list[str], **lora_kwargs) -> Path:
    """A LoRA adapter with random (non-zero) A and B, as if trained."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(base)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, **lora_kwargs)
    path = tmp / "adapter"
    get_peft_model(model, config).save_pretrained(path)
    return path


def _run(tmp: Path, base: Path, adapter: Path, name: str, *extra: str) -> Path:
    out = tmp / name
    code = run_main(
        "merge.py",
        "--adapter_dir",
        adapter,
        "--base_model",
        base,
        "--output_dir",
        out,
        "--dtype",
        "float32",
        *extra,
    )
    assert code == 0
    return out


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


@pytest.mark.parametrize(
    ("arch", "targets", "lora_kwargs"),
    [
        ("gpt_neox", ["query_key_value", "dense_4h_to_h"], {}),
        ("llama", ["q_proj", "v_proj", "down_proj"], {"use_rslora": True}),
        ("gpt2", ["c_attn"], {"fan_in_fan_out": True}),
    ],
)
def test_streaming_merge_equals_peft_merge_and_logits_match(tmp_path, arch, targets, lora_kwargs) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = _tiny(arch, tmp_path)
    assert len(list(base.glob("*.safetensors"))) > 2, "the base must be sharded for this test to mean anything"
    adapter = _adapter(base, tmp_path, targets, **lora_kwargs)
    streamed = _run(tmp_path, base, adapter, "streamed", "--verify", "true")
    reference = _run(tmp_path, base, adapter, "reference", "--method", "in_memory")

    got, want = _weights(streamed), _weights(reference)
    assert set(got) == set(want)
    changed = [k for k in got if not torch.equal(got[k], _weights(base)[k])]
    assert changed, "the merge changed nothing"
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)

    x = torch.randint(0, 128, (2, 10))
    with torch.no_grad():
        tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()
        merged = AutoModelForCausalLM.from_pretrained(streamed).eval()
        torch.testing.assert_close(merged(input_ids=x).logits, tuned(input_ids=x).logits, rtol=1e-4, atol=1e-4)
    info = load_run_info(streamed)
    assert info["verify_max_logit_diff"] <= 1e-3
    assert (streamed / "model.safetensors.index.json").is_file() and (streamed / "README.md").is_file()


def test_fp16_output_is_fp16_and_close(tmp_path: Path) -> None:
    base = _tiny("gpt_neox", tmp_path)
    adapter = _adapter(base, tmp_path, ["query_key_value"])
    out = _run(tmp_path, base, adapter, "half", "--dtype", "float16", "--verify", "true")
    assert all(t.dtype == torch.float16 for t in _weights(out).values())
    assert json.loads((out / "config.json").read_text())["dtype"] == "float16"


@pytest.mark.slow
def test_streaming_peak_memory_is_well_below_in_memory(tmp_path: Path) -> None:
    """On a ~100 MB model in 10 MB shards, streaming needs a fraction of the RAM the in-memory merge needs."""
    base = _tiny("gpt_neox", tmp_path, big=True)
    assert len(list(base.glob("*.safetensors"))) >= 8
    adapter = _adapter(base, tmp_path, ["query_key_value", "dense"])
    peaks = {}
    for method in ["streaming", "in_memory"]:
        out = tmp_path / method
        result = run_script(
            "merge.py",
            "--adapter_dir",
            adapter,
            "--base_model",
            base,
            "--output_dir",
            out,
            "--dtype",
            "float32",
            "--method",
            method,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        peaks[method] = load_run_info(out)["peak_rss_increase_mb"]
    assert peaks["streaming"] < 0.35 * peaks["in_memory"], peaks


def _bad(tmp_path: Path, adapter: Path, base: Path, *extra: str):
    out = tmp_path / "out"
    result = run_script("merge.py", "--adapter_dir", adapter, "--base_model", base, "--output_dir", out, *extra)
    assert result.returncode == 2, result.stderr[-2000:]
    assert not out.exists() and not (tmp_path / ".out.partial").exists()
    return error_line(result)


def test_bad_inputs_exit_2_and_leave_nothing(tmp_path: Path) -> None:
    base = _tiny("gpt_neox", tmp_path)
    adapter = _adapter(base, tmp_path, ["query_key_value"])

    assert "does not exist" in _bad(tmp_path, tmp_path / "no-adapter", base)
    assert "invalid choice" in _bad(tmp_path, adapter, base, "--dtype", "float8")

    other = _tiny("llama", tmp_path)
    assert "trained on" in _bad(tmp_path, adapter, other)  # names another base, no --force
    assert "which base model has not" in _bad(tmp_path, adapter, other, "--force", "true")

    wide = tmp_path / "wide"
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    GPTNeoXForCausalLM(
        GPTNeoXConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    ).save_pretrained(wide)
    assert "does not fit base weight" in _bad(tmp_path, adapter, wide, "--force", "true")

    shard = sorted(base.glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:100])
    assert "cannot read base shard" in _bad(tmp_path, adapter, base)


def test_corrupt_adapter_and_quantized_base(tmp_path: Path) -> None:
    base = _tiny("gpt_neox", tmp_path)
    adapter = _adapter(base, tmp_path, ["query_key_value"])
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(b"\x00garbage" * 10)
    assert "corrupt" in _bad(tmp_path, adapter, base)

    (tmp_path / "fresh").mkdir()
    adapter = _adapter(base, tmp_path / "fresh", ["query_key_value"])
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = {"load_in_8bit": True}
    (base / "config.json").write_text(json.dumps(config))
    assert "saved quantized" in _bad(tmp_path, adapter, base)


def test_existing_output_needs_overwrite(tmp_path: Path) -> None:
    base = _tiny("gpt_neox", tmp_path)
    adapter = _adapter(base, tmp_path, ["query_key_value"])
    out = _run(tmp_path, base, adapter, "once")
    args = ["--adapter_dir", adapter, "--base_model", base, "--output_dir", out, "--dtype", "float32"]
    assert run_main("merge.py", *args) == 2
    _run(tmp_path, base, adapter, "once", "--overwrite_output_dir", "true")
    assert (out / "config.json").is_file()


def test_lora_delta_matches_hand_computed_values() -> None:
    """scaling * B @ A, with the scalings peft uses (alpha / r, rsLoRA's alpha / sqrt(r), rank patterns)."""
    from fitrl.merge import delta, lora_changes, merge_tensor

    a, b = torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0], [4.0]])  # A: (r=1, in=2), B: (out=2, r=1)
    weights = {"base_model.model.blk.q.lora_A.weight": a, "base_model.model.blk.q.lora_B.weight": b}
    product = [[3.0, 6.0], [4.0, 8.0]]  # B @ A

    def change(**config: object) -> dict:
        return lora_changes({"r": 1, "lora_alpha": 2, **config}, weights)["blk.q.weight"]

    assert delta(change()).tolist() == [[2 * x for x in row] for row in product]  # alpha / r = 2
    assert delta(change(r=4, use_rslora=True)).tolist() == product  # 2 / sqrt(4) = 1
    assert delta(change(r=8, rank_pattern={"q": 2})).tolist() == product  # the pattern's r wins: 2 / 2
    assert delta(change(fan_in_fan_out=True)).tolist() == [[6.0, 8.0], [12.0, 16.0]]  # Conv1D: (in, out)
    merged = merge_tensor("blk.q.weight", torch.ones(2, 2), change(), torch.float16)
    assert merged.dtype == torch.float16 and merged.tolist() == [[7.0, 13.0], [9.0, 17.0]]
    with pytest.raises(UsageError, match="does not fit base weight"):
        merge_tensor("blk.q.weight", torch.ones(3, 2), change(), torch.float16)
