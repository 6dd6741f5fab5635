"""Benchmark: streaming vs in-memory LoRA merge on a model of a few hundred MB saved in many shards.

    python bench/merge_memory.py                 # ~300 MB fp32 GPT-NeoX in 25 MB shards
    python bench/merge_memory.py --hidden 1024 --layers 24 --shard-size 100MB

Each merge runs as its own process (scripts/merge.py), so the figures are what a user sees.
Prints peak RSS (absolute and above the process's start-of-merge level) and wall time for each.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--shard-size", default="25MB")
    args = parser.parse_args()

    from peft import LoraConfig, get_peft_model
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        config = GPTNeoXConfig(
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=12,
            intermediate_size=4 * args.hidden,
        )
        model = GPTNeoXForCausalLM(config)
        size_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        model.save_pretrained(tmp / "base", max_shard_size=args.shard_size)
        lora = LoraConfig(r=16, lora_alpha=32, target_modules=["query_key_value"], init_lora_weights=False)
        get_peft_model(model, lora).save_pretrained(tmp / "adapter")
        del model
        n_shards = len(list((tmp / "base").glob("*.safetensors")))
        print(f"base: {size_mb:.0f} MB fp32 in {n_shards} shards; torch {torch.__version__}")
        print(f"{'method':<11} {'peak RSS MB':>12} {'+ over start':>13} {'wall s':>8}")
        for method in ["streaming", "in_memory"]:
            out = tmp / method
            start = time.perf_counter()
            subprocess.run(
                [
                    sys.executable,
                    str(ROOT / "scripts" / "merge.py"),
                    "--adapter_dir",
                    str(tmp / "adapter"),
                    "--base_model",
                    str(tmp / "base"),
                    "--output_dir",
                    str(out),
                    "--dtype",
                    "float32",
                    "--method",
                    method,
                ],
                check=True,
                capture_output=True,
            )
            wall = time.perf_counter() - start
            info = json.loads((out / "run_info.json").read_text())
            print(f"{method:<11} {info['peak_rss_mb']:>12.0f} {info['peak_rss_increase_mb']:>13.0f} {wall:>8.1f}")


if __name__ == "__main__":
    main()
