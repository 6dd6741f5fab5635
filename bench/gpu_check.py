"""The promises on a real GPU: the shipped profiles at real size, planned vs measured, and throughput.

Here, where pip reaches PyPI, then on the GPU machine (no network; it lacks trl and bitsandbytes):

    bash bench/gpu_wheels.sh .whl                                   # the pinned wheels the machine lacks
    python bench/gpu_check.py --wheels .whl --out gpu_check.json    # under 8 minutes on an H100
    python bench/gpu_check.py --tiny --out cpu.json                 # the same code on a CPU, tiny models (tests)

Rows, most valuable first (`--rows` picks some): each is a shipped profile's stage config
(`configs/<profile>/<stage>.yaml`, read by the stage's own parser, overrides on top) on the real
architecture (`fitrl/model_configs/`) with random weights made on the machine (nothing is
downloaded), written as a checkpoint and loaded through `fitrl.modeling.load_causal_lm` (bitsandbytes
8-bit / 4-bit as configured); then the stage's LoRA and optimizer (`fitrl.memtrace.build_trainable`),
a timed rollout through `fitrl.rollout.sample_responses` (every response to full length, the worst
case), one step of the stage under the planner's tracker (`fitrl.memtrace.measure_step`: generation,
no-grad passes, two accumulating micro-steps after a first optimizer step) and two timed micro-steps.

Per row: the plan (tensors; with the CUDA context and allocator slack), `max_memory_allocated`,
`max_memory_reserved`, what the process holds outside torch's allocator (the CUDA context, cuBLAS),
the reward model the run loads beside (planned, not loaded here), the profile's card and its real
capacity with what would be left, seconds per step, and throughput beside its hardware bound:
generated tokens/s against weights-plus-KV-cache bytes read per decode step over the card's memory
bandwidth, trained tokens/s against the linear layers' FLOPs per token over its dense bf16 peak.
Rows are written as each finishes, so a run cut off keeps what it did; a failing row is recorded and
the next one runs. `--tiny` shrinks each architecture (same model type) and its lengths, on the CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file from a checkout that was never installed (the GPU machine)

# What the check imports, by module name; the GPU machine's image has torch, transformers, peft and
# accelerate, not trl, datasets (trl's parser needs it) or bitsandbytes.
NEEDED = ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "datasets", "trl")
# Set once the wheels are installed, so the re-executed check does not install them again.
INSTALLED_ENV = "FITRL_GPU_CHECK_SITE"


@dataclass(frozen=True)
class Row:
    profile: str
    stage: str
    architecture: str  # the model the stage trains (PPO's merged model has the base's architecture)
    card: str  # the card the profile is sized for (`fitrl.cards`)
    overrides: tuple[str, ...] = ()
    suffix: str = ""

    @property
    def name(self) -> str:
        return f"{self.profile}/{self.stage}{self.suffix}"


NEOX, LLAMA1B = "EleutherAI/gpt-neox-20b", "meta-llama/Llama-3.2-1B-Instruct"
ROWS = (  # by value: the blog's PPO first, then its SFT, the planner's 16 GB PPO, the 1B GRPO recipe
    Row("neox20b-24gb", "ppo", NEOX, "RTX 4090"),
    Row("neox20b-24gb", "sft", NEOX, "RTX 4090"),
    Row("neox20b-24gb", "ppo", NEOX, "RTX 3080 Laptop 16GB", ("--quantization", "4bit"), "-4bit"),
    Row("llama1b-16gb", "grpo", LLAMA1B, "RTX 3080 Laptop 16GB"),
)

# Spec-sheet peaks for the bounds: memory bandwidth (bytes/s) and dense bf16 tensor FLOP/s, matched
# against torch's device name, most specific first. Cards not here get no bound (the rows still run).
PEAKS = (
    ("H100 PCIe", 2.0e12, 756e12),
    ("H100 NVL", 3.9e12, 835e12),
    ("H100", 3.35e12, 989e12),  # SXM5, HBM3
    ("H200", 4.8e12, 989e12),
    ("A100-SXM4-80GB", 2.039e12, 312e12),
    ("A100", 1.555e12, 312e12),
    ("L4", 0.3e12, 121e12),
    ("RTX 4090", 1.008e12, 165e12),
    ("RTX 3090", 0.936e12, 71e12),
)
MiB = 2**20


# --- the packages the GPU machine lacks ----------------------------------------------------------


def stop(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def missing_modules() -> list[str]:
    return [m for m in NEEDED if importlib.util.find_spec(m) is None]


def install_wheels(wheels: Path, argv: list[str]) -> None:
    """Install every wheel in `wheels` into a private folder (no network, no dependencies resolved)
    and run this check again with it first on the path, so the pinned versions win."""
    found = sorted(wheels.glob("*.whl"))
    if not found:
        stop(f"no .whl files in {wheels}; make them with `bash bench/gpu_wheels.sh {wheels}`")
    site = Path(tempfile.mkdtemp(prefix="fitrl-gpu-check-site-"))
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    done = subprocess.run([*pip, "--target", str(site), *map(str, found)], capture_output=True, text=True)
    if done.returncode != 0:
        stop(f"installing the wheels in {wheels} failed: {(done.stderr.strip().splitlines() or ['no output'])[-1]}")
    env = {**os.environ, INSTALLED_ENV: str(site)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
    os.execve(sys.executable, [sys.executable, __file__, *argv], env)


def check_packages(wheels: Path | None, argv: list[str]) -> None:
    """Stop with one line naming what is missing, or install it from `wheels` and start again."""
    if wheels is not None and INSTALLED_ENV not in os.environ:
        install_wheels(wheels, argv)
    missing = missing_modules()
    if missing:
        hint = "the wheels given lack them" if wheels else "give --wheels DIR (bash bench/gpu_wheels.sh DIR makes it)"
        stop(f"this machine lacks {', '.join(missing)}; {hint}")


def installed_from_wheels() -> list[str]:
    """The distributions `install_wheels` put first on the path, as name-version."""
    site = os.environ.get(INSTALLED_ENV)
    return sorted(p.name.removesuffix(".dist-info") for p in Path(site).glob("*.dist-info")) if site else []


# --- a row ----------------------------------------------------------------------------------------


def tiny(config: Any) -> Any:
    """The same model type at toy size: the CPU check of the same code."""
    import copy

    small = copy.deepcopy(config)
    sizes = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4}
    sizes |= {"vocab_size": 2048}
    for key, value in sizes.items():
        setattr(small, key, value)
    if getattr(small, "num_key_value_heads", None):
        small.num_key_value_heads = 2
    if getattr(small, "head_dim", None):
        small.head_dim = 32
    return small


def tiny_workload(w: Any) -> Any:
    """A profile's shapes an eighth as long, so the CPU runs every row in seconds."""
    return dataclasses.replace(
        w, prompt_len=max(w.prompt_len // 8, 1) if w.prompt_len else 0, completion_len=max(w.completion_len // 8, 1)
    )


def random_checkpoint(config: Any, path: Path, device: str, shard_bytes: int = 2 * 2**30) -> None:
    """Random weights of `config` written as a sharded safetensors checkpoint, a tensor at a time
    (gpt-neox-20b is 41 GB in bf16: the whole model is never held at once). Norm weights are 1 and
    biases 0, so activations keep their scale; the rest is N(0, 0.02), so sampling rarely stops early."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    seen: set[int] = set()
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:  # tied weights: stored once, tied again on load
            continue
        seen.add(id(tensor))
        if tensor.dim() == 1:
            value = torch.ones if name.endswith("weight") else torch.zeros
            made = value(tensor.shape, dtype=torch.bfloat16, device=device)
        else:
            made = torch.randn(tensor.shape, dtype=torch.bfloat16, device=device).mul_(0.02)
        if size and size + made.numel() * 2 > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = made.cpu()
        size += made.numel() * 2
    path.mkdir(parents=True)
    config.save_pretrained(path)
    index = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path / file, metadata={"format": "pt"})
        index |= dict.fromkeys(shard, file)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))


def linear_params(config: Any) -> int:
    """Weights of every linear layer, the LM head included: 2 FLOPs each per token per forward."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def peaks(device_name: str) -> tuple[float, float] | None:
    found = [p for p in PEAKS if p[0].lower() in device_name.lower()]
    return found[0][1:] if found else None


def synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_rollout(model: Any, w: Any, device: str) -> dict[str, float]:
    """`fitrl.rollout.sample_responses` over `gen_batch` random queries, every response full length."""
    import torch

    from fitrl.memtrace import _policy
    from fitrl.rollout import sample_responses

    policy = model.policy if hasattr(model, "policy") else model
    vocab = _policy(model).config.vocab_size
    tokens = dict(pad_token_id=0, eos_token_id=1)
    tokenizer = type("Ids", (), tokens)()  # sampling needs only the pad and EOS ids
    queries = torch.randint(2, vocab, (w.gen_batch, w.prompt_len)).tolist()
    sample_responses(policy, tokenizer, queries[:1], [2], False, torch.device(device))  # warm-up: kernels, cuBLAS
    synchronize(device)
    started = time.perf_counter()
    sample_responses(policy, tokenizer, queries, [w.completion_len] * w.gen_batch, False, torch.device(device))
    synchronize(device)
    seconds = time.perf_counter() - started
    return {
        "rollout_seconds": round(seconds, 3),
        "generated_tokens_per_s": round(w.gen_batch * w.completion_len / seconds, 1),
    }


def timed_micro_steps(model: Any, w: Any, device: str, steps: int = 2) -> dict[str, float]:
    from fitrl.memtrace import _policy, training_micro_step

    vocab = _policy(model).config.vocab_size
    synchronize(device)
    started = time.perf_counter()
    for _ in range(steps):
        training_micro_step(model, w, device, vocab)
    synchronize(device)
    seconds = (time.perf_counter() - started) / steps
    for p in model.parameters():
        p.grad = None
    return {
        "micro_step_seconds": round(seconds, 3),
        "trained_tokens_per_s": round(w.micro_batch * w.seq_len / seconds, 1),
    }


def plan_row(row: Row, on_gpu: bool, is_tiny: bool) -> tuple[Any, Any, Any, dict[str, Any]]:
    """The row's stage settings, architecture, workload and plan, read as the stage and the planner read them."""
    from fitrl import planner, stages
    from fitrl.architectures import architecture
    from fitrl.demo import DemoArguments
    from fitrl.stages.base import config_of

    stage = stages.get(row.stage)
    config_file = ROOT / "configs" / row.profile / f"{row.stage}.yaml"
    configs = stage.parse(["--config", str(config_file), *row.overrides])
    config = architecture(row.architecture)
    config = tiny(config) if is_tiny else config
    w = stage.memory.workload(configs, config.model_type, on_gpu, 1)
    w = tiny_workload(w) if is_tiny else w
    demo_assets = config_of(configs, DemoArguments).demo_assets
    reward = planner.reward_model_bytes(stage.memory.reward_model(configs), demo_assets)
    plan = planner.plan(config, w, model=row.architecture, on_gpu=on_gpu)  # the step; the reward model apart
    out = {
        "row": row.name,
        "config": str(config_file.relative_to(ROOT)),
        "overrides": list(row.overrides),
        "model": row.architecture + (" (tiny)" if is_tiny else ""),
        "workload": planner.describe(w),
        "planned_tensor_peak_mb": round(plan.tensor_peak_bytes / MiB, 1),
        "planned_peak_mb": round(plan.peak_bytes / MiB, 1),
        "planned_phase_mb": {k: round(v / MiB, 1) for k, v in plan.phase_bytes.items()},
        "reward_model_mb": round(reward / MiB, 1),
    }
    return config, w, plan, out


def load_model(config: Any, w: Any, device: str, workdir: Path) -> Any:
    """Random weights of `config` loaded as the stage loads its base, with its LoRA (and value head)."""
    from fitrl.memtrace import build_trainable
    from fitrl.modeling import ModelArguments, load_causal_lm

    path = workdir / f"{config.model_type}-{config.num_hidden_layers}x{config.hidden_size}"
    if not path.exists():  # one checkpoint per architecture, shared by its rows
        random_checkpoint(config, path, device if device.startswith("cuda") else "cpu")
    args = ModelArguments(str(path), w.quantization, w.dtype if not w.quantized else "bfloat16")
    base = load_causal_lm(args, path=str(path), gradient_checkpointing=w.gradient_checkpointing)
    if not w.quantized:
        base = base.to(device)
    return build_trainable(config, w, device, base=base)


def gpu_memory(row: Row, out: dict[str, Any]) -> dict[str, Any]:
    """The allocator's peaks over the step, what the process holds outside it, and what the real run
    would need of the profile's card: this step, that, and the reward model loaded beside."""
    import torch

    from fitrl.cards import card

    free, total = torch.cuda.mem_get_info()
    found = {
        "max_allocated_mb": round(torch.cuda.max_memory_allocated() / MiB, 1),
        "max_reserved_mb": round(torch.cuda.max_memory_reserved() / MiB, 1),
        "outside_allocator_mb": round((total - free - torch.cuda.memory_reserved()) / MiB, 1),
    }
    found["allocated_vs_planned"] = round(found["max_allocated_mb"] / out["planned_tensor_peak_mb"], 3)
    found["reserved_vs_planned_peak"] = round(found["max_reserved_mb"] / out["planned_peak_mb"], 3)
    need = found["max_reserved_mb"] + found["outside_allocator_mb"] + out["reward_model_mb"]
    target = card(row.card)
    found["card"] = target.name
    found["card_capacity_mb"] = round(target.capacity_gib * 1024, 1)
    found["measured_need_mb"] = round(need, 1)
    found["left_on_card_mb"] = round(found["card_capacity_mb"] - need, 1)
    return found


def run_row(row: Row, device: str, is_tiny: bool, workdir: Path) -> dict[str, Any]:
    import torch

    from fitrl.memtrace import measure_step

    started = time.perf_counter()
    on_gpu = device.startswith("cuda")
    config, w, plan, out = plan_row(row, on_gpu, is_tiny)
    model = load_model(config, w, device, workdir)
    out["load_seconds"] = round(time.perf_counter() - started, 1)
    if w.gen_batch:
        out |= timed_rollout(model, w, device)
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    step_started = time.perf_counter()
    measured = measure_step(model, w, device)
    synchronize(device)
    out["step_seconds"] = round(time.perf_counter() - step_started, 2)
    out["measured_tensor_peak_mb"] = round(max(measured.values()) / MiB, 1)
    out["measured_phase_mb"] = {k: round(v / MiB, 1) for k, v in measured.items()}
    out["tracked_vs_planned"] = round(out["measured_tensor_peak_mb"] / out["planned_tensor_peak_mb"], 3)
    if on_gpu:
        out |= gpu_memory(row, out)
    out |= timed_micro_steps(model, w, device)
    out |= bounds(config, w, plan, device, out)
    out["seconds"] = round(time.perf_counter() - started, 1)
    del model
    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()
    return out


def bounds(config: Any, w: Any, plan: Any, device: str, out: dict[str, Any]) -> dict[str, Any]:
    """Each throughput beside the card's limit: decoding reads every weight (and the KV cache, half
    full on average) once per step for the whole batch; a LoRA micro-step on a frozen base costs
    the linear layers' forward, their input gradients and, under checkpointing, a second forward
    (2 FLOPs per weight each; attention's own products left out: a few percent at these lengths)."""
    import torch

    if not device.startswith("cuda"):
        return {}
    name = torch.cuda.get_device_name()
    limits = peaks(name)
    result: dict[str, Any] = {"device_name": name}
    if limits is None:
        return result
    bandwidth, flops = limits
    if w.gen_batch:
        kv_read = plan.kv_cache_bytes * (w.prompt_len + w.completion_len / 2) / w.seq_len
        step_bytes = plan.components["weights"] + kv_read
        result["generated_tokens_per_s_bound"] = round(w.gen_batch * bandwidth / step_bytes, 1)
        result["generation_vs_bound"] = round(out["generated_tokens_per_s"] / result["generated_tokens_per_s_bound"], 3)
    per_token = 2 * linear_params(config) * (3 if w.gradient_checkpointing else 2)
    result["trained_tokens_per_s_bound"] = round(flops / per_token, 1)
    result["training_vs_bound"] = round(out["trained_tokens_per_s"] / result["trained_tokens_per_s_bound"], 3)
    return result


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write the rows to, after each row.")
    parser.add_argument("--tiny", action="store_true", help="Tiny models and lengths on the CPU: this check's test.")
    parser.add_argument("--device", help="cuda or cpu (default: cuda when there is one, cpu with --tiny).")
    parser.add_argument("--wheels", type=Path, help="A folder of wheel files to install what is missing from.")
    names = [r.name for r in ROWS]
    parser.add_argument("--rows", default=",".join(names), help=f"Comma-separated rows, of: {','.join(names)}.")
    args = parser.parse_args(argv)
    wanted = args.rows.split(",")
    unknown = [r for r in wanted if r not in names]
    if unknown:  # a typo would otherwise run nothing and write an empty file
        parser.error(f"unknown row(s) {', '.join(unknown)} in --rows; choose from {','.join(names)}")
    check_packages(args.wheels, argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no GPU here (use --tiny for the CPU check)")
    result: dict[str, Any] = {"device": device, "tiny": args.tiny, "rows": []}
    if device.startswith("cuda"):
        result["device_name"] = torch.cuda.get_device_name()
        result["capacity_mb"] = round(torch.cuda.get_device_properties(0).total_memory / MiB, 1)
    result["versions"] = {m: _version(m) for m in NEEDED}
    result["installed"] = installed_from_wheels()
    with tempfile.TemporaryDirectory(prefix="fitrl-gpu-check-") as tmp:
        for row in (r for r in ROWS if r.name in wanted):
            try:
                measured = run_row(row, device, args.tiny, Path(tmp))
            except Exception as e:  # one failing row must not cost the others: record it and go on
                measured = {"row": row.name, "error": repr(e)[:500]}
                gc.collect()
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()
            result["rows"].append(measured)
            print(json.dumps(measured), flush=True)
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


def _version(module: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
