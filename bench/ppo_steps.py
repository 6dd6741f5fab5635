"""Benchmark: run N PPO steps on a config and print the step time split by phase and peak memory.

    python bench/ppo_steps.py --config configs/demo/ppo.yaml --steps 5
    python bench/ppo_steps.py --config configs/neox20b-24gb/ppo.yaml --steps 3   # on the GPU

Extra flags go to scripts/ppo.py (e.g. --batch_size 64). Runs it as a user would, into a
temporary directory, then reads its metrics.jsonl. The first step includes warm-up and is reported apart.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ["time/generate", "time/score", "time/forward", "time/optimise"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", type=int, default=5)
    args, extra = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ppo"
        cmd = [
            sys.executable,
            str(ROOT / "scripts" / "ppo.py"),
            "--config",
            args.config,
            "--steps",
            str(args.steps),
            "--output_dir",
            str(out),
            "--report_to",
            "none",
            "--save_steps",
            "0",
            *extra,
        ]
        subprocess.run(cmd, check=True, capture_output=True)
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        info = json.loads((out / "run_info.json").read_text())
    steady = rows[1:] or rows
    print(f"{args.config}: {len(rows)} steps, world size {info['world_size']}")
    print(f"{'phase':<16} {'first step s':>13} {'mean later s':>13}")
    for phase in PHASES:
        print(f"{phase:<16} {rows[0][phase]:>13.3f} {sum(r[phase] for r in steady) / len(steady):>13.3f}")
    total = sum(sum(r[p] for p in PHASES) for r in steady) / len(steady)
    print(f"{'step total':<16} {sum(rows[0][p] for p in PHASES):>13.3f} {total:>13.3f}")
    print(f"tokens/s (later steps): {sum(r['tokens_per_second'] for r in steady) / len(steady):.1f}")
    gpu = [r["memory/gpu_peak_mb"] for r in rows if r.get("memory/gpu_peak_mb") is not None]
    print(f"peak GPU memory: {max(gpu):.0f} MB" if gpu else "peak GPU memory: n/a (CPU run)")
    memory = info.get("memory") or {}
    if memory:
        print(
            f"tensor peak of one step: planned {memory.get('planned_peak_mb')} MiB, measured "
            f"{memory.get('measured_peak_mb')} MiB ({memory.get('device')}); peak RSS {memory.get('peak_rss_mb')} MiB"
        )


if __name__ == "__main__":
    main()
