"""A stage process's life, one rule however it was launched: its threads, SIGTERM, its exit code and one
`error:` line for what went wrong (`entrypoint` wraps every program's `main`), and leaving
torch.distributed when done."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from fitrl import signals
from fitrl.config import EXIT_TERMINATED, EXIT_USAGE, RunFailed, Terminated, UsageError

T = TypeVar("T")


STATUS_FILE_ENV = "FITRL_STATUS_FILE"


def _fail(message: str, code: int) -> typing.NoReturn:
    # A progress bar cut off mid-line would swallow the start of the error line: close it first.
    bars = sys.modules.get("tqdm.std")
    for bar in list(bars.tqdm._instances) if bars else []:
        bar.close()
    # `accelerate launch` reports any failing child as exit 1; pipeline.sh reads the real code here. The
    # first failure stands: a rank that refused its config (2) makes the launcher stop the other ranks
    # (SIGTERM, 143), whose own line would only say so.
    status_file = os.environ.get(STATUS_FILE_ENV)
    first = True
    if status_file:
        with contextlib.suppress(OSError):
            first = not Path(status_file).read_text().strip()
            if first:
                Path(status_file).write_text(str(code))
    if first:
        print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)


def cpu_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0))


def thread_rule() -> int:
    """The CPU threads of a stage process, one rule however it was launched: `OMP_NUM_THREADS` when set,
    else the machine's cores. Every launch path of fitrl sets it to the cores per process
    (`fitrl.launch.launch_env`), since `accelerate launch` would give each process one thread: a direct
    `python scripts/<stage>.py` and a launched one take the same count and compute the same bits."""
    import torch

    threads = int(os.environ.get("OMP_NUM_THREADS") or cpu_cores())
    torch.set_num_threads(threads)
    return threads


def close_process_group() -> bool:
    """Leave torch.distributed once a stage is done: every rank meets, then the group is destroyed.
    Returns whether there was one to leave."""
    if "torch.distributed" not in sys.modules:  # no process group without it
        return False
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        return True
    return False


def entrypoint(main: Callable[..., T]) -> Callable[..., T]:
    """Wrap a script's `main`: the thread rule and the SIGTERM rule (`fitrl.signals`), then a `UsageError`
    prints one line on stderr and exits 2, a `RunFailed` exits 1, a `Terminated` 143."""

    @functools.wraps(main)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        thread_rule()
        try:
            with signals.terminate_cleanly():
                result = main(*args, **kwargs)
            if close_process_group():
                # A rank of a finished trl stage under gloo can still abort in the interpreter's own
                # teardown (SIGABRT, "terminate called without an active exception": a C++ thread of
                # torch.distributed destroyed while joinable), and the launcher then fails the finished
                # run. Everything is written and closed by now: leave without that teardown.
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)
            return result
        except UsageError as e:
            _fail(str(e), EXIT_USAGE)
        except RunFailed as e:
            _fail(str(e), 1)
        except Terminated as e:
            _fail(str(e), EXIT_TERMINATED)

    return wrapper
