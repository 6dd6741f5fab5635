"""Load a causal LM (hub id or local dir) in full precision, 8-bit or 4-bit, and put LoRA on it.

Every stage loads its model through here, so quantization, dtype, pad token, k-bit preparation and
LoRA defaults behave the same in SFT, PPO and GRPO.
"""

from __future__ import annotations

import re
import sys
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
from fitrl.int8 import int8_layers_on_cpu

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

# The scalar head transformers' sequence classifiers put on a decoder (GPT-NeoX, Llama, Qwen...): a reward model's.
SCORE_HEAD = "score"
# A sequence classifier's head modules, by name (BERT/DistilBERT/RoBERTa's, a decoder's): kept out of
# quantization, which would round away the few weights that decide the score.
CLASSIFIER_HEADS = ("classifier", "pre_classifier", SCORE_HEAD)

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


def resolve_model_path(name_or_path: str, demo_assets: str, what: str = "model") -> str:
    """Turn demo:// URIs into paths, check local paths exist, and pass hub ids through."""
    if demo.is_demo_uri(name_or_path):
        return str(demo.resolve(name_or_path, demo_assets))
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise UsageError(f"{what} directory {path} has no config.json; point to a saved model directory")
        return str(path.resolve())  # recorded in what a run writes: it must resolve from any directory
    looks_like_path = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
    if looks_like_path or not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name_or_path):
        raise UsageError(f"{what} path {name_or_path} does not exist; give a local directory or a hub id")
    first = Path(name_or_path.split("/")[0])
    if "/" in name_or_path and first.is_dir():  # `outputs/mergd`: a folder here, not a hub organisation
        near = ", ".join(sorted(p.name for p in first.iterdir() if p.is_dir())[:8]) or "no folders"
        raise UsageError(
            f"{what} path {name_or_path} does not exist ({first}/ holds: {near}); give a saved model's folder"
        )
    if "/" not in name_or_path and not _cached_on_hub(name_or_path):  # `my-qwn`: no folder, no hub id
        raise UsageError(
            f"{what} {name_or_path} is no folder here, and a hub id has the form organisation/name "
            "(e.g. Qwen/Qwen2.5-0.5B-Instruct); give a local directory or a hub id"
        )
    return name_or_path


def _cached_on_hub(repo_id: str) -> bool:
    """Whether the hub cache holds `repo_id`'s config.json (a hub id used before, or downloaded)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # an id the hub library refuses: not cached
        return False


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


def quantization_config(quantization: str, compute_dtype: torch.dtype, skip: list[str] | None = None) -> Any:
    """bitsandbytes' config for `quantization`; `skip`: modules kept in full precision (a new score head)."""
    from transformers import BitsAndBytesConfig

    if quantization == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)
    if quantization == "4bit":
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute_dtype,
            llm_int8_skip_modules=skip,
        )
    return None


def load_tokenizer(path: str, trust_remote_code: bool = False, padding_side: str = "right") -> Any:
    """Load a tokenizer and give it a pad token (the EOS token) when it has none."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except StrictDataclassError as e:  # the tokenizer reads the model's config too
        raise config_refused("model", path, e) from None
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


def config_refused(what: str, path: str, e: Exception) -> UsageError:
    """transformers 5 validates a config's values as it reads them (hidden size divisible by the heads ...)."""
    return UsageError(f"{what} {path}: transformers refuses its config.json ({first_line(e.__cause__ or e)}); fix it")


@contextmanager
def loading_errors(what: str, path: str) -> Iterator[None]:
    """What a `from_pretrained` of a user's folder raises, as one usage line: weights that would run code
    (a crafted `.bin`, refused by `weights_only` loading), truncated weights, a config transformers
    cannot read or that needs custom code, a model of the wrong kind."""
    import pickle

    from huggingface_hub.errors import StrictDataclassError
    from safetensors import SafetensorError

    try:
        yield
    except StrictDataclassError as e:
        raise config_refused(what, path, e) from None
    except pickle.UnpicklingError:
        raise UsageError(
            f"{what} {path}: its weights hold objects other than tensors and were refused (loading them could "
            "run code); save the model as safetensors"
        ) from None
    except (OSError, ValueError, SafetensorError) as e:
        if "custom code" in str(e):
            raise UsageError(
                f"{what} {path} needs its own Python code (auto_map in its config), which fitrl does not run "
                "unless told: set trust_remote_code true if you trust it"
            ) from None
        where = "" if Path(path).exists() else offline_note()
        raise UsageError(f"cannot load {what} {path}{where}: {first_line(e)}") from None


def _from_pretrained(auto: Any, path: str, what: str, qconfig: Any, **kwargs: Any) -> Any:
    """`auto.from_pretrained(path)`, quantized by `qconfig` (None: not): placed by bitsandbytes as it loads,
    then the checkpoint map released and 8-bit and 4-bit layers made to run on a CPU. What it returns, returned."""
    if qconfig is not None:
        kwargs.update(quantization_config=qconfig, device_map=_device_map())
    with loading_errors(what, path):
        loaded = auto.from_pretrained(path, **kwargs)
    if qconfig is not None:
        model = loaded[0] if isinstance(loaded, tuple) else loaded  # (model, loading info) when asked
        _release_checkpoint_map(model)
        int8_layers_on_cpu(model)
        int4_layers_on_cpu(model)
    return loaded


def int4_layers_on_cpu(model: nn.Module) -> None:
    """Keep bitsandbytes' 4-bit layers on a CPU on the one product they train with.

    On a CPU with AVX512-BF16, bitsandbytes 0.50 repacks a 4-bit weight in place for a faster kernel
    the first time a layer runs in eval without gradients (generation, the reference pass). That
    kernel refuses a layer whose output size is not a multiple of 32, the repacked weight breaks the
    training step that follows ("a view of a leaf Variable ... in-place operation"), and PPO would
    divide probabilities taken in training by ones from another kernel. Other CPUs never take it.
    """
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit) and module.weight.device.type == "cpu":
            module.support_avx512bf16_for_cpu = False


def load_causal_lm(
    args: ModelArguments,
    *,
    path: str | None = None,
    demo_assets: str = "",
    gradient_checkpointing: bool = False,
    for_training: bool = True,
    pad_token_id: int | None = None,
    score_head: bool = False,
) -> Any:
    """Load the causal LM `args` names (or `path`), quantized as asked, ready for LoRA training.

    `score_head`: the same backbone with a scalar head in place of the LM head (a sequence classifier
    with `num_labels=1`, what a reward model is), the head kept out of quantization.
    """
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    path = path or resolve_model_path(args.model_name_or_path, demo_assets)
    dtype = torch_dtype(args.dtype)
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": args.trust_remote_code}
    qconfig = quantization_config(args.quantization, dtype, skip=[SCORE_HEAD] if score_head else None)
    if score_head:
        kwargs["num_labels"] = 1
    auto = AutoModelForSequenceClassification if score_head else AutoModelForCausalLM
    model = _from_pretrained(auto, path, "model", qconfig, **kwargs)
    if pad_token_id is not None:
        model.config.pad_token_id = pad_token_id
        if getattr(model, "generation_config", None) is not None:
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


def load_classifier(path: str, dtype: str = "float32", quantization: str = "none") -> tuple[Any, dict[str, Any]]:
    """A trained sequence classifier to score with (never trained here) in `dtype`, its linear layers
    quantized as asked but for its head (`CLASSIFIER_HEADS`), and transformers' loading info."""
    from transformers import AutoModelForSequenceClassification

    compute = torch_dtype(dtype)
    qconfig = quantization_config(quantization, compute, skip=list(CLASSIFIER_HEADS))
    model, info = _from_pretrained(
        AutoModelForSequenceClassification, path, "reward model", qconfig, dtype=compute, output_loading_info=True
    )
    return model.eval(), info


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


def make_optimizer(model: torch.nn.Module, optimizer: str, lr: float = 1e-5) -> torch.optim.Optimizer:
    """The optimizer of `model`'s trainable parameters by its trl/transformers name: torch's AdamW,
    bitsandbytes' 8-bit and paged ones, or Adafactor. PPO builds its own with it; the planner traces
    the trl stages' steps with it."""
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer in ("adamw", "adamw_torch"):
        return torch.optim.AdamW(params, lr=lr)
    import bitsandbytes as bnb

    if optimizer in ("adamw_8bit", "adamw_bnb_8bit"):
        return bnb.optim.AdamW8bit(params, lr=lr)
    if optimizer == "paged_adamw_8bit":
        return bnb.optim.PagedAdamW8bit(params, lr=lr)
    if optimizer == "paged_adamw_32bit":
        return bnb.optim.PagedAdamW32bit(params, lr=lr)
    from transformers.optimization import Adafactor

    return Adafactor(params, lr=lr, relative_step=False, scale_parameter=False)
