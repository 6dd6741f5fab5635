"""Load a causal LM (hub id or local dir) in full precision, 8-bit or 4-bit, and put LoRA on it.

Every stage loads its model through here, so quantization, dtype, pad token, k-bit preparation and
LoRA defaults behave the same in SFT, PPO and GRPO.
"""

from __future__ import annotations

import functools
import math
import re
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from fitrl import demo
from fitrl.config import UsageError, check, first_line, help_field, offline_note
from fitrl.distributed import process_state
from fitrl.rollout import last_hidden_states, position_ids

# LoRA targets per architecture when the config names none: the attention projections the
# original LoRA paper and the peft examples use for each family.
DEFAULT_LORA_TARGETS: dict[str, list[str]] = {
    "gpt_neox": ["query_key_value"],
    "llama": ["q_proj", "v_proj"],
    "mistral": ["q_proj", "v_proj"],
    "qwen2": ["q_proj", "v_proj"],
    "qwen3": ["q_proj", "v_proj"],
    "gemma": ["q_proj", "v_proj"],
    "gemma2": ["q_proj", "v_proj"],
    "phi3": ["qkv_proj"],
    "gpt2": ["c_attn"],
    "opt": ["q_proj", "v_proj"],
    "gptj": ["q_proj", "v_proj"],
    "falcon": ["query_key_value"],
    "bloom": ["query_key_value"],
}

# The blog's LoRA targets: q, k, o and the MLP's up/down projections (fused names where the family fuses them).
GRPO_LORA_TARGETS = {
    "llama": ["q_proj", "k_proj", "o_proj", "up_proj", "down_proj"],
    "qwen2": ["q_proj", "k_proj", "o_proj", "up_proj", "down_proj"],
    "gpt_neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
}

Quantization = Literal["none", "8bit", "4bit"]
DType = Literal["auto", "float32", "bfloat16", "float16"]


@dataclass
class ModelArguments:
    """Which model to load and how."""

    model_name_or_path: str = help_field(
        "EleutherAI/gpt-neox-20b", "Hub id or local directory of the model; 'demo://lm' is the embedded tiny model."
    )
    quantization: Quantization = help_field(
        "none", "Load the frozen base weights as 'none' (dtype below), '8bit' or '4bit' (bitsandbytes)."
    )
    dtype: DType = help_field(
        "auto", "Dtype of the non-quantized weights; 'auto' is bfloat16 on a GPU that has it, else float32."
    )
    trust_remote_code: bool = help_field(False, "Allow model code from the hub repository to run (off: safer).")


@dataclass
class LoraArguments:
    """The LoRA adapter put on the frozen base."""

    lora_r: int = help_field(16, "LoRA rank r.")
    lora_alpha: float = help_field(32, "LoRA alpha: the update is scaled by alpha / r.")
    lora_dropout: float = help_field(0.05, "Dropout on the LoRA input.")
    lora_target_modules: list[str] | None = help_field(
        None,
        "Module names to adapt; 'all-linear' adapts every linear layer; empty picks a default per architecture "
        "(query_key_value for GPT-NeoX, q_proj/v_proj for Llama/Qwen/Mistral).",
    )

    def validate(self) -> None:
        check(self.lora_r >= 1, "lora_r", "an integer >= 1")
        check(self.lora_alpha > 0, "lora_alpha", "> 0")
        check(0 <= self.lora_dropout < 1, "lora_dropout", "in [0, 1)")


def resolve_model_path(name_or_path: str, demo_cache_dir: str, what: str = "model") -> str:
    """Turn demo:// URIs into paths, check local paths exist, and pass hub ids through."""
    if demo.is_demo_uri(name_or_path):
        return str(demo.resolve(name_or_path, demo_cache_dir))
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise UsageError(f"{what} directory {path} has no config.json; point to a saved model directory")
        return str(path)
    looks_like_path = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
    if looks_like_path or not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name_or_path):
        raise UsageError(f"{what} path {name_or_path} does not exist; give a local directory or a hub id")
    return name_or_path


def torch_dtype(name: str) -> torch.dtype:
    if name == "auto":
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _device_map() -> dict[str, Any]:
    """Each process keeps the whole model on its own device: what DDP and bitsandbytes both expect."""
    state = process_state()
    if state.device.type == "cuda":
        return {"": state.local_process_index}
    return {"": str(state.device)}


def quantization_config(quantization: str, compute_dtype: torch.dtype) -> Any:
    from transformers import BitsAndBytesConfig

    if quantization == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    if quantization == "4bit":
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute_dtype,
        )
    return None


def load_tokenizer(path: str, trust_remote_code: bool = False, padding_side: str = "right") -> Any:
    """Load a tokenizer and give it a pad token (the EOS token) when it has none."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot load a tokenizer from {path}: {first_line(e)}") from None
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise UsageError(f"tokenizer at {path} has neither a pad nor an EOS token; add a pad token to it")
        tok.pad_token = tok.eos_token
    tok.padding_side = padding_side
    return tok


def _release_checkpoint_map(model: nn.Module) -> None:
    """Copy the float tensors a quantized load left on the CPU as views of the checkpoint file.

    transformers memory-maps the checkpoint and keeps the tensors it does not quantize (embeddings,
    norms, head) as views of the map when their dtype matches. One such view keeps the whole file
    mapped, and every page the quantizer read stays resident: 72 MB of RSS for the benchmark's
    20M-parameter model, whose unquantized tensors take 4 MB. Copied, the map is released.
    """
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.device.type == "cpu" and t.is_floating_point():
                t.data = t.data.clone()


def _int8_layers_on_cpu(model: nn.Module) -> None:
    """Run bitsandbytes' frozen 8-bit layers on a CPU through `FrozenInt8Product`.

    bitsandbytes picks an 8-bit layer's CPU product by the layer's training flag: int8-quantized
    inputs in eval, the dequantized weight in training (up to 0.05 apart in a token's log-prob on the
    benchmark's model). PPO divides a probability taken in training (the update) by ones taken in
    eval (sampling, the reference), so the two must agree. Its training product also keeps every
    layer's input for a weight gradient a frozen layer never gets: 19 of the 68 MiB of tensors a PPO
    step holds at the benchmark's shapes. The GPU keeps bitsandbytes' own int8 product.
    """
    import bitsandbytes as bnb

    scratch = DequantScratch()
    for module in model.modules():
        frozen = isinstance(module, bnb.nn.Linear8bitLt) and not module.state.has_fp16_weights
        if frozen and module.weight.device.type == "cpu":
            module.forward = types.MethodType(functools.partial(_frozen_int8_forward, scratch=scratch), module)


def _frozen_int8_forward(self: Any, x: torch.Tensor, scratch: DequantScratch) -> torch.Tensor:
    if self.weight.CB is not None:  # first call: bitsandbytes moves the int8 weight into the layer's state
        self.init_8bit_state()
        self.weight.data = self.state.CB
    bias = None if self.bias is None else self.bias.to(x.dtype)
    return FrozenInt8Product.apply(x, self.state.CB, self.state.SCB, bias, scratch)


class DequantScratch:
    """One buffer per dtype that every layer of a model dequantizes its weight into, in turn.

    A dequantized weight lives for one product only (a forward's output, a backward's input
    gradient), so one buffer the size of the largest weight serves them all. Reused, it stays in
    the CPU's cache, where a fresh tensor per product would be allocated and faulted in each time:
    an 8-bit forward and backward at the TRL benchmark's shapes runs 7-13% faster, and holds no
    more than the one transient weight it held before.
    """

    def __init__(self) -> None:
        self.buffers: dict[torch.dtype, torch.Tensor] = {}

    def dequantized(self, cb: torch.Tensor, scb: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`cb * scb / 127` (a scale per row) in `dtype`, valid until this scratch's next call."""
        buffer = self.buffers.get(dtype)
        if buffer is None or buffer.numel() < cb.numel():
            buffer = self.buffers[dtype] = torch.empty(cb.numel(), dtype=dtype, device=cb.device)
        # bitsandbytes' own form (so the same bits), and on a CPU 25x faster than `torch.mul(cb, scale)`,
        # whose mixed int8-float product with a broadcast scale takes a slow path.
        return buffer[: cb.numel()].view(cb.shape).copy_(cb).mul_(scb.unsqueeze(1).mul(1.0 / 127.0))


class FrozenInt8Product(torch.autograd.Function):
    """`x W^T + b` for a frozen int8 weight `W = CB * SCB / 127` (a scale per output row), as
    bitsandbytes computes it in training on a CPU (the same bits), keeping nothing for backward but
    the int8 weight the layer holds anyway: the gradient reaches `x` only."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        cb: torch.Tensor,
        scb: torch.Tensor,
        bias: torch.Tensor | None,
        scratch: DequantScratch,
    ) -> Any:
        ctx.save_for_backward(cb, scb)
        ctx.scratch = scratch
        return nn.functional.linear(x, scratch.dequantized(cb, scb, x.dtype), bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        cb, scb = ctx.saved_tensors
        grad_x = grad @ ctx.scratch.dequantized(cb, scb, grad.dtype) if ctx.needs_input_grad[0] else None
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.needs_input_grad[3] else None
        return grad_x, None, None, grad_bias, None


def load_causal_lm(
    args: ModelArguments,
    *,
    path: str | None = None,
    demo_cache_dir: str = demo.DEFAULT_CACHE_DIR,
    gradient_checkpointing: bool = False,
    for_training: bool = True,
    pad_token_id: int | None = None,
) -> Any:
    """Load the causal LM `args` names (or `path`), quantized as asked, ready for LoRA training."""
    from transformers import AutoModelForCausalLM

    path = path or resolve_model_path(args.model_name_or_path, demo_cache_dir)
    dtype = torch_dtype(args.dtype)
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": args.trust_remote_code}
    qconfig = quantization_config(args.quantization, dtype)
    if qconfig is not None:
        kwargs["quantization_config"] = qconfig
        kwargs["device_map"] = _device_map()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except OSError as e:
        raise UsageError(f"cannot load model {path}{offline_note()}: {first_line(e)}") from None
    if qconfig is not None:
        _release_checkpoint_map(model)
        _int8_layers_on_cpu(model)
    if pad_token_id is not None:
        model.config.pad_token_id = pad_token_id
        if model.generation_config is not None:
            model.generation_config.pad_token_id = pad_token_id
    kbit_training = qconfig is not None and for_training
    if kbit_training:
        from peft import prepare_model_for_kbit_training

        # Freezes the base and casts norms and the head to fp32; checkpointing is turned on below, with
        # transformers' current API (peft's own call goes through a deprecated alias).
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        if not kbit_training:  # non-reentrant checkpointing of k-bit layers needs no input grads
            model.enable_input_require_grads()
        model.config.use_cache = False
    return model


@contextmanager
def unloaded_bitsandbytes_hidden() -> Iterator[None]:
    """Keep peft from importing bitsandbytes for a model that cannot use it.

    peft 0.21 imports bitsandbytes as it is imported and as it wraps a model, whether or not the
    model has bitsandbytes layers: about 2 s and 44 MB of RSS on a CPU. A model can only hold such
    layers if bitsandbytes is imported already, so until then it is hidden from the block, and
    peft's cached answers to "is it installed?" are cleared after it, for a later 8-bit model.
    """
    if "bitsandbytes" in sys.modules:
        yield
        return
    sys.modules["bitsandbytes"] = None  # type: ignore[assignment]  # `import bitsandbytes` fails at once
    try:
        import peft.import_utils

        yield
    finally:
        del sys.modules["bitsandbytes"]
        peft.import_utils.is_bnb_available.cache_clear()
        peft.import_utils.is_bnb_4bit_available.cache_clear()


def lora_config(args: LoraArguments, model_type: str, task_type: str = "CAUSAL_LM") -> Any:
    """A peft `LoraConfig` from `args`, with the architecture's default targets when none are given."""
    from peft import LoraConfig

    targets: Any = args.lora_target_modules
    if not targets:
        targets = DEFAULT_LORA_TARGETS.get(model_type, "all-linear")
    elif targets == ["all-linear"]:
        targets = "all-linear"
    return LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=targets,
        bias="none",
        task_type=task_type,
    )


def add_lora(model: Any, args: LoraArguments) -> Any:
    """Wrap `model` in a fresh trainable LoRA adapter; a target that matches nothing is a usage error."""
    try:
        with unloaded_bitsandbytes_hidden():
            from peft import get_peft_model

            return get_peft_model(model, lora_config(args, model.config.model_type))
    except ValueError as e:
        raise UsageError(f"cannot put LoRA on this model: {first_line(e)}") from None


def check_adapter_base(
    adapter_dir: Path,
    model_name: str,
    model_path: str,
    stage: str,
    force: bool,
    producer: str | None = None,
    require_record: bool = True,
) -> None:
    """Refuse an adapter that was not trained on this model, or not by the stage that should have made it.

    What the adapter records of its base (its run's `run_config.yaml` and `run_info.json`, peft's
    `adapter_config.json`) is compared with the model named (`model_name`) and its resolved path or hub
    id (`model_path`), as strings and as resolved paths. `producer` is the stage whose output this
    stage takes (`run_info.json` says which stage wrote the adapter). `force` skips the check; without
    `require_record`, an adapter that records no base at all passes (the merge checks shapes itself).
    """
    import json

    from fitrl.config import load_run_config, load_run_info

    if force:
        return
    info, config = load_run_info(adapter_dir), load_run_config(adapter_dir)
    made_by = info.get("stage")
    if producer is not None and made_by is not None and made_by != producer:
        raise UsageError(
            f"{adapter_dir} is the output of the {made_by} stage; {stage} takes the {producer} stage's "
            "(or pass --force true)"
        )
    peft_config = adapter_dir / "adapter_config.json"
    peft_base = json.loads(peft_config.read_text()).get("base_model_name_or_path") if peft_config.is_file() else None
    recorded = {config.get("model_name_or_path"), info.get("resolved_model_path"), peft_base} - {None, ""}
    if not recorded and not require_record:
        return
    if not recorded:
        raise UsageError(f"adapter {adapter_dir} records no base model; pass --force true if it fits {model_name}")
    if {model_name, model_path} & recorded:
        return
    here = {Path(p).expanduser().resolve() for p in (model_name, model_path) if Path(p).expanduser().exists()}
    there = {Path(p).expanduser().resolve() for p in recorded if Path(p).expanduser().exists()}
    if here & there:
        return
    trained_on = config.get("model_name_or_path") or peft_base or sorted(recorded)[0]
    raise UsageError(
        f"adapter {adapter_dir} was trained on {trained_on}, not {model_name}; "
        "set model_name_or_path to its base (or pass --force true)"
    )


class PolicyAndValue(nn.Module):
    """The LoRA policy and the value head as one module, so DDP averages both sets of gradients."""

    def __init__(self, policy: nn.Module, hidden_size: int):
        super().__init__()
        self.policy = policy
        self.value_head = nn.Linear(hidden_size, 1)  # fp32 whatever the backbone's dtype
        nn.init.normal_(self.value_head.weight, std=1 / math.sqrt(hidden_size + 1))
        nn.init.zeros_(self.value_head.bias)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits of the last `logits_to_keep` positions (0: all) (B, K, V), and a value per position (B, T).

        PPO needs logits only where they predict the response: keeping those alone saves the (B, Q, V)
        rest. The value head reads the body's last hidden state through a hook rather than asking for
        every layer's (`output_hidden_states` would keep L + 1 of them alive).
        """
        with last_hidden_states(self.policy) as captured:
            out = self.policy(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids(attention_mask),
                logits_to_keep=logits_to_keep,
            )
        return out.logits, self.values(captured[-1])

    def values(self, hidden: torch.Tensor) -> torch.Tensor:
        """The value head on the body's last hidden states: (B, T, H) -> (B, T)."""
        return self.value_head(hidden.float()).squeeze(-1)
