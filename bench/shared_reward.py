"""What sharing the backbone saves: PPO against the rm stage's reward model as a second adapter on the
policy's own backbone (`reward_adapter_shared: true`, the default) and as a model of its own beside the
policy (`false`), both measured: the tensor peak of a step (`run_info.json` memory, what the planner
plans; on a GPU `max_memory_allocated`), the process's peak RSS on a CPU, the plan, and seconds per step.

    bash pipeline.sh                          # the demo, whole, into outputs/demo (its merged model and rm)
    python bench/shared_reward.py             # or --run_dir <a pipeline run directory>

Writes the rows to `--out` (JSON) as well.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from fitrl.artifacts import RunInfo
from fitrl.outputs import read_jsonl

ROOT = Path(__file__).resolve().parents[1]


def measure(run_dir: Path, shared: bool, steps: int, work: Path) -> dict:
    out = work / ("shared" if shared else "separate")
    cmd = [
        sys.executable, str(ROOT / "scripts" / "ppo.py"), "--config", str(ROOT / "configs/demo/ppo.yaml"),
        "--model_name_or_path", str(run_dir / "merged"), "--reward_adapter", str(run_dir / "rm"),
        "--reward_adapter_shared", str(shared).lower(), "--steps", str(steps), "--guard_judge_model", "",
        "--output_dir", str(out),
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"error: PPO with reward_adapter_shared {shared} failed: {result.stderr.strip().splitlines()[-1]}")
    memory = RunInfo.read(out).memory
    seconds = [sum(v for k, v in r.items() if k.startswith("time/")) for r in read_jsonl(out / "metrics.jsonl")[1:]]
    return {
        "reward_adapter_shared": shared,
        "device": memory.device,
        "planned_peak_mb": memory.planned_peak_mb,
        "measured_peak_mb": memory.measured_peak_mb,
        "peak_rss_mb": memory.peak_rss_mb,
        "seconds_per_step": round(sum(seconds) / len(seconds), 2) if seconds else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run_dir", type=Path, default=ROOT / "outputs" / "demo")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None, help="Also write the rows here (JSON).")
    args = parser.parse_args()
    if not (args.run_dir / "rm" / "adapter_config.json").is_file() or not (args.run_dir / "merged").is_dir():
        sys.exit(f"error: {args.run_dir} has no merged model and rm output; run the pipeline there first")
    with tempfile.TemporaryDirectory() as work:
        rows = [measure(args.run_dir, shared, args.steps, Path(work)) for shared in (True, False)]
    print(f"{'reward model':<22} {'planned MiB':>12} {'measured MiB':>13} {'peak RSS MiB':>13} {'s/step':>7}")
    for r in rows:
        what = "shared backbone" if r["reward_adapter_shared"] else "its own copy"
        print(f"{what:<22} {r['planned_peak_mb']:12.1f} {r['measured_peak_mb']:13.1f} "
              f"{r['peak_rss_mb'] or 0:13.1f} {r['seconds_per_step'] or 0:7.2f}")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
