"""Measuring memory: peak RSS (CPU RAM), peak GPU memory, and the peak of live tensor bytes (any device)."""

from __future__ import annotations

import resource
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any

import psutil
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fitrl.artifacts import MemoryFigures


class PeakRSS:
    """Sample this process's RSS in a background thread; `.peak_mb` and `.increase_mb` after the block.

    `increase_mb` (peak minus the RSS at entry) is what the block itself needed, independent of what
    imports and earlier work already hold.
    """

    def __init__(self, interval_s: float = 0.005):
        self.interval_s = interval_s
        self.start_mb = self.peak_mb = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc = psutil.Process()

    def _rss_mb(self) -> float:
        return self._proc.memory_info().rss / 2**20

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_mb = max(self.peak_mb, self._rss_mb())
            time.sleep(self.interval_s)

    def __enter__(self) -> PeakRSS:
        self.start_mb = self.peak_mb = self._rss_mb()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak_mb = max(self.peak_mb, self._rss_mb())

    @property
    def increase_mb(self) -> float:
        return self.peak_mb - self.start_mb


def gpu_peak_mb() -> float | None:
    """Peak GPU memory allocated by torch on this process's device since the last reset, or None on CPU."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.max_memory_allocated() / 2**20


def peak_memory_mb() -> float:
    """This process's peak memory so far: torch's peak CUDA allocation on a GPU, else the peak RSS."""
    gpu = gpu_peak_mb()
    if gpu is not None:
        return gpu
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of the tensors created while it is active, on any device, `meta` included.

    Every aten op's fresh outputs (not views or in-place results: the op schema says which) are
    counted until their storage is freed, so the peak is what an allocator would have to hold for
    them, without slack. Tensors that existed before (the weights) are not counted: add them
    yourself. `phase(name)` records the peak reached inside a named block in `phase_peaks`.
    """

    def __init__(self) -> None:
        super().__init__()
        self.current = self.peak = 0
        self.phase_peaks: dict[str, int] = {}
        self._phase: str | None = None
        self._live: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        outs = out if len(returns) > 1 else (out,)
        for ret, value in zip(returns, outs):
            if ret.alias_info is None:
                for t in tree_leaves(value):
                    if isinstance(t, torch.Tensor):
                        self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._live:
            return
        nbytes = storage.nbytes()
        self._live.add(key)
        self.current += nbytes
        if self.current > self.peak:
            self.peak = self.current
        if self._phase is not None and self.current > self.phase_peaks[self._phase]:
            self.phase_peaks[self._phase] = self.current
        weakref.finalize(storage, self._free, key, nbytes)

    def _free(self, key: int, nbytes: int) -> None:
        self._live.discard(key)
        self.current -= nbytes

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Record the peak of live bytes inside the block as `phase_peaks[name]` (the max over repeats)."""
        outer, self._phase = self._phase, name
        self.phase_peaks[name] = max(self.phase_peaks.get(name, 0), self.current)
        try:
            yield
        finally:
            self._phase = outer


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes held by `tensors`, each storage counted once (tied weights, views and shared state maps)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


def optimizer_state_tensors(optimizer: Any) -> list[torch.Tensor]:
    """The tensors an optimizer keeps per parameter (moments, 8-bit maps, steps)."""
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


class StepPeak:
    """The tensor peak of one step on a CPU: the bytes held when it starts (weights, optimizer states,
    from `held()`) plus the peak of what it allocates. A GPU has its own counters (`memory_report`);
    there this does nothing, and costs nothing."""

    def __init__(self) -> None:
        self.peak_bytes: int | None = None
        self._tracker: LiveTensorBytes | None = None
        self._held = 0

    def start(self, held: Iterable[torch.Tensor]) -> None:
        if torch.cuda.is_available() or self._tracker is not None:
            return
        self._held = tensor_bytes(held)
        self._tracker = LiveTensorBytes()
        self._tracker.__enter__()

    def stop(self) -> None:
        if self._tracker is None:
            return
        self._tracker.__exit__(None, None, None)
        self.peak_bytes = self._held + self._tracker.peak
        self._tracker = None


def memory_report(planned_peak_mb: float | None, step_peak: StepPeak | None = None) -> MemoryFigures:
    """The `memory` object of `run_info.json`: the planner's answer beside what the run measured."""
    if torch.cuda.is_available():
        return MemoryFigures(
            planned_peak_mb,
            device=torch.cuda.get_device_name(),
            measured_peak_mb=round(torch.cuda.max_memory_allocated() / 2**20, 1),
            measured_reserved_mb=round(torch.cuda.max_memory_reserved() / 2**20, 1),
        )
    tracked = None if step_peak is None or step_peak.peak_bytes is None else step_peak.peak_bytes / 2**20
    return MemoryFigures(
        planned_peak_mb,
        device="cpu",
        measured_peak_mb=None if tracked is None else round(tracked, 1),  # tensors, comparable to the plan
        peak_rss_mb=round(peak_memory_mb(), 1),  # the whole process: Python, libraries, allocator
    )
