"""What popular cards really give torch, for planning against the card a user has, not its nominal size.

A "24 GB" RTX 4090 reports 23.64 GiB to torch, a "16 GB" RTX 3080 Laptop 15.73 GiB: the capacity
below is `torch.cuda.get_device_properties(0).total_memory` as CUDA's out-of-memory message prints it
("GPU 0 has a total capacity of ..."), each with the public report it was read from. Drivers move it
by a few hundredths of a GiB. A card that also feeds a display holds less again: `plan.py
--reserve_gb` takes that off (nvidia-smi shows what other processes hold).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fitrl.config import UsageError


@dataclass(frozen=True)
class Card:
    name: str
    capacity_gib: float  # what torch reports
    source: str  # where that figure was read


CARDS = [
    Card("RTX 4090", 23.64, "https://github.com/ali-vilab/VGen/issues/104"),
    Card("RTX 3090", 23.69, "https://github.com/JiaweiLian/AP-PA/issues/3"),
    Card("RTX 4080", 15.99, "https://github.com/aigc-apps/sd-webui-EasyPhoto/issues/281"),
    Card("RTX 3080 Laptop 16GB", 15.73, "fitrl's seed report (an RTX 3080 Laptop GPU's out-of-memory message)"),
    Card("RTX 4060 Ti 16GB", 15.55, "https://github.com/boson-ai/higgs-audio/issues/48"),
    Card("A10G", 21.99, "https://github.com/zai-org/CogVLM/issues/236 (an A10: the A10G's memory)"),
    Card("L4", 22.03, "public out-of-memory reports from L4 users ('GPU 0 has a total capacity of 22.03 GiB')"),
    Card("T4", 14.56, "https://github.com/AlphaGPU/leetgpu-challenges/issues/52"),
    Card("A100 40GB", 39.50, "https://github.com/TianheWu/CoSeR/issues/10"),
    Card("A100 80GB", 79.14, "https://github.com/lianqi1008/Control-GIC/issues/6"),
    Card("H100 80GB", 79.11, "https://github.com/vllm-project/vllm/issues/27508"),
]


def _key(name: str) -> str:
    """'NVIDIA GeForce RTX 4090' and 'rtx4090' alike: letters and digits, no vendor or brand words."""
    key = re.sub(r"[^a-z0-9]", "", name.lower())
    for word in ("nvidia", "geforce", "tesla"):
        key = key.replace(word, "")
    return key


def card(name: str) -> Card:
    """The card `name` means (any spelling of the names in `CARDS`, or a unique start of one); a usage error
    naming them if none."""
    wanted = _key(name)
    found = [c for c in CARDS if _key(c.name) == wanted]
    if not found and wanted:  # a unique start of a name: "RTX 3080 Laptop", "A100 80"
        found = [c for c in CARDS if _key(c.name).startswith(wanted)]
        if len(found) > 1:
            raise UsageError(f"card '{name}' could be {' or '.join(c.name for c in found)}; give more of its name")
    if not found:
        known = ", ".join(c.name for c in CARDS)
        raise UsageError(
            f"unknown card '{name}' (known: {known}); give --gpu_memory_gb with what torch reports instead"
        )
    return found[0]
