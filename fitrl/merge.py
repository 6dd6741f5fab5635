"""The merge maths of stage 2: fold a LoRA adapter into full-precision base weights, shard by shard.

`streaming_merge` reads the base's safetensors shards one at a time, adds `scaling * B @ A` to each
adapted weight in fp32, writes the merged shard and frees it: peak memory is about one shard plus
the adapter's low-rank factors. It handles what peft's `merge_and_unload` does for LoRA: rsLoRA
scaling, rank/alpha patterns, fan-in-fan-out (GPT-2 Conv1D) weights, LoRA biases and modules_to_save.
`in_memory_merge` is peft's own merge, the reference the tests compare against. `fitrl.scripts.merge`
is the CLI around them.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from fitrl.config import RunFailed, UsageError, first_line

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# Largest logit difference --verify accepts, by output dtype: rounding the merged weights to 16 bits
# moves logits by ~1e-2 on real models; more than this means the merge is wrong.
VERIFY_TOLERANCE = {"float32": 1e-3, "float16": 5e-2, "bfloat16": 2.5e-1}
VERIFY_PROMPTS = ["This movie was", "I went to see it because", "The acting", "Mia has 5 apples."]
TOKENIZER_FILES = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "vocab.txt",
    "chat_template.jinja",
]


# --- reading the inputs ---------------------------------------------------------------------------


def read_adapter(adapter_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The adapter's config and weights; any missing or unreadable file is a usage error."""
    from safetensors.torch import load_file

    from fitrl.checkpoints import read_adapter_config

    weights_path = adapter_dir / "adapter_model.safetensors"
    config = read_adapter_config(adapter_dir, "SFT")
    if config.get("peft_type") != "LORA":
        raise UsageError(f"{adapter_dir} holds a {config.get('peft_type')} adapter; only LoRA adapters merge")
    if config.get("use_dora"):
        raise UsageError("DoRA adapters are not supported by the streaming merge; use --method in_memory")
    if not weights_path.is_file():
        raise UsageError(f"no adapter_model.safetensors in {adapter_dir}")
    try:
        weights = load_file(weights_path)
    except Exception as e:  # safetensors raises its own error type for truncated/corrupt files
        raise UsageError(f"cannot read {weights_path} ({first_line(e)}); the file is corrupt") from None
    return config, weights


def base_checkpoint(base: str) -> Path:
    """The local directory holding the base's full-precision safetensors (downloaded/cached for hub ids)."""
    path = Path(base)
    if not path.is_dir():
        from huggingface_hub import snapshot_download

        try:
            path = Path(snapshot_download(base, allow_patterns=["*.json", "*.safetensors", *TOKENIZER_FILES]))
        except Exception as e:
            raise UsageError(f"cannot fetch base model {base} ({first_line(e)})") from None
    config = json.loads((path / "config.json").read_text())
    if config.get("quantization_config"):
        raise UsageError(
            f"base model {base} is saved quantized; the merge needs its full-precision checkpoint (fp16/bf16/fp32)"
        )
    if not list(path.glob("*.safetensors")):
        raise UsageError(f"base model {base} has no .safetensors files; convert it to safetensors first")
    return path


def shard_files(base_dir: Path) -> tuple[list[str], dict[str, Any] | None]:
    index_path = base_dir / "model.safetensors.index.json"
    if index_path.is_file():
        index = json.loads(index_path.read_text())
        return sorted(set(index["weight_map"].values())), index
    return ["model.safetensors"], None


# --- the merge maths ------------------------------------------------------------------------------


def _pattern_value(module: str, patterns: dict[str, Any], default: Any) -> Any:
    """peft's rank_pattern / alpha_pattern: the value of the first key that matches the module's name."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def lora_changes(config: dict[str, Any], weights: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """Per base tensor name, how the adapter changes it: low-rank factors to add, or a tensor to replace.

    Only the factors are kept (r x in, out x r): each full-size delta is formed when its shard is merged,
    so memory never holds more than one of them.
    """
    prefix = "base_model.model."
    modules: dict[str, dict[str, torch.Tensor]] = {}
    changes: dict[str, dict[str, Any]] = {}
    for key, tensor in weights.items():
        name = key.removeprefix(prefix)
        m = re.fullmatch(r"(.+)\.(lora_A|lora_B)\.(weight|bias)", name)
        if m:
            modules.setdefault(m.group(1), {})[f"{m.group(2)}.{m.group(3)}"] = tensor.float()
        else:  # trained biases (bias='all'/'lora_only') or modules_to_save: they replace the base tensor
            changes[name] = {"replace": tensor}
    for module, parts in modules.items():
        if "lora_A.weight" not in parts or "lora_B.weight" not in parts:
            raise UsageError(f"adapter is missing lora_A or lora_B for {module}; the adapter file is incomplete")
        r = _pattern_value(module, config.get("rank_pattern"), config["r"])
        alpha = _pattern_value(module, config.get("alpha_pattern"), config["lora_alpha"])
        scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        changes[f"{module}.weight"] = {
            "A": parts["lora_A.weight"],
            "B": parts["lora_B.weight"],
            "scaling": scaling,
            "transpose": bool(config.get("fan_in_fan_out")),
        }
        if "lora_B.bias" in parts:  # peft's lora_bias: B's bias, scaled, adds to the base bias
            changes[f"{module}.bias"] = {"bias": parts["lora_B.bias"] * scaling}
    return changes


def delta(change: dict[str, Any]) -> torch.Tensor:
    """What to add to the base tensor, in fp32: scaling * B @ A (transposed for Conv1D-style weights)."""
    if "bias" in change:
        return change["bias"]
    d = change["B"] @ change["A"] * change["scaling"]
    return d.T if change["transpose"] else d  # GPT-2's Conv1D stores weights as (in, out)


def merge_tensor(name: str, tensor: torch.Tensor, change: dict[str, Any] | None, dtype: torch.dtype) -> torch.Tensor:
    if change is None:
        return tensor.to(dtype) if tensor.is_floating_point() else tensor
    if "replace" in change:
        return change["replace"].to(dtype)
    d = delta(change)
    if d.shape != tensor.shape:
        raise UsageError(
            f"adapter shape {tuple(d.shape)} does not fit base weight {name} {tuple(tensor.shape)}; "
            "was the adapter trained on another model?"
        )
    return (tensor.float() + d).to(dtype)


# --- the two merge methods ------------------------------------------------------------------------


def streaming_merge(
    base_dir: Path, config: dict[str, Any], weights: dict[str, torch.Tensor], out: Path, dtype: torch.dtype
) -> int:
    """Merge shard by shard; returns how many base tensors the adapter changed."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    changes = lora_changes(config, weights)
    files, index = shard_files(base_dir)
    weight_map: dict[str, str] = {}
    total_bytes, applied = 0, set()
    for fname in tqdm(files, desc="merging shards", unit="shard"):
        merged: dict[str, torch.Tensor] = {}
        try:
            with safe_open(str(base_dir / fname), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    merged[name] = merge_tensor(name, f.get_tensor(name), changes.get(name), dtype)
        except UsageError:
            raise
        except Exception as e:  # a missing or truncated shard, a bad header (safetensors' own error types)
            raise UsageError(f"cannot read base shard {base_dir / fname} ({first_line(e)})") from None
        applied.update(name for name in merged if name in changes)
        save_file(merged, str(out / fname), metadata={"format": "pt"})
        total_bytes += sum(t.numel() * t.element_size() for t in merged.values())
        weight_map.update(dict.fromkeys(merged, fname))
        del merged
    missing = sorted(set(changes) - applied)
    if missing:
        raise UsageError(
            f"adapter targets {missing[0]}, which base model has not; was the adapter trained on another architecture?"
        )
    if index is not None:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return len(applied)


def in_memory_merge(base: str, adapter_dir: Path, out: Path, dtype: torch.dtype) -> int:
    """peft's merge_and_unload on the whole model in fp32 (the reference; needs the model in RAM)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, adapter_dir)
    n_adapted = sum(1 for n, _ in model.named_modules() if n.endswith("lora_A"))
    merged = model.merge_and_unload().to(dtype)
    merged.save_pretrained(out, max_shard_size="200MB")
    return n_adapted


def write_config_files(base_dir: Path, out: Path, dtype_name: str) -> None:
    config = json.loads((base_dir / "config.json").read_text())
    config["dtype"] = dtype_name
    config.pop("torch_dtype", None)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if (base_dir / "generation_config.json").is_file():
        shutil.copy(base_dir / "generation_config.json", out / "generation_config.json")


def verify_merge(base: str, adapter_dir: Path, merged_dir: Path, tokenizer: Any | None, tolerance: float) -> float:
    """Largest |logit difference| between base+adapter and the merged model on a few prompts."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if tokenizer is not None:
        batch = tokenizer(VERIFY_PROMPTS, return_tensors="pt", padding=True)
    else:  # no tokenizer to write prompts with: fixed pseudo-random token ids do as well for logits
        config = json.loads((merged_dir / "config.json").read_text())
        ids = torch.randint(0, config["vocab_size"], (4, 12), generator=torch.Generator().manual_seed(0))
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        reference = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter_dir
        ).eval()
        want = reference(**batch).logits
        del reference
        merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
        got = merged(**batch).logits
    mask = batch["attention_mask"].bool()
    diff = (want - got).abs()[mask].max().item()
    if not diff <= tolerance:
        raise RunFailed(f"merged model's logits differ from base+adapter by {diff:.3g} (> tolerance {tolerance})")
    return diff
