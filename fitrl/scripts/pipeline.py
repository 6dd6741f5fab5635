"""The whole recipe in one run directory: `bash pipeline.sh [options]` runs this.

    bash pipeline.sh                                   # the embedded demo, on a CPU, in minutes
    bash pipeline.sh --profile neox20b-24gb            # gpt-neox-20b RLHF on one 24 GB GPU
    bash pipeline.sh --profile llama1b-16gb            # GRPO on GSM8K, then its evaluation
    bash pipeline.sh --profile qwen0.5b-16gb           # the whole menu for Qwen2.5-0.5B-Instruct in 16 GB
    bash pipeline.sh --stages ppo eval                 # a subset; --from ppo: ppo and every stage after it
    bash pipeline.sh --launcher ddp_2gpu               # configs/accelerate/ddp_2gpu.yaml (or any command)
    bash pipeline.sh --run_dir runs/try2 --force       # another run directory; re-run every stage
    bash pipeline.sh --dry_run                         # print the commands, run nothing
    bash pipeline.sh --check --profile neox20b-24gb    # what would stop the run, in seconds (fitrl.doctor)

Each stage's config is `configs/<profile>/<stage>.yaml`, or `<folder>/<stage>.yaml` of a folder of your
own (`fitrl pipeline --profile mine`, run where your files are: their relative paths are read from
there, as `fitrl <stage>` reads them; pipeline.sh runs from its own folder). The pipeline points every
stage's output into the run directory (default `outputs/<profile>`) and every input at the stage
before it there, so nobody types a path twice. A stage that completed with the same resolved settings is skipped; one
whose settings changed re-runs, and so does every stage that reads its output; PPO and GRPO that
died resume from their latest checkpoint. Each stage's full output is in `<run_dir>/logs/<stage>.log`; the console gets
its progress bar and one line of results. At the end `report.md` and `report.html` sum the run up.
Environment variables do the same: PROFILE, STAGES, RUN_DIR, LAUNCH, FORCE=1, DRY_RUN=1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fitrl.config import ArgumentParser, UsageError
from fitrl.launch import DEFAULT_LAUNCH, executable, run
from fitrl.stages import NAMES, STAGES, Stage, get, inputs, launchers, profile_dir, profiles, stage_args

# Settings that say where or how a stage runs, not what it computes: a change does not re-run it.
NOT_RESULTS = {
    "output_dir",
    "overwrite_output_dir",
    "resume_from_checkpoint",
    "demo_assets",
    "report_to",
    "strict_guards",
}
LOG_TAIL = 15
RUN_MARKER = ".fitrl-run.json"  # a run directory's: later runs may write into it


def shown(path: Path) -> Path:
    """`path` from here when it is under here (the checkout's `configs/demo/sft.yaml`), else whole."""
    try:
        return path.relative_to(Path.cwd())
    except ValueError:
        return path


def arguments() -> argparse.ArgumentParser:
    env = os.environ
    parser = ArgumentParser(
        prog="bash pipeline.sh",
        description="Run the fitrl stages of a profile in one run directory, skipping what is done.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            f"stages, in order: {' '.join(NAMES)}\nprofiles: {' '.join(profiles())}\n"
            f"launchers: {' '.join(launchers())}\n\n"
            "examples:\n"
            + "\n".join(line.strip() for line in __doc__.splitlines() if line.strip().startswith("bash pipeline.sh"))
        ),
    )
    parser.add_argument(
        "--profile",
        default=env.get("PROFILE", "demo"),
        help="configs/<profile>/, or a folder of your own <stage>.yaml files (default: demo)",
    )
    parser.add_argument(
        "--stages", nargs="+", default=env.get("STAGES", "").split() or None, help="run only these stages"
    )
    parser.add_argument("--from", dest="start", metavar="STAGE", help="run this stage and every one after it")
    parser.add_argument("--run_dir", default=env.get("RUN_DIR"), help="where everything goes (outputs/<profile>)")
    parser.add_argument(
        "--launcher",
        default=env.get("LAUNCH"),
        help="a configs/accelerate/ name, an accelerate config file, or a launch command (default: one process)",
    )
    parser.add_argument("--force", action="store_true", default=env.get("FORCE") == "1", help="re-run every stage")
    parser.add_argument("--dry_run", action="store_true", default=env.get("DRY_RUN") == "1", help="print, run nothing")
    parser.add_argument(
        "--check", action="store_true", help="run nothing: say what would stop the profile's run (fitrl.doctor)"
    )
    return parser


@dataclass
class Request:
    profile: str
    configs: Path  # the profile's folder of <stage>.yaml files
    stages: list[Stage]
    run_dir: Path
    launch: list[str]
    force: bool
    dry_run: bool
    check: bool = False
    ran: list[str] = field(default_factory=list)


def parse(argv: list[str]) -> Request:
    """The request, every part checked before anything runs: a typo in the last stage costs nothing."""
    args = arguments().parse_args(argv)
    configs = shown(profile_dir(args.profile))
    name = configs.resolve().name
    available = [s.name for s in STAGES if (configs / f"{s.name}.yaml").is_file()]
    if not available:
        raise UsageError(f"profile '{args.profile}' has no stage configs ({configs}/<stage>.yaml)")
    if args.stages and args.start:
        raise UsageError("give --stages (or STAGES) or --from, not both: --from runs a stage and every one after it")
    wanted = args.stages or available
    if args.start:
        if args.start not in NAMES:
            raise UsageError(f"unknown stage '{args.start}' for --from; known: {' '.join(NAMES)}")
        wanted = [s for s in available if NAMES.index(s) >= NAMES.index(args.start)]
    for stage in wanted:
        get(stage)
        if stage not in available:
            raise UsageError(f"profile '{args.profile}' has no stage '{stage}' (no {configs}/{stage}.yaml)")
    run_dir = check_run_dir(Path(args.run_dir or f"outputs/{name}"))
    return Request(
        name,
        configs,
        [s for s in STAGES if s.name in wanted],
        run_dir,
        launcher(args.launcher),
        args.force,
        args.dry_run,
        args.check,
    )


def check_run_dir(run_dir: Path) -> Path:
    """A run directory is new, empty, or one a pipeline run made (its `RUN_MARKER`, or the timings an
    older run kept): a run writes `logs/`, `report.md` and a directory per stage into it."""
    from fitrl.outputs import refuse_shared_dir
    from fitrl.report import TIMINGS

    run_dir = run_dir.expanduser()  # `--run_dir=~/runs/t`: the shell leaves that `~` to us
    refuse_shared_dir(run_dir, "run directory", "outputs/<profile>")
    if run_dir.exists() and not run_dir.is_dir():
        raise UsageError(f"run directory {run_dir} is a file; give --run_dir a directory path")
    made_by_fitrl = (run_dir / RUN_MARKER).is_file() or (run_dir / TIMINGS).is_file()
    if run_dir.is_dir() and any(run_dir.iterdir()) and not made_by_fitrl:
        raise UsageError(
            f"run directory {run_dir} holds files a pipeline run did not write; give --run_dir a new or empty directory"
        )
    return run_dir


def launcher(value: str | None) -> list[str]:
    """`accelerate launch` with a named config from configs/accelerate/, a config file, or a command as given."""
    if not value:
        return shlex.split(DEFAULT_LAUNCH)
    path = launchers().get(value) or Path(value)
    if path.suffix == ".yaml" and path.is_file():
        return ["accelerate", "launch", "--quiet", "--config_file", str(shown(path))]
    if " " not in value.strip() and not value.startswith("accelerate"):
        raise UsageError(f"unknown launcher '{value}': name a configs/accelerate/ file or give a command")
    return shlex.split(value)


# --- one stage ------------------------------------------------------------------------------------


def stage_output(req: Request, stage: Stage) -> Path:
    return req.run_dir / stage.output_dir


def command(req: Request, stage: Stage, args: list[str]) -> list[str]:
    """The stage's command line: its launcher, its program (`-m fitrl.scripts.<stage>`) and `args`
    (`stage_args`: its config, its output in the run directory, its inputs from the stages before)."""
    runner = req.launch if stage.training else ["python"]
    return [*runner, "-m", stage.module, *args]


def _results_settings(settings: dict[str, Any]) -> dict[str, Any]:
    import yaml

    plain = yaml.safe_load(yaml.safe_dump(settings))  # the types a run_config.yaml reads back as
    return {k: v for k, v in plain.items() if k not in NOT_RESULTS}


def completed(out: Path, settings: dict[str, Any]) -> str | None:
    """Why the stage must run, or None when `out` holds a finished run with the same settings."""
    from fitrl.config import load_run_config
    from fitrl.outputs import OUTPUT_MARKER

    if not (out / OUTPUT_MARKER).is_file() or not load_run_config(out):
        return "not run yet" if not out.exists() else "its last run did not finish"
    before, now = _results_settings(load_run_config(out)), _results_settings(settings)
    changed = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
    return f"settings changed: {', '.join(changed)}" if changed else None


def resumable(stage: Stage, out: Path, settings: dict[str, Any]) -> Path | None:
    """The latest checkpoint a died PPO or GRPO run left, if it was made with the settings of this one."""
    from fitrl.checkpoints import check_resume_config, checkpoint_root, latest_checkpoint

    if stage.checkpoint_prefix is None:
        return None
    latest = latest_checkpoint(checkpoint_root(out), stage.checkpoint_prefix)
    if latest is None:
        return None
    try:
        check_resume_config(latest, settings)
    except UsageError:
        return None  # made with other settings: start afresh
    return latest


def print_plan(stage: Stage, configs: tuple[Any, ...]) -> bool:
    """Print the memory plan of a training stage; False when it does not fit the GPU that is here."""
    import torch

    from fitrl import planner
    from fitrl.architectures import architecture
    from fitrl.config import first_line
    from fitrl.demo import DemoArguments
    from fitrl.modeling import ModelArguments
    from fitrl.stages.base import config_of

    on_gpu = torch.cuda.is_available()
    try:
        model = config_of(configs, ModelArguments).model_name_or_path
        config = architecture(model, config_of(configs, DemoArguments).demo_assets)
        gpu = torch.cuda.get_device_properties(0).total_memory if on_gpu else 24 * planner.GiB
        result = planner.plan_stage(stage, configs, config, gpu_memory_bytes=gpu)
    except Exception as e:  # the plan informs, the stage decides: a model without a config runs unplanned
        print(f"   note: no memory plan ({first_line(e)})", file=sys.stderr)
        return True
    where = "" if on_gpu else " (no GPU here: 24 GiB assumed)"
    print(f"   {planner.brief(result)}{where}", file=sys.stderr)
    if result.fits or not on_gpu:
        return True
    for s in planner.suggest(stage, configs, config, gpu_memory_bytes=gpu):
        print("   to fit: " + " ".join(f"--{k} {v}" for k, v in s["overrides"].items()), file=sys.stderr)
    return False


def run_logged(cmd: list[str], log: Path) -> tuple[int, Any]:
    """Run `cmd` (`fitrl.launch.run`) with its whole output in `log`; on a terminal, show its progress bar
    on one line. Its exit code, and the signal that stopped it (Ctrl-C, SIGTERM), if one did."""
    log.parent.mkdir(parents=True, exist_ok=True)
    show = sys.stderr.isatty()
    with log.open("wb") as sink:

        def write(chunk: bytes, status: Path) -> None:
            sink.write(chunk)
            sink.flush()
            if show:
                bars = [b for b in re.split(rb"[\r\n]", chunk) if b"%|" in b]
                if bars:
                    sys.stderr.write("\r   " + bars[-1].decode(errors="replace")[-100:] + "\x1b[K")

        try:
            return run(cmd, write, merge_stdout=True)
        finally:
            if show:
                sys.stderr.write("\r\x1b[K")


def run_stage(req: Request, index: int, stage: Stage, timings: dict[str, float]) -> None:
    from fitrl import report
    from fitrl.config import config_dict

    args = stage_args(stage, req.configs, req.run_dir)
    out, cmd = stage_output(req, stage), command(req, stage, args)
    head = f"== [{index}/{len(req.stages)}] {stage.name}"
    if req.dry_run:
        print(" ".join(cmd))
        return
    configs = stage.parse(args)
    settings = config_dict(*configs)
    upstream = [producer for _, producer in inputs(stage, req.configs) if producer in req.ran]
    if req.force:
        reason = "forced"
    elif upstream:
        reason = f"its input, {upstream[0]}, re-ran"
    else:
        reason = completed(out, settings)
    if reason is None:
        print(f"{head}: skipped (done, same settings): {report.one_line(stage, out)}", file=sys.stderr)
        return
    checkpoint = None if req.force else resumable(stage, out, settings)
    if checkpoint is not None:
        cmd += ["--resume_from_checkpoint", str(checkpoint)]
        reason = f"resumed from {checkpoint.name}"
    if out.exists():
        cmd += ["--overwrite_output_dir", "true"]  # the stage replaces only what fitrl wrote there
    print(f"{head}: running ({reason})", file=sys.stderr)
    if stage.training and not print_plan(stage, configs) and not req.force:
        print(
            "   stopped before loading anything: the plan does not fit this GPU; FORCE=1 runs anyway", file=sys.stderr
        )
        raise SystemExit(1)
    log = req.run_dir / "logs" / f"{stage.name}.log"
    started = time.perf_counter()
    code, stopped_by = run_logged(executable(cmd), log)
    if stopped_by is not None:
        said = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("error: ")]
        what = said[-1].removeprefix("error: ") if said else "nothing saved"
        print(f"   {stage.name} stopped ({stopped_by.name}): {what}; run the pipeline again to go on (log: {log})",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(128 + stopped_by.value)
    if code != 0:
        tail = log.read_text(errors="replace").replace("\r", "\n").splitlines()
        tail = [line for line in tail if line.strip()][-LOG_TAIL:]
        print(f"   {stage.name} failed (exit {code}); the end of its log:", file=sys.stderr)
        print("\n".join(tail), file=sys.stderr)
        print(f"   full log: {log}", file=sys.stderr)
        raise SystemExit(code)
    timings[stage.name] = round(time.perf_counter() - started, 1)
    report.write_timings(req.run_dir, timings)
    req.ran.append(stage.name)
    print(f"   done in {timings[stage.name]:.0f} s: {report.one_line(stage, out)}  (log: {log})", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    try:
        req = parse(list(sys.argv[1:] if argv is None else argv))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if req.check:
        from fitrl import doctor

        raise SystemExit(doctor.run(req.configs, req.run_dir))
    from fitrl import report

    timings = report.read_timings(req.run_dir)
    if not req.dry_run:
        print(
            f"== fitrl: profile {req.profile}, stages {' '.join(s.name for s in req.stages)}, in {req.run_dir}",
            file=sys.stderr,
        )
        try:
            (req.run_dir / "logs").mkdir(parents=True, exist_ok=True)
            (req.run_dir / RUN_MARKER).write_text(json.dumps({"fitrl": "a pipeline run directory"}) + "\n")
        except OSError as e:
            print(
                f"error: cannot write in run directory {req.run_dir} ({e.strerror}); give --run_dir a writable path",
                file=sys.stderr,
            )
            raise SystemExit(2) from None
    for i, stage in enumerate(req.stages, 1):
        try:
            run_stage(req, i, stage, timings)
        except UsageError as e:  # a stage's config the stage itself would refuse: one line, exit 2
            print(f"error: {stage.name} ({req.configs}/{stage.name}.yaml): {e}", file=sys.stderr)
            raise SystemExit(2) from None
        except SystemExit:
            if req.ran:  # what finished before the stage that stopped still gets its report
                md, _ = report.write(req.run_dir, title=f"fitrl {req.profile} run")
                print(f"== fitrl: stopped at {stage.name}; ran: {', '.join(req.ran)}; report: {md}", file=sys.stderr)
            raise
    if req.dry_run:
        return
    md, page = report.write(req.run_dir, title=f"fitrl {req.profile} run")
    ran = ", ".join(req.ran) or "none (all done)"
    print(f"== fitrl: done; ran: {ran}; report: {md} and {page}", file=sys.stderr)


if __name__ == "__main__":
    main()
