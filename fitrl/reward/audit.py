"""The over-optimisation audit (Gao et al. 2022, "Scaling laws for reward model overoptimization"): the
proxy reward a run optimises and a gold reading it never trains on, against the square root of the KL
to the reference, and where the gold reading peaked.

Past some distance from the reference a proxy reward keeps rising while the gold reading turns down:
the policy has found what the proxy pays for and the task does not. PPO's gold reading is its second
judge (`guard_judge_model`) on held-out prompts, GRPO's its greedy accuracy on held-out problems, each
read at the start, every few steps and at the end (the reward-hacking guard's readings). trl logs a
KL only with `beta` > 0; without it the audit reads along the steps instead. The audit names the saved
policy nearest the gold reading's peak (a checkpoint, or the run's own output when the peak is at its
end) and the command that evaluates it, so the better policy stays one command away.

Each reading is set beside the batch its policy sampled next (a reading after step s: the first batch
logged after it, whose KL and mean reward that policy produced; past the last logged batch, the last).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fitrl.checkpoints import checkpoint_root, complete_checkpoints

DETAILS_KEY = "overoptimisation"  # where run_info.json holds the audit (`Audit.to_json`)
PLOT = "overoptimisation.png"


@dataclass(frozen=True)
class Reading:
    """One gold reading: after `step` updates, the policy's sqrt(KL) to the reference, its proxy reward
    and the gold score."""

    step: int
    sqrt_kl: float | None  # None: no KL logged (GRPO with beta 0)
    proxy: float
    gold: float


@dataclass(frozen=True)
class Audit:
    """The readings, the one where the gold score peaked, and the saved policy nearest it."""

    gold_name: str  # what the gold reading is, as the plot and the report name it
    readings: list[Reading]
    peak: Reading
    nearest_step: int
    nearest: str  # a checkpoint directory, or the run's output directory
    nearest_is_output: bool
    command: str  # evaluates `nearest`

    def to_json(self) -> dict[str, Any]:
        return {
            "gold_name": self.gold_name,
            "readings": [
                {
                    "step": r.step,
                    "sqrt_kl": None if r.sqrt_kl is None else round(r.sqrt_kl, 4),
                    "proxy": round(r.proxy, 4),
                    "gold": round(r.gold, 4),
                }
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


def _logged(rows: Sequence[dict[str, Any]], keys: Sequence[str]) -> list[dict[str, Any]]:
    """The rows that hold a number under every key, by step."""
    found = [r for r in rows if all(isinstance(r.get(k), (int, float)) for k in ["step", *keys])]
    return sorted(found, key=lambda r: r["step"])


def readings(rows: Sequence[dict[str, Any]], gold: Sequence[tuple[int, float]], proxy_key: str,
             kl_key: str | None) -> list[Reading]:  # fmt: skip
    """Each gold reading `(step, score)` beside the KL (`kl_key`; None: not logged) and the proxy reward of
    the first batch logged after it (past the last, the last)."""
    logged = _logged(rows, [proxy_key, *([kl_key] if kl_key else [])])
    if not logged:
        return []
    found = []
    for step, score in gold:
        row = next((r for r in logged if r["step"] > step), logged[-1])
        sqrt_kl = _sqrt_kl(row[kl_key]) if kl_key else None
        found.append(Reading(step, sqrt_kl, float(row[proxy_key]), score))
    return found


def saved_policies(output_dir: str, prefix: str, save_steps: int, final_step: int) -> dict[int, str]:
    """This run's complete checkpoints (`<prefix>-N` every `save_steps`, up to `final_step`; an earlier run's
    beside them are left out), by step, named from `output_dir` as the user gave it."""
    given = Path(output_dir)
    shown = given.with_name(given.name + ".checkpoints")
    found = complete_checkpoints(checkpoint_root(output_dir), prefix)
    return {n: str(shown / p.name) for n, p in found.items() if save_steps and n % save_steps == 0 and n <= final_step}


def peak_eval_dir(output_dir: str) -> str:
    """Where the evaluation the audit's command runs writes: beside the run's output."""
    given = Path(output_dir)
    return str(given.with_name(given.name + "_peak_eval"))


def nearest_saved(peak_step: int, saved: dict[int, str], final_step: int, output_dir: str) -> tuple[int, str]:
    """The saved policy nearest `peak_step`: a checkpoint in `saved` (step: directory), or the run's output
    (`final_step`); at equal distance the earlier, the one read less far along."""
    candidates = {**saved, final_step: output_dir}
    step = min(candidates, key=lambda s: (abs(s - peak_step), s))
    return step, candidates[step]


def audit(gold_name: str, found: list[Reading], saved: dict[int, str], final_step: int, output_dir: str,
          evaluate: str) -> Audit | None:  # fmt: skip
    """The audit of `found` (None with fewer than two readings); `evaluate` is the evaluation command,
    given the directory to read as `{adapter_dir}`."""
    if len(found) < 2:
        return None
    peak = max(found, key=lambda r: (r.gold, -r.step))  # the earliest of equal peaks: the least KL spent
    step, directory = nearest_saved(peak.step, saved, final_step, output_dir)
    command = evaluate.format(adapter_dir=directory)
    return Audit(gold_name, found, peak, step, directory, directory == output_dir, command)


def plot(result: Audit, rows: Sequence[dict[str, Any]], proxy_key: str, kl_key: str | None, path: Path) -> None:
    """The proxy reward at every logged step and the gold readings against sqrt(KL) (without a KL: the
    step), the peak marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    logged = _logged(rows, [proxy_key, *([kl_key] if kl_key else [])])
    at = (lambda r: _sqrt_kl(r[kl_key])) if kl_key else (lambda r: r["step"])
    gold_at = [r.sqrt_kl if kl_key else r.step for r in result.readings]
    fig, proxy_ax = plt.subplots(figsize=(6.5, 4))
    proxy_ax.plot([at(r) for r in logged], [r[proxy_key] for r in logged], ".", color="tab:blue", alpha=0.5,
                  label="proxy reward (each logged step)")  # fmt: skip
    proxy_ax.set_xlabel("sqrt(KL to the reference), nats^0.5" if kl_key else "step (no KL logged)")
    proxy_ax.set_ylabel("proxy reward", color="tab:blue")
    gold_ax = proxy_ax.twinx()
    gold_ax.plot(gold_at, [r.gold for r in result.readings], "o-", color="tab:red", label=result.gold_name)
    for x, r in zip(gold_at, result.readings):
        gold_ax.annotate(f"step {r.step}", (x, r.gold), textcoords="offset points", xytext=(4, 4), fontsize=7)
    gold_ax.axvline(gold_at[result.readings.index(result.peak)], color="tab:red", linestyle=":", linewidth=1)
    gold_ax.set_ylabel(result.gold_name, color="tab:red")
    proxy_ax.set_title(f"Over-optimisation audit: {result.gold_name} peaked at step {result.peak.step}", fontsize=10)
    handles = [h for ax in (proxy_ax, gold_ax) for h in ax.get_legend_handles_labels()[0]]
    labels = [h.get_label() for h in handles]
    proxy_ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2, fontsize=8)
    fig.savefig(path, dpi=110, bbox_inches="tight")  # the legend sits below the axes, clear of the points
    plt.close(fig)


def figures(details: dict[str, Any]) -> list[str]:
    """The report's line for the audit a stage recorded in `run_info.json`'s details (none: [])."""
    found = details.get(DETAILS_KEY)
    if not found:
        return []
    last = found["readings"][-1]
    peak = next(r for r in found["readings"] if r["step"] == found["peak_step"])

    def at(r: dict[str, Any]) -> str:
        return "" if r["sqrt_kl"] is None else f" at sqrt KL {r['sqrt_kl']:.2f}"

    where = "the run's own output" if found["nearest_is_output"] else f"the checkpoint of step {found['nearest_step']}"
    if peak["step"] == 0:  # no update raised it: no saved policy is nearer the peak than the reference itself
        return [
            f"over-optimisation audit: the {found['gold_name']} never rose above its first reading "
            f"({peak['gold']:.3g}, before any update); {last['gold']:.3g} at step {last['step']}{at(last)}"
        ]
    if peak is last:
        return [
            f"over-optimisation audit: the {found['gold_name']} peaked at its last reading, step {peak['step']} "
            f"({peak['gold']:.3g}{at(peak)}): the run's own output `{found['nearest']}` is the policy to keep"
        ]
    return [
        f"over-optimisation audit: the {found['gold_name']} peaked at step {peak['step']} "
        f"({peak['gold']:.3g}{at(peak)}), {last['gold']:.3g} at step {last['step']}{at(last)}; the saved policy "
        f"nearest the peak, {where}: "
        f"`{found['nearest']}`; evaluate it: `{found['command']}`"
    ]
