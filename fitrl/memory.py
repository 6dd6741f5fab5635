"""Measuring memory: peak resident set size (CPU RAM) while a block runs, and peak GPU memory."""

from __future__ import annotations

import resource
import threading
import time
from types import TracebackType

import psutil
import torch


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
