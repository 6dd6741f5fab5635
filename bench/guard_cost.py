"""What the guards cost: the seconds of their own work in each training stage of a pipeline run
(`run_info.json`'s `guard_seconds`, timed as the stage runs: the held-out readings of the reward-hacking
guard, the tokenizer round trip, the gradient and reference checks, the monitors, the repetition
measure) against the stage's wall time (the pipeline's `logs/timings.json`). Target: at most 3%.

    bash pipeline.sh                       # the demo, whole, into outputs/demo
    python bench/guard_cost.py             # or --run_dir <a pipeline run directory>

Writes the table to `--out` (JSON) as well; a stage above `--max_share` makes the exit code 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fitrl import report, stages
from fitrl.artifacts import RunInfo

ROOT = Path(__file__).resolve().parents[1]


def costs(run_dir: Path) -> list[dict]:
    timings = report.read_timings(run_dir)
    rows = []
    for stage in stages.STAGES:
        out = run_dir / stage.output_dir
        info = RunInfo.read(out)
        if not stage.training or info is None or info.guard_seconds is None or stage.name not in timings:
            continue
        wall, spent = timings[stage.name], info.guard_seconds
        rows.append({"stage": stage.name, "wall_s": wall, "guard_s": spent, "share": spent / wall})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run_dir", type=Path, default=ROOT / "outputs" / "demo")
    parser.add_argument("--max_share", type=float, default=0.03)
    parser.add_argument("--out", type=Path, default=None, help="Also write the rows here (JSON).")
    args = parser.parse_args()
    rows = costs(args.run_dir)
    if not rows:
        sys.exit(f"error: no training stage in {args.run_dir} recorded guard_seconds; run the pipeline there first")
    print(f"{'stage':<8} {'wall s':>8} {'guards s':>9} {'share':>7}")
    for r in rows:
        flag = "" if r["share"] <= args.max_share else f"  above {args.max_share:.0%}"
        print(f"{r['stage']:<8} {r['wall_s']:8.1f} {r['guard_s']:9.2f} {r['share']:7.2%}{flag}")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    sys.exit(1 if any(r["share"] > args.max_share for r in rows) else 0)


if __name__ == "__main__":
    main()
