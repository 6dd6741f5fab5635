"""Model loading: quantized paths on CPU, LoRA defaults per architecture, pad tokens, bad paths."""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fitrl.config import UsageError
from fitrl.int8 import DequantScratch, FrozenInt8Product
from fitrl.modeling import (
    LoraArguments,
    ModelArguments,
    add_lora,
    load_causal_lm,
    load_tokenizer,
    lora_config,
    resolve_model_path,
)


def _args(demo_assets: Path, quantization: str = "8bit") -> ModelArguments:
    return ModelArguments(model_name_or_path="demo://lm", quantization=quantization, dtype="float32")


def test_8bit_base_loads_and_lora_trains_on_cpu(demo_assets: Path) -> None:
    """The real recipe's code path: int8 frozen base, LoRA + 8-bit AdamW, one update on a CPU."""
    import bitsandbytes as bnb

    model = load_causal_lm(_args(demo_assets), demo_assets=str(demo_assets), gradient_checkpointing=True)
    int8_layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear8bitLt)]
    assert int8_layers and int8_layers[0].weight.dtype == torch.int8
    model = add_lora(model, LoraArguments(lora_r=4, lora_alpha=8, lora_dropout=0.0))
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    lora_before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert lora_before and all("lora_" in n for n in lora_before)

    opt = bnb.optim.AdamW8bit([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x = torch.randint(0, model.config.vocab_size, (2, 16))
    model.train()
    model(input_ids=x, labels=x).loss.backward()
    opt.step()

    after = dict(model.named_parameters())
    assert any(not torch.equal(after[n], lora_before[n]) for n in lora_before), "LoRA weights did not move"
    assert all(torch.equal(after[n], base_before[n]) for n in base_before), "a frozen base weight moved"
    assert all(torch.equal(m.weight, m.weight) and m.weight.dtype == torch.int8 for m in int8_layers)


def test_4bit_base_loads_and_runs_on_cpu(demo_assets: Path) -> None:
    model = load_causal_lm(_args(demo_assets, "4bit"), demo_assets=str(demo_assets), for_training=False)
    assert getattr(model, "is_loaded_in_4bit", False)
    out = model(input_ids=torch.randint(0, model.config.vocab_size, (1, 8)))
    assert torch.isfinite(out.logits).all()


def test_default_lora_targets_per_architecture() -> None:
    args = LoraArguments()
    assert lora_config(args, "gpt_neox").target_modules == {"query_key_value"}
    assert lora_config(args, "llama").target_modules == {"q_proj", "v_proj"}
    assert lora_config(args, "some_new_arch").target_modules == "all-linear"
    assert lora_config(LoraArguments(lora_target_modules=["all-linear"]), "llama").target_modules == "all-linear"
    assert lora_config(LoraArguments(lora_target_modules=["o_proj"]), "llama").target_modules == {"o_proj"}


def test_llama_style_model_gets_q_v_lora(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    model = load_causal_lm(ModelArguments(model_name_or_path=str(tmp_path), dtype="float32"))
    peft_model = add_lora(model, LoraArguments(lora_r=2))
    adapted = {n.split(".")[-4] for n, _ in peft_model.named_parameters() if "lora_A" in n}
    assert adapted == {"q_proj", "v_proj"}


def test_lora_target_that_matches_nothing_is_a_usage_error(demo_assets: Path) -> None:
    model = load_causal_lm(_args(demo_assets, "none"), demo_assets=str(demo_assets))
    with pytest.raises(UsageError, match="cannot put LoRA"):
        add_lora(model, LoraArguments(lora_target_modules=["no_such_module"]))


def test_pad_token_falls_back_to_eos(demo_assets: Path) -> None:
    tok = load_tokenizer(str(demo_assets / "lm"))
    assert tok.pad_token == tok.eos_token == "<|endoftext|>"


def test_model_paths_are_checked(tmp_path: Path, demo_assets: Path) -> None:
    assert resolve_model_path("EleutherAI/gpt-neox-20b", str(demo_assets)) == "EleutherAI/gpt-neox-20b"
    with pytest.raises(UsageError, match="does not exist"):
        resolve_model_path("./no/such/model", str(demo_assets))
    with pytest.raises(UsageError, match="has no config.json"):
        resolve_model_path(str(tmp_path), str(demo_assets))


def test_a_mistyped_local_path_is_named_as_such_not_sent_to_the_hub(
    tmp_path: Path, demo_assets: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`outputs/mergd` and `my-qwn` look like hub ids to transformers, which would retry the network (45 s
    online) and report a connection failure: here they are folders that do not exist."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs" / "merged").mkdir(parents=True)
    with pytest.raises(UsageError, match=r"^model path outputs/mergd does not exist \(outputs/ holds: merged\)"):
        resolve_model_path("outputs/mergd", str(demo_assets))
    with pytest.raises(UsageError, match="model my-qwn is no folder here, and a hub id has the form organisation/name"):
        resolve_model_path("my-qwn", str(demo_assets))
    assert resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct", str(demo_assets)) == "Qwen/Qwen2.5-0.5B-Instruct"


def test_uncached_hub_model_offline_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="cannot load model"):
        load_causal_lm(ModelArguments(model_name_or_path="nobody/not-a-model"), demo_assets=str(tmp_path))


def test_lora_on_a_full_precision_model_leaves_bitsandbytes_unloaded_and_an_8bit_model_after_it_works(
    demo_assets: Path,
) -> None:
    """peft would import bitsandbytes (2 s, 44 MB) for any model; fitrl keeps it out until a model needs it,
    and the same process can then still put LoRA on an 8-bit model. A fresh interpreter: pytest's has it."""
    code = f"""
import sys
from fitrl.modeling import LoraArguments, ModelArguments, add_lora, load_causal_lm
from fitrl import memtrace, planner
lora = LoraArguments(lora_r=4, lora_alpha=8)
def model(quantization):
    args = ModelArguments(model_name_or_path="demo://lm", quantization=quantization, dtype="float32")
    return load_causal_lm(args, demo_assets={str(demo_assets)!r}, for_training=True)
add_lora(model("none"), lora)
assert "bitsandbytes" not in sys.modules, "bitsandbytes was imported for an fp32 model"
import bitsandbytes as bnb
from peft.tuners.lora.bnb import Linear8bitLt
wrapped = add_lora(model("8bit"), lora)
layers = [m for m in wrapped.modules() if isinstance(m, Linear8bitLt)]
assert layers and isinstance(layers[0].get_base_layer(), bnb.nn.Linear8bitLt), "no bitsandbytes LoRA layer"
print("ok")
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_quantized_load_on_cpu_releases_the_checkpoint_file(demo_assets: Path, tmp_path: Path) -> None:
    """Unquantized tensors left as views of the memory-mapped checkpoint would keep the whole file
    resident (72 MB of RSS for a 20M-parameter model); the load copies them and the map goes."""
    import psutil

    shutil.copytree(demo_assets / "lm", tmp_path / "lm")
    checkpoint = str(tmp_path / "lm" / "model.safetensors")

    def mapped() -> bool:
        return any(m.path == checkpoint for m in psutil.Process().memory_maps())

    fp32 = load_causal_lm(ModelArguments(model_name_or_path=str(tmp_path / "lm"), dtype="float32"), for_training=False)
    assert mapped(), "the full-precision load should use the map without a copy (else this test checks nothing)"
    del fp32
    gc.collect()
    args = ModelArguments(model_name_or_path=str(tmp_path / "lm"), quantization="8bit", dtype="float32")
    model = load_causal_lm(args, for_training=True)
    assert not mapped()
    x = torch.randint(0, model.config.vocab_size, (1, 8))
    assert torch.isfinite(model(input_ids=x).logits).all()


def test_8bit_layers_on_cpu_give_the_same_logits_in_eval_as_in_training(demo_assets: Path) -> None:
    """bitsandbytes on a CPU would quantize the inputs in eval and not in training: PPO's old and
    reference log-probs (eval) would then differ from the update's (training) before any step."""
    model = load_causal_lm(_args(demo_assets), demo_assets=str(demo_assets), for_training=True)
    x = torch.randint(0, model.config.vocab_size, (4, 16))
    with torch.no_grad():
        in_eval = model.eval()(input_ids=x).logits
        in_training = model.train()(input_ids=x).logits  # the demo LM has no dropout
    assert torch.equal(in_eval, in_training)


def test_4bit_layers_on_cpu_give_the_same_logits_in_eval_as_in_training_and_train_after_it(demo_assets: Path) -> None:
    """On a CPU with AVX512-BF16, bitsandbytes would repack the 4-bit weights for another kernel at the
    first no-grad eval pass (PPO's sampling, its reference): other log-probs than the update's, and a
    training step after it failed. fitrl keeps every CPU on the one product; elsewhere this holds anyway."""
    model = load_causal_lm(_args(demo_assets, "4bit"), demo_assets=str(demo_assets), for_training=True)
    model = add_lora(model, LoraArguments(lora_r=4, lora_alpha=8, lora_dropout=0.0))
    x = torch.randint(0, model.config.vocab_size, (4, 16))
    with torch.no_grad():
        in_eval = model.eval()(input_ids=x).logits
    model.train()  # the demo LM has no dropout
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    assert torch.isfinite(loss)
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, in_eval)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)


def test_frozen_int8_product_is_bitsandbytes_training_product_keeping_only_the_int8_weight() -> None:
    import bitsandbytes as bnb

    torch.manual_seed(0)
    layers = []
    for n_in, n_out in [(64, 96), (96, 32)]:  # the second, smaller weight reuses the first one's scratch
        layer = bnb.nn.Linear8bitLt(n_in, n_out, has_fp16_weights=False)
        layer.load_state_dict(torch.nn.Linear(n_in, n_out).state_dict())
        layers.append(layer.to("cpu").train().requires_grad_(False))
    x = torch.randn(3, 5, 64, requires_grad=True)
    theirs = layers[1](layers[0](x))  # bitsandbytes' training product (it moves the int8 weight to its state)
    (grad_theirs,) = torch.autograd.grad(theirs.square().sum(), x)
    scratch = DequantScratch()

    def ours(x: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            x = FrozenInt8Product.apply(x, layer.state.CB, layer.state.SCB, layer.bias, scratch)
        return x

    (grad_ours,) = torch.autograd.grad(ours(x).square().sum(), x)
    assert torch.equal(ours(x), theirs) and torch.equal(grad_ours, grad_theirs)
    assert [b.numel() for b in scratch.buffers.values()] == [96 * 64], "one buffer, the largest weight's size"
    saved = ours(x).grad_fn.saved_tensors
    assert [t.dtype for t in saved] == [torch.int8, torch.float32] and saved[1].shape == (32,), "it keeps x"
