"""Benchmark: fitrl's PPO step beside TRL 0.11.4's `PPOTrainer`, the trainer the 20B blog used.

    make bench-peer-env                 # once: TRL 0.11.4 + transformers 4.47 into .venv-trl011
    python bench/ppo_vs_trl011.py       # fp32 and 8-bit base, 2 runs of each side, in turn (A B A B)
    python bench/ppo_vs_trl011.py --quantization 8bit --runs 3 --steps 10 --json bench/results/ppo_vs_trl011_cpu.json
    python bench/ppo_vs_trl011.py --policy_from_generation false   # flags it does not know go to fitrl's script

Both sides train the same model (a seeded random GPT-NeoX, 6 layers x 512, about 20M parameters, the
demo tokenizer) with LoRA r=16 on `query_key_value`, on 6-token prefixes of the demo reviews, 12
generated tokens of the policy's own distribution (top_k 0, top_p 1), 32 prompts a step, mini-batch 8,
4 PPO epochs, the demo sentiment classifier as reward. Both generate in batches of
`--generation_batch_size` (default: the whole batch; TRL's example scripts use 4, its 20B script one
prompt at a time) and run the no-grad pass in batches of the mini-batch size (TRL's fixed choice);
everything else is each side's default.

Per step: the median over steps 3..N (step 2 runs under the live-tensor tracker, step 1 warms up),
of generate, the no-grad pass (old and reference log-probs, values, rewards, advantages) and optimise;
scoring by the classifier is left out of both. Memory: the peak of live tensor bytes of step 2
(weights, optimizer states and everything the step allocates; fitrl's tracker on both sides) and
the process's peak RSS. Each side runs in its own process and virtual environment, with the same
number of threads.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEER_PYTHON = ROOT / ".venv-trl011" / "bin" / "python"
PHASES = ["generate", "forward", "optimise"]
FITRL_PHASES = {"generate": "time/generate", "forward": "time/forward", "optimise": "time/optimise"}


def build_model(path: Path, demo: Path, seed: int) -> int:
    """A seeded random GPT-NeoX with the demo tokenizer; returns its parameter count."""
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(
        vocab_size=1024,
        hidden_size=512,
        num_hidden_layers=6,
        num_attention_heads=8,
        intermediate_size=2048,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = GPTNeoXForCausalLM(config)
    model.save_pretrained(path)
    for name in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(demo / "lm" / name, path / name)
    return sum(p.numel() for p in model.parameters())


def fitrl_argv(args: argparse.Namespace, model: Path, quantization: str, work: Path) -> list[str]:
    """`ppo.py`'s arguments for the benchmark's settings, writing to `work/fitrl`."""
    return [
        *("--model_name_or_path", str(model), "--quantization", quantization, "--dtype", "float32"),
        *("--lora_r", "16", "--lora_alpha", "32", "--lora_dropout", "0.05"),
        *("--lora_target_modules", "query_key_value"),
        *("--dataset", "demo://reviews", "--reward_model", "demo://classifier", "--prompt_shaping", "prefix"),
        *("--min_prompt_chars", "200"),
        *("--query_min_tokens", str(args.query_tokens), "--query_max_tokens", str(args.query_tokens)),
        *("--response_min_tokens", str(args.response_tokens), "--response_max_tokens", str(args.response_tokens)),
        *("--steps", str(args.steps), "--batch_size", str(args.batch_size)),
        *("--mini_batch_size", str(args.mini_batch_size), "--ppo_epochs", str(args.ppo_epochs)),
        *("--forward_batch_size", str(args.mini_batch_size), "--generation_batch_size", str(gen_batch(args))),
        *("--learning_rate", "1.41e-5", "--seed", str(args.seed)),
        *("--output_dir", str(work / "fitrl"), "--overwrite_output_dir", "true", "--report_to", "none"),
        *("--save_steps", "0", *args.fitrl_args),
    ]


def run_fitrl(args: argparse.Namespace, model: Path, quantization: str, work: Path) -> dict:
    out = work / "fitrl"
    cmd = [sys.executable, str(ROOT / "scripts" / "ppo.py"), *fitrl_argv(args, model, quantization, work)]
    run_quietly(cmd, args.threads)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    memory = json.loads((out / "run_info.json").read_text())["memory"]
    steps = [{p: r[FITRL_PHASES[p]] for p in PHASES} | {"score": r["time/score"]} for r in rows]
    for s in steps:
        s["step"] = sum(s[p] for p in PHASES)
    return {"rows": steps, "peak_tensor_mb": memory["measured_peak_mb"], "peak_rss_mb": memory["peak_rss_mb"]}


def run_peer(args: argparse.Namespace, model: Path, demo: Path, quantization: str) -> dict:
    cmd = [
        str(PEER_PYTHON),
        str(ROOT / "bench" / "trl011" / "run_peer.py"),
        *("--model", str(model), "--classifier", str(demo / "classifier")),
        *("--reviews", str(demo / "reviews" / "train.jsonl"), "--quantization", quantization),
        *("--steps", str(args.steps), "--batch_size", str(args.batch_size)),
        *("--mini_batch_size", str(args.mini_batch_size), "--ppo_epochs", str(args.ppo_epochs)),
        *("--generation_batch_size", str(gen_batch(args))),
        *("--query_tokens", str(args.query_tokens), "--response_tokens", str(args.response_tokens)),
        *("--lora_r", "16", "--lora_alpha", "32", "--lora_dropout", "0.05", "--learning_rate", "1.41e-5"),
        *("--seed", str(args.seed), "--threads", str(args.threads)),
    ]
    return json.loads(run_quietly(cmd, args.threads).strip().splitlines()[-1])


def run_quietly(cmd: list[str], threads: int) -> str:
    """Run a side; on failure show the end of what it printed and stop."""
    done = subprocess.run(cmd, capture_output=True, text=True, env=thread_env(threads))
    if done.returncode != 0:
        sys.exit(f"{done.stderr[-3000:]}\nerror: `{' '.join(cmd[:2])} ...` failed with exit status {done.returncode}")
    return done.stdout


def gen_batch(args: argparse.Namespace) -> int:
    return args.generation_batch_size or args.batch_size


def thread_env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def medians(runs: list[dict]) -> dict[str, float]:
    """Per phase, the median over every run's steps 3..N."""
    later = [row for run in runs for row in run["rows"][2:]]
    return {k: statistics.median(r[k] for r in later) for k in [*PHASES, "step"]}


def report(quantization: str, ours: list[dict], peer: list[dict]) -> dict:
    a, b = medians(ours), medians(peer)
    print(f"\n== {quantization}: per step, median of steps 3..N over {len(ours)} runs each ==")
    print(f"{'':<22} {'fitrl':>9} {'TRL 0.11.4':>11} {'ratio':>7}")
    for k in [*PHASES, "step"]:
        print(f"{k + ' s':<22} {a[k]:>9.3f} {b[k]:>11.3f} {a[k] / b[k]:>7.2f}")
    out = {"time_s": {"fitrl": a, "trl": b}, "ratio": {k: a[k] / b[k] for k in a}}
    for key, label in [("peak_tensor_mb", "peak tensor MiB"), ("peak_rss_mb", "peak RSS MiB")]:
        x, y = max(r[key] for r in ours), max(r[key] for r in peer)
        print(f"{label:<22} {x:>9.1f} {y:>11.1f} {x / y:>7.2f}")
        out[key] = {"fitrl": x, "trl": y, "ratio": x / y}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantization", choices=["none", "8bit", "both"], default="both")
    parser.add_argument("--runs", type=int, default=2, help="Runs of each side, alternated.")
    parser.add_argument("--steps", type=int, default=8, help="PPO steps per run (at least 3).")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--mini_batch_size", type=int, default=8)
    parser.add_argument("--ppo_epochs", type=int, default=4)
    parser.add_argument("--generation_batch_size", type=int, help="Prompts per generate call (default: the batch).")
    parser.add_argument("--query_tokens", type=int, default=6)
    parser.add_argument("--response_tokens", type=int, default=12)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="Also write the figures here.")
    args, args.fitrl_args = parser.parse_known_args()
    if not PEER_PYTHON.exists():
        sys.exit(f"error: no TRL 0.11.4 environment at {PEER_PYTHON.parent.parent}; run `make bench-peer-env` first")
    if args.steps < 3:
        sys.exit("error: --steps must be at least 3 (step 1 warms up, step 2 is traced)")

    from fitrl.demo import SHIPPED as demo

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        n_params = build_model(work / "model", demo, args.seed)
        print(f"model: GPT-NeoX 6x512, {n_params / 1e6:.1f}M parameters; {args.threads} threads")
        modes = ["none", "8bit"] if args.quantization == "both" else [args.quantization]
        for quantization in modes:
            ours, peer = [], []
            for i in range(args.runs):
                print(f"{quantization}: run {i + 1}/{args.runs} fitrl ...", flush=True)
                ours.append(run_fitrl(args, work / "model", quantization, work))
                print(f"{quantization}: run {i + 1}/{args.runs} TRL 0.11.4 ...", flush=True)
                peer.append(run_peer(args, work / "model", demo, quantization))
            results[quantization] = report(quantization, ours, peer) | {"runs": {"fitrl": ours, "trl": peer}}
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
