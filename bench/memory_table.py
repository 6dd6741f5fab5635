"""What fits your card: the planner's peak for SFT, PPO and GRPO across model sizes and precisions.

    python bench/memory_table.py            # print the markdown tables (a few minutes on 2 cores)
    python bench/memory_table.py --write    # and replace them in docs/memory.md, between the markers
    python bench/memory_table.py --models Qwen/Qwen2.5-0.5B --stages sft   # a subset

Every number is planned (`fitrl.planner`: exact static bytes, depth-extrapolated meta traces), not
measured; rows measured on a GPU are added when a GPU run gives them (`bench/gpu_check.py`).
Shapes: SFT packs 512-token blocks, micro-batch 1, checkpointing; PPO uses the blog's (256 prompts
per step, queries up to 8 and responses up to 16 tokens, mini-batch 16, no-grad batch 16); GRPO the
GSM8K recipe's (prompts up to 256 tokens, 786 completion tokens, 2 completions per pass, checkpointing,
generation batch max(8, generations)). LoRA: r=16, the stage's default targets, 8-bit AdamW; full
fine-tuning: bf16 weights, AdamW states in bf16, all trained.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from fitrl import planner, stages
from fitrl.architectures import architecture

ROOT = Path(__file__).resolve().parents[1]
MODELS = [
    "Qwen/Qwen2.5-0.5B",
    "meta-llama/Llama-3.2-1B",
    "meta-llama/Llama-3.2-3B",
    "meta-llama/Llama-3.1-8B",
    "Qwen/Qwen2.5-14B",
    "EleutherAI/gpt-neox-20b",
]
MODES = {  # name -> (finetuning, quantization, dtype)
    "full bf16": ("full", "none", "bfloat16"),
    "LoRA bf16": ("lora", "none", "bfloat16"),
    "LoRA 8-bit": ("lora", "8bit", "float16"),
    "LoRA 4-bit": ("lora", "4bit", "bfloat16"),
}
CARDS_GB = [16, 24, 48, 80]
BEGIN, END = "<!-- memory-table:begin -->", "<!-- memory-table:end -->"


def settings(stage: str, mode: str, generations: int = 4) -> dict:
    finetuning, quantization, dtype = MODES[mode]
    common = {"quantization": quantization, "dtype": dtype, "lora_r": 16, "gradient_checkpointing": True}
    eight_bit = finetuning == "lora"
    if stage == "sft":
        optim = "adamw_bnb_8bit" if eight_bit else "adamw_torch"
        return {**common, "optim": optim, "per_device_train_batch_size": 1, "block_size": 512}
    if stage == "ppo":
        return {
            **common,
            "reward_model": "",  # the policy's own memory: the reward model is a choice of its own
            "optimizer": "adamw_8bit" if eight_bit else "adamw",
            "mini_batch_size": 16,
            "gradient_accumulation_steps": 1,
            "prompt_shaping": "prefix",
            "query_max_tokens": 8,
            "response_max_tokens": 16,
            "forward_batch_size": 16,
            "batch_size": 256,
        }
    return {
        **common,
        "optim": "paged_adamw_8bit" if eight_bit else "adamw_torch",
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 4,
        "generation_batch_size": max(8, generations),
        "num_generations": generations,
        "max_prompt_length": 256,
        "max_completion_length": 786,
        "beta": 0.0,
    }


def cell(peak: int) -> str:
    fits = "".join("✓" if peak <= gb * planner.GiB else "·" for gb in CARDS_GB)
    return f"{peak / planner.GiB:.1f} {fits}"


def table(stage: str, models: list[str], generations: int = 4) -> str:
    grpo = f"GRPO, {generations} generations, {max(8, generations)} completions generated at once"
    title = {"sft": "SFT, 512-token blocks", "ppo": "PPO, the blog's shapes", "grpo": grpo}[stage]
    lines = [f"**{title}**", "", "| model | " + " | ".join(MODES) + " |", "|---|" + "---|" * len(MODES)]
    for name in models:
        config = architecture(name)
        row = []
        for mode in MODES:
            finetuning = MODES[mode][0]
            flags = [
                f"--{k}={str(v).lower() if isinstance(v, bool) else v}"
                for k, v in settings(stage, mode, generations).items()
            ]
            configs = stages.get(stage).parse(["--model_name_or_path", name, *flags])
            p = planner.plan_stage(stages.get(stage), configs, config, finetuning=finetuning)
            row.append(cell(p.peak_bytes))
        lines.append(f"| {name.split('/')[-1]} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--stages", nargs="+", default=["grpo", "ppo", "sft"], choices=["sft", "ppo", "grpo"])
    parser.add_argument("--write", action="store_true", help="Replace the tables in docs/memory.md.")
    args = parser.parse_args(argv)
    parts = [
        "Planned peak GiB per GPU, then whether it fits 16 / 24 / 48 / 80 GiB (✓ fits, · does not). "
        "Planned, not measured: regenerate with `python bench/memory_table.py --write`. "
        "With 8 generations GRPO plans as with 4 (the generation batch is 8 either way)."
    ]
    for stage in args.stages:
        for generations in [4, 16] if stage == "grpo" else [0]:
            parts.append(table(stage, args.models, generations))
            print(parts[-1] + "\n", flush=True)
    if args.write:
        readme = (ROOT / "docs" / "memory.md").read_text()
        body = "\n\n".join(parts)
        new, n = re.subn(f"{re.escape(BEGIN)}.*?{re.escape(END)}", f"{BEGIN}\n{body}\n{END}", readme, flags=re.S)
        if n != 1:
            sys.exit(f"docs/memory.md has no {BEGIN} ... {END} block to replace")
        (ROOT / "docs" / "memory.md").write_text(new)


if __name__ == "__main__":
    main()
