"""SIGTERM (a preempted cloud machine, a closed notebook, `kill`) stops a stage cleanly.

Outside a training loop the signal raises `Terminated` where the program is, so the staged output is
removed as for any error and the process exits 143 with one line. Inside one (`stop_at_step_end`) it
only sets a flag: the loop finishes its step, saves a checkpoint and stops; the stage then raises
`Terminated` naming the checkpoint to resume from. Under DDP a signal that reached one rank stops all
of them at the same step (`StopRequest.requested` asks every rank).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

from fitrl.config import Terminated

_deferred: list[StopRequest] = []


class StopRequest:
    """Set by SIGTERM while a training loop runs; the loop asks it at the end of every step."""

    def __init__(self) -> None:
        self.signal: str | None = None

    def requested(self) -> bool:
        """Whether any rank got the signal (a collective under DDP: every rank must ask, every step)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return self.signal is not None
        import torch

        from fitrl.distributed import process_state

        flag = torch.tensor([int(self.signal is not None)], device=process_state().device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and self.signal is None:
            self.signal = "SIGTERM"  # another rank's
        return bool(flag.item())


def _on_signal(signum: int, frame: Any) -> None:
    name = signal.Signals(signum).name
    if _deferred:
        _deferred[-1].signal = name
        return
    raise Terminated(f"stopped by {name}; nothing of this run was saved")


@contextlib.contextmanager
def terminate_cleanly() -> Iterator[None]:
    """SIGTERM raises `Terminated` in the main thread for the duration of the block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _on_signal)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def stop_at_step_end() -> Iterator[StopRequest]:
    """While the block runs, SIGTERM asks the loop to stop after its step instead of raising."""
    request = StopRequest()
    _deferred.append(request)
    try:
        yield request
    finally:
        _deferred.remove(request)
