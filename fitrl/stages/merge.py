"""The merge stage: fold the SFT LoRA adapter into the base weights, shard by shard.

Program: `fitrl.scripts.merge` (the maths in `fitrl.merge`). Writes a full-precision model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from fitrl.artifacts import MergeInfo
from fitrl.config import check, help_field
from fitrl.demo import DemoArguments
from fitrl.hub import HubSettings
from fitrl.stages.base import Stage


@dataclass
class MergeArguments(HubSettings):
    """Which adapter to fold into which base, and how."""

    adapter_dir: str = help_field("outputs/sft", "The SFT stage's output directory (adapter_config.json inside).")
    base_model: str | None = help_field(
        None, "Base model (hub id, local dir, demo://lm); empty: the one the SFT stage used (its run_config.yaml)."
    )
    output_dir: str = help_field("outputs/merged", "Where the merged model goes.")
    overwrite_output_dir: bool = help_field(False, "Replace a non-empty output_dir.")
    dtype: Literal["float16", "bfloat16", "float32"] = help_field("float16", "Dtype of the merged weights.")
    method: Literal["streaming", "in_memory"] = help_field(
        "streaming", "'streaming': shard by shard, bounded memory; 'in_memory': peft merge_and_unload (needs RAM)."
    )
    force: bool = help_field(False, "Merge even if the adapter says it was trained on another base.")
    verify: bool = help_field(False, "Compare merged vs base+adapter logits on a few prompts; fail above tolerance.")
    verify_tolerance: float | None = help_field(None, "Largest logit difference --verify accepts (default by dtype).")

    def validate(self) -> None:
        super().validate()
        check(self.verify_tolerance is None or self.verify_tolerance > 0, "verify_tolerance", "empty or > 0")


CONFIG_TYPES = (MergeArguments, DemoArguments)


def figures(out: Path) -> list[str]:
    info = MergeInfo.read(out)
    if info is None:
        return []
    found = [f"peak RAM {info.peak_rss_mb:.0f} MB ({info.method} merge)"]
    if info.verify_max_logit_diff is not None:
        ok = info.verify_max_logit_diff <= (info.verify_tolerance or float("inf"))
        found.append(f"verified: max logit difference {info.verify_max_logit_diff:.2e} ({'ok' if ok else 'FAILED'})")
    return found


STAGE = Stage(
    name="merge",
    writes_full_model=True,
    module="fitrl.scripts.merge",
    config_types=CONFIG_TYPES,
    output_dir="merged",
    figures=figures,
    reads=("adapter_dir", "sft"),
)
