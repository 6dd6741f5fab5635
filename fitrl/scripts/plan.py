"""Will this run fit my card? The planned peak memory of an SFT, PPO or GRPO run, before any weight loads.

Reads a stage's config exactly as the stage script does (its YAML file and its own flags on top),
builds the model's architecture on the `meta` device (nothing is allocated, nothing is downloaded:
the configs of popular models ship with fitrl) and prints the bytes of every part, the phase where
the peak happens, and whether it fits.

    python scripts/plan.py --config configs/llama1b-16gb/grpo.yaml --gpu "RTX 3080 Laptop 16GB"
    # a desktop card that also feeds a display: what nvidia-smi shows the other processes holding
    python scripts/plan.py --config configs/neox20b-24gb/sft.yaml --gpu "RTX 4090" --reserve_gb 0.4
    python scripts/plan.py --config configs/neox20b-24gb/ppo.yaml --architecture EleutherAI/gpt-neox-20b
    # what to change to fit a 16 GB card, as flags the stage takes
    python scripts/plan.py --config configs/neox20b-24gb/sft.yaml --gpu_memory_gb 16 --suggest
    # any model, any stage, from flags alone; full fine-tuning for comparison; JSON for scripts
    python scripts/plan.py --stage grpo --model_name_or_path Qwen/Qwen2.5-7B --finetuning full --json
    # check the plan: the full depth traced on `meta`, per phase
    python scripts/plan.py --config configs/demo/grpo.yaml --trace

Exit status: 0 when the run fits, 1 when it does not, 2 for bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from fitrl import planner, stages
from fitrl.architectures import architecture
from fitrl.config import ArgumentParser, UsageError, first_line
from fitrl.demo import DemoArguments
from fitrl.process import entrypoint
from fitrl.stages.base import config_of


def planner_arguments() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    parser.add_argument(
        "--stage", choices=sorted(stages.PLANNABLE), help="The stage (default: the --config file's name)."
    )
    parser.add_argument("--gpu_memory_gb", type=float, help="GPU memory in GiB (default: the detected GPU, else 24).")
    parser.add_argument(
        "--gpu", help="Plan for this card's real capacity, e.g. 'RTX 4090' (23.64 GiB to torch; list: docs/memory.md)."
    )
    parser.add_argument(
        "--reserve_gb",
        type=float,
        default=0.0,
        help="GiB other processes hold on the card (a display: see nvidia-smi).",
    )
    parser.add_argument(
        "--finetuning",
        choices=["lora", "full"],
        default="lora",
        help="Plan LoRA (what the stages do) or full fine-tuning.",
    )  # noqa: E501
    parser.add_argument(
        "--architecture",
        help="Plan with this model's architecture (e.g. when model_name_or_path is a stage output not written yet).",
    )  # noqa: E501
    parser.add_argument(
        "--world_size",
        type=int,
        default=1,
        help="Processes (GPUs) the run is launched on, each holding the whole model (one card or DDP): sharded "
        "runs (DeepSpeed ZeRO, FSDP) are not planned.",
    )
    parser.add_argument("--json", action="store_true", help="Print one JSON object instead of the table.")
    parser.add_argument("--brief", action="store_true", help="Print one line: the peak, its phase and the verdict.")
    parser.add_argument("--suggest", action="store_true", help="Search the settings nearest to this one that fit.")
    parser.add_argument(
        "--trace", action="store_true", help="Also trace the full depth on meta and print it beside the plan."
    )  # noqa: E501
    return parser


def stage_of(args: argparse.Namespace, rest: list[str]) -> str:
    if args.stage:
        return args.stage
    if "--config" in rest and rest.index("--config") + 1 < len(rest):
        stem = Path(rest[rest.index("--config") + 1]).stem
        if stem in stages.PLANNABLE:
            return stem
        raise UsageError(
            f"cannot tell the stage from config file {stem}.yaml; pass --stage {', '.join(stages.PLANNABLE)}"
        )
    raise UsageError(f"name a stage: --config configs/<profile>/<stage>.yaml or --stage {'|'.join(stages.PLANNABLE)}")


def gpu_memory_bytes(requested: float | None, card: str | None = None, reserve: float = 0.0) -> tuple[int, bool]:
    """The GPU memory to plan for (less what other processes hold), and whether a GPU is present."""
    import torch

    from fitrl.cards import card as named_card

    if not (math.isfinite(reserve) and reserve >= 0):
        raise UsageError(f"invalid value for '--reserve_gb': must be a finite number >= 0 (got {reserve})")
    if card is not None and requested is not None:
        raise UsageError("give --gpu or --gpu_memory_gb, not both")
    present = torch.cuda.is_available()
    if card is not None:
        total = int(named_card(card).capacity_gib * planner.GiB)
    elif requested is not None:
        if not (math.isfinite(requested) and requested > 0):
            raise UsageError(f"invalid value for '--gpu_memory_gb': must be a finite number > 0 (got {requested})")
        total = int(requested * planner.GiB)
    else:
        total = torch.cuda.get_device_properties(0).total_memory if present else 24 * planner.GiB
    if reserve * planner.GiB >= total:
        raise UsageError(f"--reserve_gb {reserve} leaves nothing of the card's {total / planner.GiB:.2f} GiB")
    return total - int(reserve * planner.GiB), present


@entrypoint
def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        planner_arguments().print_help()
        print("\nEvery other flag is the stage's own: see `python scripts/<stage script> --help`.")
        return
    args, rest = planner_arguments().parse_known_args(argv)
    stage = stages.get(stage_of(args, rest))
    configs = stage.parse(rest)
    config_file = Path(rest[rest.index("--config") + 1]) if "--config" in rest[:-1] else None
    model = args.architecture or stages.architecture_source(stage, configs, config_file)
    config = architecture(model, config_of(configs, DemoArguments).demo_assets)
    gpu_bytes, present = gpu_memory_bytes(args.gpu_memory_gb, args.gpu, args.reserve_gb)
    if args.world_size < 1:
        raise UsageError(f"invalid value for '--world_size': must be >= 1 (got {args.world_size})")
    options = {"finetuning": args.finetuning, "world_size": args.world_size}
    try:
        result = planner.plan_stage(stage, configs, config, gpu_memory_bytes=gpu_bytes, **options)
        if args.trace:
            result.traced = planner.trace_full_depth(config, result.workload)
        if args.suggest and not result.fits:
            result.suggestions = planner.suggest(stage, configs, config, gpu_memory_bytes=gpu_bytes, **options)
    except (RuntimeError, OverflowError) as e:
        if "overflow" not in str(e).lower():
            raise
        raise UsageError(f"the model's shapes overflow 64-bit sizes ({first_line(e)}); check its config.json") from None
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    elif args.brief and result.fits:
        assumed = present or args.gpu_memory_gb or args.gpu
        print(planner.brief(result) + ("" if assumed else " (no GPU here: 24 GiB assumed)"))
    else:
        print(planner.table(result))
    if args.suggest and not result.fits and not result.suggestions and not args.json:
        print("  no setting within reach fits: a smaller model or a larger card")
    raise SystemExit(0 if result.fits else 1)


if __name__ == "__main__":
    main()
