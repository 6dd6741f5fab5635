"""Will it fit? The peak memory of a training stage (SFT, reward model, PPO, DPO, GRPO), before a weight loads.

The plan has two kinds of parts:

- **static bytes, counted exactly**: the base as held in memory (fp32/bf16/fp16, or bitsandbytes'
  int8 weights with their fp32 scales, or packed nf4 with double-quantized block scales, and the
  modules bitsandbytes keeps unquantized, cast to fp32 by k-bit training preparation), the LoRA
  adapter and value head, their gradients and the optimizer's states (AdamW, bitsandbytes' 8-bit
  and paged ones, Adafactor), and the reward model. They are counted on the model's real module
  tree, built on the `meta` device from its `config.json`: nothing is allocated.
- **what a step allocates, per phase** (generation with its KV cache, the no-grad passes, the
  training micro-step with its activations, logits and log-prob buffers and their fp32 upcasts):
  `fitrl.memtrace` runs the stage's step on two- and three-block versions of the architecture on
  `meta`, and the plan extrapolates linearly in depth (every block after the first adds the same bytes).
  Generation is traced as its prefill and its last decode step (on a KV cache filled to full length),
  each extrapolated in depth before taking the larger.
  No formula per model family to drift with each transformers release: the trace sees the real
  attention, norms, LoRA wrapping, loss and fused heads.

On top, for a GPU, two stated constants: the CUDA context (outside torch's allocator) and the
caching allocator's slack. `--trace` runs the full depth on `meta` to check the extrapolation; tests
and `bench/planner_accuracy.py` compare the plan with real tensors measured on a CPU.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from fitrl.architectures import architecture
from fitrl.config import UsageError, first_line, with_overrides
from fitrl.demo import DemoArguments
from fitrl.memtrace import LAST_DECODE_STEP, PREFILL, TORCH_DTYPES, build_trainable, trace_step
from fitrl.modeling import CLASSIFIER_HEADS, DEFAULT_LORA_TARGETS, ModelArguments, torch_dtype
from fitrl.stages.base import Configs, Moves, RewardModel, Stage, config_of
from fitrl.workload import Workload

GiB = 2**30
MiB = 2**20
# Memory a GPU process holds outside torch's allocator (CUDA context, cuBLAS workspace): ~0.3-0.9 GiB
# depending on the card and driver; the plan takes the upper half of that range.
CUDA_CONTEXT_BYTES = 640 * MiB
# The caching allocator rounds and fragments what a step allocates and frees (the weights, allocated
# once in large blocks, fragment little): reserved exceeds allocated by this share of the step's bytes.
ALLOCATOR_SLACK = 0.10
# bitsandbytes' 8-bit optimizers keep tensors smaller than this in 32 bits (`min_8bit_size`).
BNB_MIN_8BIT_SIZE = 4096
BNB_OPTIMIZER_BLOCK = 256
NF4_BLOCK = 64
NF4_NESTED_BLOCK = 256
PHASES = ["generation", "no-grad pass", "training step"]
STATIC = ["weights", "trainable_params", "gradients", "optimizer_states", "reward_model"]


# --- static bytes -----------------------------------------------------------------------------------


def _quantized_bytes(numel: int, out_features: int, quantization: str) -> int:
    """Bytes bitsandbytes holds for one quantized weight: int8 + fp32 row scales, or nf4 + double-quantized scales."""
    if quantization == "8bit":
        return numel + 4 * out_features  # int8 weight, SCB (fp32 per output row)
    blocks = math.ceil(numel / NF4_BLOCK)
    nested = math.ceil(blocks / NF4_NESTED_BLOCK)
    # packed nf4, uint8 block scales, the nf4 code (16 fp32) and offset, fp32 nested scales and their 8-bit code
    return (numel + 1) // 2 + blocks + 16 * 4 + 4 + nested * 4 + 256 * 4


def _optimizer_bytes(params: list[Any], optimizer: str) -> int:
    """Bytes of the optimizer's state for `params` (after its first step), as torch or bitsandbytes keep it."""
    if not params:
        return 0
    if optimizer in ("adamw", "adamw_torch", "paged_adamw_32bit"):
        step = 4 if optimizer != "paged_adamw_32bit" else 0  # torch keeps a scalar fp32 step per tensor
        return sum(2 * p.numel() * (4 if optimizer == "paged_adamw_32bit" else p.element_size()) + step for p in params)
    if optimizer == "adafactor":  # factored second moment for matrices, full for vectors (transformers' Adafactor)
        return sum(4 * (sum(p.shape[-2:]) if p.dim() >= 2 else p.numel()) for p in params)
    total, quantized = 0, False
    for p in params:  # adamw_8bit, adamw_bnb_8bit, paged_adamw_8bit
        n = p.numel()
        if n < BNB_MIN_8BIT_SIZE:
            total += 2 * 4 * n
        else:
            quantized = True
            total += 2 * (n + 4 * math.ceil(n / BNB_OPTIMIZER_BLOCK))  # uint8 states and their fp32 block maxima
    return total + (2 * 256 * 4 if quantized else 0)  # the two quantization maps, shared by all tensors


def static_bytes(config: Any, w: Workload) -> dict[str, int]:
    """Exact bytes of the base as held, the trainable parameters, their gradients and the optimizer states."""
    # Shapes do not change static bytes: one count serves every micro-batch and length.
    shapeless = replace(w, micro_batch=1, prompt_len=0, completion_len=1, gen_batch=0, nograd_batch=0)
    return dict(_static_bytes(_config_json(config), shapeless))


@functools.lru_cache(maxsize=64)
def _static_bytes(config_json: str, w: Workload) -> tuple[tuple[str, int], ...]:
    from fitrl.memtrace import KbitLinearStandIn

    model = build_trainable(_config_from_json(config_json), w, "meta")
    seen: set[int] = set()
    weights = trainable = 0
    trainable_params = []
    for module_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if p.requires_grad:
                trainable_params.append(p)
            if p.requires_grad and (w.finetuning == "lora" or module_name.startswith("value_head")):
                trainable += p.numel() * p.element_size()  # the adapter and value head (full: the base is trained)
            elif isinstance(module, KbitLinearStandIn) and name == "weight":
                weights += _quantized_bytes(p.numel(), module.out_features, w.quantization)
            else:
                weights += p.numel() * p.element_size()
        for b in module.buffers(recurse=False):
            if id(b) not in seen:
                seen.add(id(b))
                weights += b.numel() * b.element_size()
    return (
        ("weights", weights),
        ("trainable_params", trainable),
        ("gradients", sum(p.numel() * p.element_size() for p in trainable_params)),
        ("optimizer_states", _optimizer_bytes(trainable_params, w.optimizer)),
    )


def reward_model_bytes(spec: RewardModel | None, demo_assets: str | None = None) -> int:
    """Bytes of the classifier PPO loads beside the policy, as `ClassifierReward` loads it: every tensor in
    its dtype, but the linear layers outside its head in 8-bit (a byte a weight, a float scale a row) or
    4-bit NF4 (half a byte, an 8-bit scale per 64 weights and a float per 256 scales)."""
    if spec is None:
        return 0
    import torch
    from transformers import AutoModelForSequenceClassification

    config = architecture(spec.name, demo_assets)
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config)
    width = torch.empty((), dtype=torch_dtype(spec.dtype)).element_size()
    quantized: dict[int, float] = {}
    if spec.quantization != "none":
        for name, module in model.named_modules():
            head = any(part in CLASSIFIER_HEADS for part in name.split("."))  # bitsandbytes' skip rule
            if isinstance(module, torch.nn.Linear) and not head:
                w = module.weight
                per = 1 + 4 / w.shape[1] if spec.quantization == "8bit" else 0.5 + 1 / 64 + 4 / (64 * 256)
                quantized[id(w)] = w.numel() * per
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return int(sum(quantized.get(k, t.numel() * width) for k, t in tensors.items()))


# --- what a step allocates ------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _traced(config_json: str, w: Workload, num_layers: int) -> tuple[tuple[str, int], ...]:
    config = _config_from_json(config_json)
    model = build_trainable(config, w, "meta", num_layers=num_layers)
    return tuple(trace_step(model, w, "meta", every_decode_step=False).items())


def _config_from_json(config_json: str) -> Any:
    from transformers import AutoConfig

    values = json.loads(config_json)
    return AutoConfig.for_model(values.pop("model_type"), **values)


def _config_json(config: Any) -> str:
    return json.dumps(config.to_dict(), sort_keys=True, default=str)


# Depths the plan traces and extrapolates from. Not 1 and 2: the first block's peak can differ from
# the others' (its input is the embedding output), and a no-grad pass stops growing after two blocks.
DEPTHS = (2, 3)


def dynamic_bytes(config: Any, w: Workload) -> dict[str, int]:
    """Peak bytes each phase allocates beyond the static parts: traced at the model's depth if shallow,
    else extrapolated linearly from two- and three-block traces."""
    layers, key = config.num_hidden_layers, _config_json(config)
    if layers <= DEPTHS[1]:
        phases = dict(_traced(key, w, layers))
    else:
        low, high = dict(_traced(key, w, DEPTHS[0])), dict(_traced(key, w, DEPTHS[1]))
        phases = {phase: int(low[phase] + (layers - DEPTHS[0]) * (high[phase] - low[phase])) for phase in low}
    if PREFILL in phases:
        phases["generation"] = max(phases.pop(PREFILL), phases.pop(LAST_DECODE_STEP, 0))
    return phases


def kv_cache_bytes(config: Any, w: Workload) -> int:
    """The KV cache at the end of generation, for the table (the trace measures it with everything else)."""
    if not w.gen_batch:
        return 0
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    itemsize = TORCH_DTYPES[w.dtype].itemsize if not w.quantized else 4
    return 2 * config.num_hidden_layers * w.gen_batch * w.seq_len * kv_heads * head_dim * itemsize


# --- the plan ---------------------------------------------------------------------------------------


@dataclass
class Plan:
    """The planned peak of a run and where it comes from; `components` add up to `peak_bytes`."""

    stage: str
    model: str
    gpu_memory_bytes: int
    workload: Workload
    components: dict[str, int]
    phase_bytes: dict[str, int]  # everything alive at each phase's peak
    peak_bytes: int
    tensor_peak_bytes: int  # peak of torch tensors: what torch.cuda.max_memory_allocated would read
    peak_phase: str
    kv_cache_bytes: int
    on_gpu: bool = True
    suggestions: list[dict[str, Any]] = field(default_factory=list)
    traced: dict[str, int] | None = None

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.gpu_memory_bytes

    def to_json(self) -> dict[str, Any]:
        out = {
            "stage": self.stage,
            "model": self.model,
            "gpu_memory_bytes": self.gpu_memory_bytes,
            "components": self.components,
            "phase_bytes": self.phase_bytes,
            "peak_bytes": self.peak_bytes,
            "tensor_peak_bytes": self.tensor_peak_bytes,
            "peak_phase": self.peak_phase,
            "fits": self.fits,
            "kv_cache_bytes": self.kv_cache_bytes,
            "workload": {**asdict(self.workload), "step": self.workload.step.value},
        }
        if self.suggestions:  # overrides in the stage's own keys, closest first, and the peak each gives
            out["suggestions"] = [s["overrides"] for s in self.suggestions]
            out["suggested_peak_bytes"] = [s["peak_bytes"] for s in self.suggestions]
        if self.traced is not None:
            out["traced_peak_bytes"] = max(self.traced.values())
            out["traced_phase_bytes"] = self.traced
        return out


def plan(
    config: Any,
    w: Workload,
    *,
    model: str = "",
    gpu_memory_bytes: int = 24 * GiB,
    reward_bytes: int = 0,
    on_gpu: bool = True,
) -> Plan:
    """The planned peak of one step of `w` on the architecture `config`."""
    static = static_bytes(config, w)
    static["reward_model"] = reward_bytes
    dynamic = dynamic_bytes(config, w)
    held = sum(static[k] for k in STATIC if k != "gradients")
    phase_bytes = {phase: held + dynamic[phase] for phase in PHASES if phase in dynamic}
    peak_phase = max(phase_bytes, key=phase_bytes.__getitem__)
    tensor_peak = phase_bytes[peak_phase]
    components = {k: static[k] for k in STATIC}
    # The training trace holds the gradients of the micro-step before: the rest of it is activations.
    step = dynamic[peak_phase] - (static["gradients"] if peak_phase == "training step" else 0)
    components[f"{peak_phase} activations"] = step
    if peak_phase != "training step":
        components["gradients"] = 0  # freed (set to None) after each optimizer step
    overhead = {"cuda_context": CUDA_CONTEXT_BYTES, "allocator_slack": int(ALLOCATOR_SLACK * dynamic[peak_phase])}
    if on_gpu:
        components.update(overhead)
    return Plan(
        stage=w.stage,
        model=model,
        gpu_memory_bytes=gpu_memory_bytes,
        workload=w,
        components=components,
        phase_bytes=phase_bytes,
        peak_bytes=sum(components.values()),
        tensor_peak_bytes=tensor_peak,
        peak_phase=peak_phase,
        kv_cache_bytes=kv_cache_bytes(config, w),
        on_gpu=on_gpu,
    )


def trace_full_depth(config: Any, w: Workload) -> dict[str, int]:
    """`--trace`: the whole architecture on `meta`, every phase at full length; total bytes per phase."""
    static = static_bytes(config, w)
    held = static["weights"] + static["trainable_params"] + static["optimizer_states"]
    model = build_trainable(config, w, "meta")
    return {phase: held + b for phase, b in trace_step(model, w, "meta").items()}


def format_bytes(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / MiB:.1f} MiB"


def table(p: Plan) -> str:
    """The plan as a few readable lines: components, the phases, the verdict."""
    lines = [f"Memory plan: {p.stage} on {p.model or 'the model'} ({describe(p.workload)})"]
    width = max(len(k) for k in p.components) + 2
    for name, n in p.components.items():
        if n:
            lines.append(f"  {name:<{width}}{format_bytes(n):>12}")
    lines.append(f"  {'peak':<{width}}{format_bytes(p.peak_bytes):>12}   in the {p.peak_phase}")
    phases = ", ".join(f"{k} {format_bytes(v)}" for k, v in p.phase_bytes.items())
    lines.append(f"  tensors alive at each phase's peak: {phases}")
    if p.kv_cache_bytes:
        lines.append(f"  of which the KV cache at the end of generation: {format_bytes(p.kv_cache_bytes)}")
    if p.traced is not None:
        traced = ", ".join(f"{k} {format_bytes(v)} ({v / p.phase_bytes[k]:.2f}x planned)" for k, v in p.traced.items())
        lines.append(f"  traced at full depth on meta: {traced}")
    verdict = "fits" if p.fits else "does NOT fit"
    lines.append(f"  verdict: {verdict} in {format_bytes(p.gpu_memory_bytes)}")
    for s in p.suggestions:
        flags = " ".join(f"--{k} {_flag(v)}" for k, v in s["overrides"].items())
        lines.append(f"  to fit: {flags}  (peak {format_bytes(s['peak_bytes'])})")
    return "\n".join(lines)


def brief(p: Plan) -> str:
    """One line: the peak that decides the fit, and in it the tensors, the figure a run's `run_info.json`
    (`memory.planned_peak_mb`) and report give beside what it measured."""
    verdict = "fits" if p.fits else "does NOT fit"
    tensors = format_bytes(p.tensor_peak_bytes)
    inside = f"tensors {tensors} + CUDA context and allocator slack" if p.on_gpu else f"tensors {tensors}"
    return (
        f"memory plan: peak {format_bytes(p.peak_bytes)} in the {p.peak_phase} ({inside}; weights "
        f"{format_bytes(p.components['weights'])}); {verdict} in {format_bytes(p.gpu_memory_bytes)}"
    )


def _flag(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(value)


def describe(w: Workload) -> str:
    base = f"{w.quantization} base" if w.quantized else f"{w.dtype} base"
    tune = f"LoRA r={w.lora_r} on {','.join(w.lora_targets)}" if w.finetuning == "lora" else "full fine-tuning"
    ckpt = ", checkpointing" if w.gradient_checkpointing else ""
    return f"{base}, {tune}, {w.optimizer}{ckpt}, micro-batch {w.micro_batch} x {w.seq_len} tokens"


# --- from a stage's configs ------------------------------------------------------------------------


def plan_stage(
    stage: Stage,
    configs: Configs,
    config: Any,
    *,
    gpu_memory_bytes: int = 24 * GiB,
    finetuning: str = "lora",
    on_gpu: bool = True,
    world_size: int = 1,
) -> Plan:
    """The plan for `stage` run with its filled `configs` on the architecture `config`."""
    if stage.memory is None:
        raise UsageError(f"cannot plan stage {stage.name!r}: it trains nothing; plan a training stage")
    w = replace(stage.memory.workload(configs, config.model_type, on_gpu, world_size), finetuning=finetuning)
    check_workload(w, config)
    demo_assets = config_of(configs, DemoArguments).demo_assets
    return plan(
        config,
        w,
        model=config_of(configs, ModelArguments).model_name_or_path,
        gpu_memory_bytes=gpu_memory_bytes,
        reward_bytes=reward_model_bytes(stage.memory.reward_model(configs), demo_assets),
        on_gpu=on_gpu,
    )


def check_workload(w: Workload, config: Any) -> None:
    """Settings no run could have: one line each, before any tracing."""
    if w.finetuning == "full" and w.quantized:
        raise UsageError("full fine-tuning of a quantized base is not possible; set quantization none or plan LoRA")
    for key in ["micro_batch", "completion_len"]:
        if getattr(w, key) < 1:
            raise UsageError(f"invalid value for the {key.replace('_', ' ')}: must be >= 1 (got {getattr(w, key)})")
    if w.prompt_len < 0:
        raise UsageError(f"invalid prompt length {w.prompt_len}: must be >= 0")
    if w.finetuning == "lora" and list(w.lora_targets) != ["all-linear"]:
        from torch import nn

        names = {
            name.rsplit(".", 1)[-1] for name, m in build_skeleton(config).named_modules() if isinstance(m, nn.Linear)
        }
        missing = [t for t in w.lora_targets if t not in names]
        if missing:
            raise UsageError(
                f"LoRA target '{missing[0]}' matches no linear layer of {config.model_type}; "
                f"its linear layers: {', '.join(sorted(names))}"
            )


@functools.lru_cache(maxsize=8)
def _skeleton(config_json: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(_config_from_json(config_json))


def build_skeleton(config: Any) -> Any:
    """The bare architecture on `meta` with one block, for its module names."""
    from fitrl.memtrace import truncated_config

    return _skeleton(_config_json(truncated_config(config, 1)))


# --- what to change -------------------------------------------------------------------------------


def _moves(stage: Stage, configs: Configs, model_type: str, world_size: int) -> Moves:
    """One-step changes of `configs` that save memory, each with its name, cheapest first: the ones
    every stage shares (read off its workload) around the stage's own batch and shape moves."""
    memory = stage.memory
    w = memory.workload(configs, model_type, True, world_size)
    moves: Moves = []
    if not w.gradient_checkpointing:
        moves.append(("checkpointing", {"gradient_checkpointing": True}))
    if "8bit" not in w.optimizer and w.optimizer != "adafactor":
        moves.append(("optimizer", {memory.optimizer_key: memory.eight_bit_optimizer}))
    moves += memory.batch_moves(configs)
    quant = {"none": "8bit", "8bit": "4bit"}.get(w.quantization)
    if quant:
        moves.append(("quantization", {"quantization": quant}))
    moves += memory.shape_moves(configs)
    attention_only = DEFAULT_LORA_TARGETS.get(model_type)
    if attention_only and set(w.lora_targets) != set(attention_only):  # fewer adapted layers, fewer saved inputs
        moves.append(("LoRA targets", {"lora_target_modules": list(attention_only)}))
    return moves


def suggest(
    stage: Stage,
    configs: Configs,
    config: Any,
    *,
    gpu_memory_bytes: int,
    finetuning: str = "lora",
    world_size: int = 1,
    limit: int = 3,
    budget: int = 40,
) -> list[dict[str, Any]]:
    """Overrides (in the stage's own keys) that make the run fit, fewest and cheapest changes first."""
    found: list[dict[str, Any]] = []
    frontier: list[dict[str, Any]] = [{}]
    tried = 0
    for _depth in range(4):
        next_frontier: list[dict[str, Any]] = []
        for overrides in frontier:
            for _name, change in _moves(stage, with_overrides(configs, overrides), config.model_type, world_size):
                candidate = {**overrides, **change}
                if candidate in next_frontier or any(f["overrides"].items() <= candidate.items() for f in found):
                    continue
                tried += 1
                if tried > budget:
                    return found
                p = plan_stage(
                    stage,
                    with_overrides(configs, candidate),
                    config,
                    gpu_memory_bytes=gpu_memory_bytes,
                    finetuning=finetuning,
                    world_size=world_size,
                )
                if p.fits:
                    found.append({"overrides": candidate, "peak_bytes": p.peak_bytes})
                    if len(found) >= limit:
                        return found
                else:
                    next_frontier.append(candidate)
        frontier = next_frontier
    return found


def planned_peak_mb(stage: Stage, configs: Configs, model_path: str, world_size: int = 1) -> float | None:
    """A stage's own plan, in MiB of tensors (what the run measures beside it); None where it cannot plan."""
    import torch

    try:
        config = architecture(model_path)
        p = plan_stage(stage, configs, config, on_gpu=torch.cuda.is_available(), world_size=world_size)
    except Exception as e:  # the plan is a report: it must never stop a run that got this far
        print(f"note: no memory plan for this run ({first_line(e)})")
        return None
    return round(p.tensor_peak_bytes / MiB, 1)
