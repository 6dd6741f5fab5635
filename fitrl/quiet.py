"""Library messages known to be harmless here, silenced in one place (imported by `fitrl/__init__.py`).

Each filter names the exact message, so anything new still reaches the user.
"""

from __future__ import annotations

import logging
import warnings


def install() -> None:
    # bitsandbytes logs, on every 8-bit matmul, that fp32 inputs are cast to fp16: expected on the CPU demo.
    logging.getLogger("bitsandbytes.autograd._functions").addFilter(
        lambda record: "inputs will be cast" not in record.getMessage()
    )
    # bitsandbytes tries to fetch an optional CPU 4-bit kernel from the hub; without it, it uses its own.
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
        lambda record: "Failed to load CPU gemm_4bit_forward" not in record.getMessage()
    )
    # peft 0.21 still reads transformers' deprecated alias when it wraps a model; fitrl uses the new API.
    warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
