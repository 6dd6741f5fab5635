"""Process state under `accelerate launch`, the same way on a GPU box and a CPU-only machine.

accelerate picks gloo DDP on a machine without an accelerator only when told `cpu=True`;
`accelerate launch --multi_gpu --num_processes 2` alone leaves every process thinking it is alone.
Everything in fitrl that asks "which rank am I" goes through here.
"""

from __future__ import annotations

import os
from typing import Any

import torch

# What `accelerate launch` sets from a DeepSpeed or FSDP config, before any process state exists.
SHARDING_ENV = {"ACCELERATE_USE_DEEPSPEED": "DeepSpeed", "ACCELERATE_USE_FSDP": "FSDP"}


def cpu_only() -> bool:
    """True when there is no GPU to run on (then DDP runs over gloo on CPU processes)."""
    return not torch.cuda.is_available()


def sharded_launch() -> str | None:
    """The sharding this process was launched with ('DeepSpeed', 'FSDP'), or None for one device or DDP."""
    for variable, name in SHARDING_ENV.items():
        if os.environ.get(variable, "").lower() in ("1", "true", "yes"):
            return name
    return None


def process_state() -> Any:
    """accelerate's `PartialState` (rank, world size, device), distributed on CPU-only machines too."""
    from accelerate import PartialState

    return PartialState(cpu=cpu_only())


def tensor_digest(tensors: dict[str, torch.Tensor]) -> str:
    """A short hash of named tensors' exact values (order-independent in the names)."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def check_ranks_in_sync(tensors: dict[str, torch.Tensor], what: str = "trainable weights") -> list[str]:
    """Gather every rank's digest of `tensors`; raise if DDP let the ranks drift apart.

    Returns the digests in rank order (one entry when not distributed).
    """
    from accelerate.utils import gather_object

    digests = gather_object([tensor_digest(tensors)])
    if len(set(digests)) > 1:
        raise RuntimeError(f"DDP ranks hold different {what} (digests {digests}); the run is not data-parallel")
    return digests
