"""The `fitrl` command, in the style of `trl sft` and `llamafactory-cli`: every stage and tool by name.

    fitrl sft --config configs/demo/sft.yaml --max_steps 20      # a training stage, through accelerate
    fitrl ppo --config configs/neox20b-24gb/ppo.yaml --num_processes 2 --config_file configs/accelerate/ddp_2gpu.yaml
    fitrl eval --config configs/demo/eval.yaml                   # an evaluation or the merge: one process
    fitrl pipeline --profile demo                                # bash pipeline.sh's options
    fitrl pipeline --profile mine                                # a folder of your own <stage>.yaml files
    fitrl plan --config configs/llama1b-16gb/grpo.yaml --gpu "RTX 3080 Laptop 16GB"
    fitrl doctor --profile neox20b-24gb                          # what would stop a run
    fitrl report outputs/demo                                    # rebuild a run's report

A training stage is launched as `accelerate launch` (one process unless `--num_processes` or an
accelerate `--config_file` says otherwise) runs it, and the command exits with the stage's own code:
a usage error is its one `error:` line and exit 2, not accelerate's traceback and exit 1. Everything
after the stage's name, but those two, goes to the stage, which runs as `python -m fitrl.scripts.<stage>` from
the installed package wherever the command runs. `accelerate launch scripts/<stage>.py` in a checkout and
`bash pipeline.sh` keep working as before.
"""

from __future__ import annotations

import importlib.util
import shlex
import subprocess
import sys
from pathlib import Path

from fitrl.launch import DEFAULT_LAUNCH, executable, run

TOOLS = {  # name: (the arguments to python, what it does)
    "pipeline": (["-m", "fitrl.scripts.pipeline"], "every stage of a profile in one run directory"),
    "plan": (["-m", "fitrl.scripts.plan"], "the memory plan of a stage's config on a card"),
    "doctor": (["-m", "fitrl.doctor"], "what would stop a profile's run, in seconds"),
    "report": (["-m", "fitrl.report"], "rebuild a run directory's report.md and report.html"),
}
LAUNCH_OPTIONS = ("--num_processes", "--config_file")  # the launcher's; every other flag is the stage's


def usage() -> str:
    from fitrl.stages import STAGES

    width = max(len(n) for n in [*(s.name for s in STAGES), *TOOLS])
    lines = ["usage: fitrl <stage or tool> [options]", "", "stages (their options: fitrl <stage> --help):"]
    for stage in STAGES:
        how = "accelerate launch" if stage.training else "one process"
        lines.append(f"  {stage.name:<{width}}  {stage.module} ({how})")
    lines += ["", "tools:"]
    lines += [f"  {name:<{width}}  {what}" for name, (_, what) in TOOLS.items()]
    lines += ["", "a training stage also takes --num_processes N and --config_file <accelerate config>"]
    return "\n".join(lines)


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def split_launch_options(args: list[str]) -> tuple[list[str], list[str]]:
    """(the launcher's options, the stage's), from the arguments after the stage's name."""
    launch, rest, i = [], [], 0
    while i < len(args):
        name, eq, value = args[i].partition("=")
        if name in LAUNCH_OPTIONS:
            if not eq:
                if i + 1 >= len(args):
                    fail(f"{name} needs a value")
                value, i = args[i + 1], i + 1
            launch += [name, value]
        else:
            rest.append(args[i])
        i += 1
    return launch, rest


def launcher(options: list[str]) -> list[str]:
    """`accelerate launch` as the pipeline runs it, or with the accelerate config given (flags win over it)."""
    if "--config_file" not in options:
        command = shlex.split(DEFAULT_LAUNCH)
        if "--num_processes" in options:  # the default's own count gives way
            at = command.index("--num_processes")
            del command[at : at + 2]
        return [*command, *options]
    path = Path(options[options.index("--config_file") + 1])
    if not path.is_file():
        fail(f"accelerate config {path} does not exist; give a file (configs/accelerate/ has the shipped ones)")
    if "DEEPSPEED" in path.read_text() and importlib.util.find_spec("deepspeed") is None:
        fail(f"accelerate config {path} asks for DeepSpeed, which is not installed; pip install deepspeed")
    return ["accelerate", "launch", "--quiet", *options]


class StderrFilter:
    """A stage's stderr as it comes, chunk by chunk (progress bars stay live), except that an `error:` line
    passes once however many ranks say it, and once the stage has failed only `error:` lines pass, so
    accelerate's traceback after it does not bury the one line that says what to fix."""

    MARK = b"error: "

    def __init__(self) -> None:
        self.held = b""  # the start of a line that may become an `error:` line: held until it ends
        self.inside = False  # within a line already passed in part (a progress bar's)
        self.said: set[bytes] = set()

    def __call__(self, chunk: bytes, failed: bool) -> bytes:
        data, self.held, out = self.held + chunk, b"", []
        while data:
            line, newline, data = data.partition(b"\n")
            if not newline:  # a line not ended yet
                if not self.inside and self.MARK.startswith(line[: len(self.MARK)]):
                    self.held = line
                elif not failed:
                    out.append(line)
                    self.inside = True
                break
            if not self.inside and line.startswith(self.MARK):
                if line not in self.said:
                    self.said.add(line)
                    out.append(line + newline)
            elif not failed:
                out.append(line + newline)
            elif self.inside:  # a line passed in part (a progress bar) ends here: the next starts afresh
                out.append(newline)
            self.inside = False
        return b"".join(out)


def run_filtered(command: list[str]) -> int:
    """Run `command` (`fitrl.launch.run`) with its stderr through a `StderrFilter`; the stage's own exit code."""
    passed = StderrFilter()

    def show(chunk: bytes, status: Path) -> None:
        failed = status.is_file() and status.read_text().strip() not in ("", "0")
        sys.stderr.buffer.write(passed(chunk, failed))
        sys.stderr.buffer.flush()

    code, _ = run(command, show, merge_stdout=False)
    sys.stderr.buffer.write(passed(b"\n", False) if passed.held else b"")
    return code


def main(argv: list[str] | None = None) -> None:
    from fitrl.stages import NAMES, get

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        raise SystemExit(0 if argv else 2)
    name, rest = argv[0], argv[1:]
    if name in TOOLS:  # from here: a folder of the user's configs and its relative paths mean what they say
        raise SystemExit(subprocess.call([sys.executable, *TOOLS[name][0], *rest]))
    if name not in NAMES:
        fail(f"unknown stage or tool '{name}'; known: {' '.join([*NAMES, *TOOLS])} (fitrl --help)")
    stage = get(name)
    if not stage.training:
        raise SystemExit(run_filtered([sys.executable, "-m", stage.module, *rest]))
    options, rest = split_launch_options(rest)
    raise SystemExit(run_filtered(executable([*launcher(options), "-m", stage.module, *rest])))


if __name__ == "__main__":
    main()
