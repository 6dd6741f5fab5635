"""Planned vs measured peak memory on a GPU: the one script to run the first time a GPU is lent.

    python bench/gpu_memory.py --out gpu_memory.json                 # on a GPU, under 8 minutes on a large one
    python bench/gpu_memory.py --tiny --device cpu --out cpu.json    # the same code with tiny models (tests)

For each row: the real architecture from a shipped config, random weights (nothing is downloaded),
saved and loaded back through the stage's own loader (bf16, or bitsandbytes 8-bit / 4-bit), LoRA and
the stage's optimizer; then one stage step (`fitrl.memtrace`: generation, the no-grad passes, two
accumulating training micro-steps) after a first optimizer step. Written per row: the plan's tensor
peak, the measured live tensor peak (the tracker), and on a GPU `torch.cuda.max_memory_allocated`
and `max_memory_reserved` over the step, and their ratios to the plan.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import tempfile
import time
from pathlib import Path

import torch

from fitrl import planner
from fitrl.architectures import architecture
from fitrl.memtrace import build_trainable, measure_step
from fitrl.modeling import GRPO_LORA_TARGETS, ModelArguments, load_causal_lm
from fitrl.workload import Workload


def workloads(tiny: bool) -> dict[str, Workload]:
    """The shipped profiles' shapes (the blog's PPO, the GSM8K GRPO recipe, 512-token SFT), or tiny ones."""
    scale = 8 if tiny else 1
    return {
        "sft": Workload("sft", gradient_checkpointing=True, micro_batch=1, completion_len=512 // scale),
        "ppo": Workload(
            "ppo",
            gradient_checkpointing=True,
            micro_batch=16,
            prompt_len=8,
            completion_len=16,
            gen_batch=16,
            nograd_batch=16,
            reference_pass=True,
            value_head=True,
        ),
        "grpo": Workload(
            "grpo",
            gradient_checkpointing=True,
            micro_batch=2,
            prompt_len=256 // scale,
            completion_len=786 // scale,
            gen_batch=8,
        ),
    }


STAGES = ("sft", "ppo", "grpo")
GPU_ROWS = [  # (model, stage, quantization, optimizer)
    ("Qwen/Qwen2.5-0.5B", "sft", "none", "adamw_8bit"),
    ("Qwen/Qwen2.5-0.5B", "ppo", "8bit", "adamw_8bit"),
    ("Qwen/Qwen2.5-0.5B", "grpo", "none", "paged_adamw_8bit"),
    ("meta-llama/Llama-3.2-1B", "grpo", "none", "paged_adamw_8bit"),
    ("meta-llama/Llama-3.2-1B", "grpo", "4bit", "paged_adamw_8bit"),
    ("meta-llama/Llama-3.2-1B", "ppo", "8bit", "adamw_8bit"),
    ("meta-llama/Llama-3.2-3B", "sft", "4bit", "adamw_8bit"),
]


def tiny_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=2048,
        max_position_embeddings=1024,
    )


def run_row(config, name: str, w: Workload, device: str, workdir: Path) -> dict:
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    on_gpu = device.startswith("cuda")
    w = dataclasses.replace(w, int8_keeps_input=on_gpu)  # on a CPU fitrl's own 8-bit product runs, which keeps no input
    plan = planner.plan(config, w, on_gpu=on_gpu)
    path = workdir / name.replace("/", "--")
    if not path.exists():  # random weights in the compute dtype, saved once per model
        with torch.device("cpu"):
            AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    args = ModelArguments(str(path), w.quantization, w.dtype if not w.quantized else "bfloat16")
    base = load_causal_lm(args, path=str(path), gradient_checkpointing=w.gradient_checkpointing)
    if not w.quantized:
        base = base.to(device)
    model = build_trainable(config, w, device, base=base)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    measured = measure_step(model, w, device)
    row = {
        "model": name,
        "stage": w.stage,
        "quantization": w.quantization,
        "optimizer": w.optimizer,
        "planned_tensor_peak_mb": round(plan.tensor_peak_bytes / 2**20, 1),
        "planned_peak_mb": round(plan.peak_bytes / 2**20, 1),
        "planned_phase_mb": {k: round(v / 2**20, 1) for k, v in plan.phase_bytes.items()},
        "measured_tensor_peak_mb": round(max(measured.values()) / 2**20, 1),
        "measured_phase_mb": {k: round(v / 2**20, 1) for k, v in measured.items()},
    }
    row["tracked_vs_planned"] = round(row["measured_tensor_peak_mb"] / row["planned_tensor_peak_mb"], 3)
    if device.startswith("cuda"):
        row["max_allocated_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        row["max_reserved_mb"] = round(torch.cuda.max_memory_reserved() / 2**20, 1)
        row["allocated_vs_planned"] = round(row["max_allocated_mb"] / row["planned_tensor_peak_mb"], 3)
        row["reserved_vs_planned_peak"] = round(row["max_reserved_mb"] / row["planned_peak_mb"], 3)
    row["seconds"] = round(time.perf_counter() - started, 1)
    del model, base
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write the rows to.")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="Tiny models and lengths: the CPU check of this script.")
    parser.add_argument("--stages", default="sft,ppo,grpo", help="Comma-separated stages whose rows to run.")
    args = parser.parse_args(argv)
    stages = args.stages.split(",")
    unknown = [s for s in stages if s not in STAGES]
    if unknown:  # a typo would otherwise run nothing and write an empty file
        parser.error(f"unknown stage(s) {', '.join(unknown)} in --stages; choose from {','.join(STAGES)}")
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    shapes = workloads(args.tiny)
    rows_spec = [("tiny-llama", s, q, o) for _, s, q, o in GPU_ROWS[:3]] if args.tiny else GPU_ROWS
    rows_spec = [row for row in rows_spec if row[1] in stages]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, stage, quantization, optimizer in rows_spec:
            config = tiny_config() if args.tiny else architecture(name)
            targets = (
                GRPO_LORA_TARGETS.get(config.model_type, ["all-linear"]) if stage == "grpo" else ["q_proj", "v_proj"]
            )  # noqa: E501
            w = dataclasses.replace(
                shapes[stage],
                quantization=quantization,
                dtype=dtype if quantization == "none" else "bfloat16",
                optimizer=optimizer,
                lora_targets=tuple(targets),
            )
            try:
                rows.append(run_row(config, name, w, args.device, Path(tmp)))
            except Exception as e:  # one failing row must not cost the others: record it and go on
                rows.append({"model": name, "stage": stage, "quantization": quantization, "error": repr(e)[:500]})
            print(json.dumps(rows[-1]), flush=True)
            Path(args.out).write_text(json.dumps({"device": args.device, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
