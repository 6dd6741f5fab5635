"""How good is the memory plan? Planned, traced (full depth on `meta`) and measured peaks, side by side.

    python bench/planner_accuracy.py                 # the demo profiles and small models, on this CPU
    python bench/planner_accuracy.py --real_profiles # and the GPU profiles, planned vs traced (minutes)
    python bench/planner_accuracy.py --device cuda   # the same on a GPU (measured: live tensor bytes)

Measured is the same stage step (`fitrl.memtrace`) on real tensors, with real optimizers: for the demo
profiles the base loads exactly as the stage loads it (`fitrl.modeling.load_causal_lm`, bitsandbytes
8-bit on a CPU included), so the stand-ins of the trace are checked too. Peaks are the tensors alive
at each phase's peak (no CUDA context or allocator slack), in MiB.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from fitrl import planner, stages
from fitrl.architectures import architecture
from fitrl.demo import DemoArguments
from fitrl.memtrace import build_trainable, measure_step
from fitrl.modeling import ModelArguments, load_causal_lm, resolve_model_path
from fitrl.stages.base import config_of
from fitrl.workload import Step, Workload

ROOT = Path(__file__).resolve().parents[1]


def small(kind: str, layers: int = 4):
    from transformers import GPTNeoXConfig, LlamaConfig

    if kind == "llama":
        return LlamaConfig(
            hidden_size=256,
            intermediate_size=688,
            num_hidden_layers=layers,
            num_attention_heads=8,
            num_key_value_heads=2,
            vocab_size=8192,
            max_position_embeddings=2048,
        )
    return GPTNeoXConfig(
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=layers,
        num_attention_heads=8,
        vocab_size=8192,
        max_position_embeddings=2048,
    )


SMALL = {
    "sft lora fp32": Workload("sft", Step.NEXT_TOKEN, dtype="float32", micro_batch=4, completion_len=256),
    "sft full fp32": Workload(
        "sft", Step.NEXT_TOKEN, dtype="float32", finetuning="full", micro_batch=2, completion_len=256
    ),
    "sft lora bf16 ckpt": Workload(
        "sft", Step.NEXT_TOKEN, dtype="bfloat16", gradient_checkpointing=True, micro_batch=4, completion_len=256
    ),
    "ppo lora fp32": Workload(
        "ppo",
        Step.PPO,
        dtype="float32",
        micro_batch=16,
        prompt_len=8,
        completion_len=16,
        gen_batch=32,
        nograd_batch=32,
        reference_pass=True,
        value_head=True,
    ),
    "grpo lora fp32 ckpt": Workload(
        "grpo",
        Step.GRPO,
        dtype="float32",
        gradient_checkpointing=True,
        micro_batch=4,
        prompt_len=64,
        completion_len=128,
        gen_batch=16,
        reference_pass=True,
    ),
}


def mib(n: float) -> str:
    return f"{n / 2**20:9.1f}"


def compare(name: str, config, w: Workload, device: str, base=None) -> None:
    plan = planner.plan(config, w, on_gpu=False)
    traced = planner.trace_full_depth(config, w)
    torch.manual_seed(0)
    measured = measure_step(build_trainable(config, w, device, base=base), w, device)
    for phase, real in measured.items():
        p, t = plan.phase_bytes[phase], traced[phase]
        print(f"{name:<28} {phase:<14} {mib(p)} {mib(t)} {mib(real)}   {p / real:6.3f} {t / real:6.3f}", flush=True)


def profile(stage: str, device: str) -> None:
    """A demo profile as the stage runs it: its own config, its base loaded by the stage's loader."""
    stage_ = stages.get(stage)
    configs = stage_.parse(["--config", str(ROOT / "configs" / "demo" / f"{stage}.yaml")])
    model_args = config_of(configs, ModelArguments)
    if stage_.reads is not None:  # PPO's merged model is a pipeline output; the demo LM has the same architecture
        model_args = dataclasses.replace(model_args, model_name_or_path="demo://lm")
    cache = config_of(configs, DemoArguments).demo_assets
    config = architecture(model_args.model_name_or_path, cache)
    w = stage_.memory.workload(configs, config.model_type, False, 1)
    resolved = resolve_model_path(model_args.model_name_or_path, cache)
    base = load_causal_lm(model_args, path=resolved, gradient_checkpointing=w.gradient_checkpointing)
    compare(f"demo {stage} ({w.quantization})", config, w, device, base=base)


REAL_PROFILES = [  # (profile, stage, architecture): too large to measure on a CPU, planned and traced
    ("neox20b-24gb", "sft", "EleutherAI/gpt-neox-20b"),
    ("neox20b-24gb", "ppo", "EleutherAI/gpt-neox-20b"),
    ("llama1b-16gb", "grpo", "meta-llama/Llama-3.2-1B-Instruct"),
]


def real_profile(name: str, stage: str, arch: str) -> None:
    configs = stages.get(stage).parse(["--config", str(ROOT / "configs" / name / f"{stage}.yaml")])
    config = architecture(arch)
    plan = planner.plan_stage(stages.get(stage), configs, config)
    traced = planner.trace_full_depth(config, plan.workload)
    for phase, t in traced.items():
        p = plan.phase_bytes[phase]
        print(
            f"{name + ' ' + stage:<28} {phase:<14} {mib(p)} {mib(t)} {'n/a':>9}   {'':6} {t / p:6.3f} (t/p)", flush=True
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--real_profiles", action="store_true", help="Also plan and trace the GPU profiles (minutes).")
    args = parser.parse_args()
    print(f"{'run':<28} {'phase':<14} {'planned':>9} {'traced':>9} {'measured':>9}   p/m    t/m   (MiB)")
    for stage in ["sft", "ppo", "grpo"]:
        profile(stage, args.device)
    if args.real_profiles:
        for name, stage, arch in REAL_PROFILES:
            real_profile(name, stage, arch)
    for kind in ["llama", "neox"]:
        for name, w in SMALL.items():
            compare(f"{kind} {name}", small(kind), w, args.device)


if __name__ == "__main__":
    main()
