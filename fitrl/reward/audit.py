"""The over-optimisation audit (Gao et al. 2022, "Scaling laws for reward model overoptimization"): the
proxy reward a run optimises and a gold reading it never trains on, against the square root of the KL
to the reference, and where the gold reading peaked.

Past some distance from the reference a proxy reward keeps rising while the gold reading turns down:
the policy has found what the proxy pays for and the task does not. PPO's gold reading is its second
judge (`guard_judge_model`) on held-out prompts, read every `guard_judge_every` steps. The audit names
the saved policy nearest the judge's peak (a checkpoint `step-N`, or the run's own output when the peak
is at its end) and the command that evaluates it, so the better policy stays one command away.

Each reading is set beside the batch its policy sampled next (a reading after step s: step s + 1's
batch, whose KL and mean reward that policy produced; the last reading: the last batch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DETAILS_KEY = "overoptimisation"  # where run_info.json holds the audit (`Audit.to_json`)
PLOT = "overoptimisation.png"


@dataclass(frozen=True)
class Reading:
    """One gold reading: after `step` updates, the policy's sqrt(KL) to the reference, its proxy reward
    and the gold score."""

    step: int
    sqrt_kl: float
    proxy: float
    gold: float


@dataclass(frozen=True)
class Audit:
    """The readings, the one where the gold score peaked, and the saved policy nearest it."""

    readings: list[Reading]
    peak: Reading
    nearest_step: int
    nearest: str  # a checkpoint directory, or the run's output directory
    nearest_is_output: bool
    command: str  # evaluates `nearest`

    def to_json(self) -> dict[str, Any]:
        return {
            "readings": [
                {"step": r.step, "sqrt_kl": round(r.sqrt_kl, 4), "proxy": round(r.proxy, 4), "gold": round(r.gold, 4)}
                for r in self.readings
            ],
            "peak_step": self.peak.step,
            "peak_gold": round(self.peak.gold, 4),
            "final_gold": round(self.readings[-1].gold, 4),
            "nearest_step": self.nearest_step,
            "nearest": self.nearest,
            "nearest_is_output": self.nearest_is_output,
            "command": self.command,
        }


def _sqrt_kl(kl: float) -> float:
    return math.sqrt(max(kl, 0.0))  # PPO's sampled KL estimate can dip below 0 near the reference


def readings(rows: Sequence[dict[str, Any]], gold: Sequence[tuple[int, float]], proxy_key: str,
             kl_key: str) -> list[Reading]:  # fmt: skip
    """Each gold reading `(step, score)` beside the KL and proxy reward of the batch its policy sampled next."""
    by_step = {int(r["step"]): r for r in rows if isinstance(r.get(kl_key), (int, float))}
    if not by_step:
        return []
    last = max(by_step)
    found = []
    for step, score in gold:
        row = by_step.get(min(step + 1, last))
        if row is not None:
            found.append(Reading(step, _sqrt_kl(row[kl_key]), float(row[proxy_key]), score))
    return found


def nearest_saved(peak_step: int, saved: dict[int, str], final_step: int, output_dir: str) -> tuple[int, str]:
    """The saved policy nearest `peak_step`: a checkpoint in `saved` (step: directory), or the run's output
    (`final_step`); at equal distance the earlier, the one the judge read less far along."""
    candidates = {**saved, final_step: output_dir}
    step = min(candidates, key=lambda s: (abs(s - peak_step), s))
    return step, candidates[step]


def audit(found: list[Reading], saved: dict[int, str], final_step: int, output_dir: str,
          evaluate: str) -> Audit | None:  # fmt: skip
    """The audit of `found` (None with fewer than two readings); `evaluate` is the evaluation command,
    given the directory to read as `{adapter_dir}`."""
    if len(found) < 2:
        return None
    peak = max(found, key=lambda r: (r.gold, -r.step))  # the earliest of equal peaks: the least KL spent
    step, directory = nearest_saved(peak.step, saved, final_step, output_dir)
    return Audit(found, peak, step, directory, directory == output_dir, evaluate.format(adapter_dir=directory))


def plot(result: Audit, rows: Sequence[dict[str, Any]], proxy_key: str, kl_key: str, gold_name: str,
         path: Path) -> None:  # fmt: skip
    """The proxy reward at every step and the gold readings against sqrt(KL), the peak marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in rows if isinstance(r.get(kl_key), (int, float)) and isinstance(r.get(proxy_key), (int, float))]
    fig, proxy_ax = plt.subplots(figsize=(6.5, 4))
    proxy_ax.plot([_sqrt_kl(r[kl_key]) for r in steps], [r[proxy_key] for r in steps], ".", color="tab:blue",
                  alpha=0.5, label="proxy reward (each step)")  # fmt: skip
    proxy_ax.set_xlabel("sqrt(KL to the reference), nats^0.5")
    proxy_ax.set_ylabel("proxy reward", color="tab:blue")
    gold_ax = proxy_ax.twinx()
    gold_ax.plot([r.sqrt_kl for r in result.readings], [r.gold for r in result.readings], "o-", color="tab:red",
                 label=gold_name)  # fmt: skip
    for r in result.readings:
        gold_ax.annotate(f"step {r.step}", (r.sqrt_kl, r.gold), textcoords="offset points", xytext=(4, 4), fontsize=7)
    gold_ax.axvline(result.peak.sqrt_kl, color="tab:red", linestyle=":", linewidth=1)
    gold_ax.set_ylabel(gold_name, color="tab:red")
    proxy_ax.set_title(f"Over-optimisation audit: the judge peaked at step {result.peak.step}")
    handles = [h for ax in (proxy_ax, gold_ax) for h in ax.get_legend_handles_labels()[0]]
    proxy_ax.legend(handles, [h.get_label() for h in handles], loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def figures(details: dict[str, Any]) -> list[str]:
    """The report's line for the audit a stage recorded in `run_info.json`'s details (none: [])."""
    found = details.get(DETAILS_KEY)
    if not found:
        return []
    last = found["readings"][-1]
    peak = next(r for r in found["readings"] if r["step"] == found["peak_step"])
    where = "the run's own output" if found["nearest_is_output"] else f"the checkpoint of step {found['nearest_step']}"
    return [
        f"over-optimisation audit: the judge peaked at step {peak['step']} ({peak['gold']:.3g} at sqrt KL "
        f"{peak['sqrt_kl']:.2f}), {last['gold']:.3g} at step {last['step']} (sqrt KL {last['sqrt_kl']:.2f}); "
        f"the saved policy nearest the peak, {where}: `{found['nearest']}`; evaluate it: `{found['command']}`"
    ]
