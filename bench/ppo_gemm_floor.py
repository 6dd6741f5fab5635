"""Benchmark: how much of fitrl's PPO step is matrix products, at `bench/ppo_vs_trl011.py`'s shapes.

    python bench/ppo_gemm_floor.py                          # fp32, after `python bench/ppo_vs_trl011.py --json ...`
    python bench/ppo_gemm_floor.py --quantization 8bit --peer bench/results/ppo_vs_trl011_cpu.json

Runs fitrl's `ppo.py` in this process (as Python runs a script) on the benchmark's model
and settings, and profiles one step after the warm-up (step 3) phase by phase with `torch.profiler`,
through the package functions each phase calls (sampling, `fitrl.ppo.step`): each phase's wall
time (the profiler's overhead included) and the time its matrix products (`addmm`, `mm`, `bmm`,
`baddbmm`) take on their own. Those products are what the step must compute (sampling with a KV
cache, one no-grad reference pass, a forward and a backward per mini-batch), and TRL 0.11.4
computes them too, at least. With `--peer`, a results file of `ppo_vs_trl011.py`, it prints them as
a fraction of TRL's whole step: a step cannot be faster than its matrix products at this torch's
kernels, so that fraction is the lowest ratio fitrl could reach at these shapes without faster
kernels or fewer products.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from ppo_vs_trl011 import build_model, fitrl_argv  # noqa: E402

GEMMS = {"aten::addmm", "aten::mm", "aten::bmm", "aten::baddbmm"}
# The package function each phase of a step calls, and the phase's name in the script's timings.
PHASES = {
    ("fitrl.rollout", "sample_responses"): "generate",
    ("fitrl.ppo.step", "make_experience"): "forward",
    ("fitrl.ppo.step", "ppo_update"): "optimise",
}


def profile_phases(step_to_profile: int) -> dict[str, dict[str, float]]:
    """Wrap the phases' package functions (before the script imports them) so that every call of step
    `step_to_profile` (0-based; the update ends a step) runs under the profiler, summed per phase."""
    import importlib

    from torch.profiler import ProfilerActivity, profile

    seen: dict[str, dict[str, float]] = {}
    steps_done = [0]

    def wrap(module_name: str, name: str, phase_name: str) -> None:
        module = importlib.import_module(module_name)
        phase = getattr(module, name)

        def profiled(*args, **kwargs):
            if steps_done[0] != step_to_profile:
                out = phase(*args, **kwargs)
            else:
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    start = time.perf_counter()
                    out = phase(*args, **kwargs)
                    wall = time.perf_counter() - start
                gemm = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in GEMMS) / 1e6
                row = seen.setdefault(phase_name, {"time_s": 0.0, "gemm_s": 0.0})
                row["time_s"] += wall
                row["gemm_s"] += gemm
            if phase_name == "optimise":
                steps_done[0] += 1
            return out

        setattr(module, name, profiled)

    for (module_name, name), phase_name in PHASES.items():
        wrap(module_name, name, phase_name)
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantization", choices=["none", "8bit"], default="none")
    parser.add_argument("--peer", help="A results file of ppo_vs_trl011.py, for TRL's step time.")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    torch_threads = str(args.threads)
    os.environ.update({"OMP_NUM_THREADS": torch_threads, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    import torch

    torch.set_num_threads(args.threads)
    import runpy

    from fitrl.demo import SHIPPED as demo

    settings = argparse.Namespace(
        steps=4, batch_size=32, mini_batch_size=8, ppo_epochs=4, generation_batch_size=None, query_tokens=6,
        response_tokens=12, seed=0, fitrl_args=[],
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp) / "model", demo, settings.seed)
        seen = profile_phases(step_to_profile=2)
        script = str(ROOT / "scripts" / "ppo.py")
        sys.argv = [script, *fitrl_argv(settings, Path(tmp) / "model", args.quantization, Path(tmp))]
        runpy.run_path(script, run_name="__main__")
    step = sum(p["time_s"] for p in seen.values())
    gemm = sum(p["gemm_s"] for p in seen.values())
    print(f"\n== fitrl, {args.quantization}: step 3 under the profiler, {args.threads} threads ==")
    print(f"{'phase':<10} {'time s':>8} {'matrix products s':>18} {'share':>6}")
    for phase, p in seen.items():
        print(f"{phase:<10} {p['time_s']:>8.3f} {p['gemm_s']:>18.3f} {p['gemm_s'] / p['time_s']:>6.0%}")
    print(f"{'step':<10} {step:>8.3f} {gemm:>18.3f} {gemm / step:>6.0%}")
    if args.peer:
        trl = json.loads(Path(args.peer).read_text())["results"][args.quantization]["time_s"]["trl"]["step"]
        print(f"TRL 0.11.4's step (median, {args.peer}): {trl:.3f} s; fitrl's matrix products alone: {gemm / trl:.2f}x")


if __name__ == "__main__":
    main()
