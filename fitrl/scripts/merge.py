"""Stage 2 of the RLHF pipeline: fold the SFT LoRA adapter into the base weights, in bounded memory.

gpt-neox-20b is ~40 GB in fp16: peft's `merge_and_unload()` needs it all in RAM at once, which a
24 GB-GPU desktop does not have. The streaming merge (`fitrl.merge`) reads the base's safetensors
shards one at a time, adds `scaling * B @ A` to each adapted weight in fp32, writes the merged shard
and frees it: peak memory is about one shard plus the adapter. It never merges into quantized
weights: it reads the full-precision checkpoint files. This script checks the inputs, runs the
merge, verifies it if asked and writes the model card.

    python scripts/merge.py --config configs/demo/merge.yaml
    python scripts/merge.py --config configs/neox20b-24gb/merge.yaml --verify true
    # peft's in-memory merge (needs the whole model in RAM), the reference the tests compare against
    python scripts/merge.py --config configs/demo/merge.yaml --method in_memory

Writes to `output_dir`: sharded safetensors + index, config.json, generation config, tokenizer, a
model card (README.md), `run_config.yaml` and `run_info.json` (peak RSS, time, verification).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fitrl.artifacts import MergeInfo
from fitrl.checkpoints import check_adapter_base
from fitrl.config import UsageError, load_run_config, save_run_config
from fitrl.hub import push_output
from fitrl.memory import PeakRSS
from fitrl.merge import (
    DTYPES,
    TOKENIZER_FILES,
    VERIFY_TOLERANCE,
    base_checkpoint,
    in_memory_merge,
    read_adapter,
    streaming_merge,
    verify_merge,
    write_config_files,
)
from fitrl.modeling import load_tokenizer, resolve_model_path
from fitrl.outputs import check_output_dir, staged_output_dir
from fitrl.process import entrypoint
from fitrl.stages.merge import STAGE


@dataclass
class Inputs:
    """What the merge reads, checked before anything is written."""

    adapter_dir: Path
    adapter_config: dict[str, Any]
    adapter_weights: dict[str, Any]
    base_name: str
    base_dir: Path
    tokenizer: Any  # the SFT stage's (saved beside its adapter), else the base's, else None


def preflight(args: Any, demo_args: Any) -> Inputs:
    """The adapter and the base it was trained on (its run_config.yaml says which, unless named)."""
    check_output_dir(
        args.output_dir, args.overwrite_output_dir, [args.adapter_dir, args.base_model], demo_args.demo_assets
    )
    adapter_dir = Path(args.adapter_dir).expanduser()
    if not adapter_dir.is_dir():
        raise UsageError(f"adapter directory {adapter_dir} does not exist; run the SFT stage first")
    adapter_config, adapter_weights = read_adapter(adapter_dir)
    sft_config = load_run_config(adapter_dir)
    base_name = args.base_model or sft_config.get("model_name_or_path") or adapter_config["base_model_name_or_path"]
    base = resolve_model_path(base_name, demo_args.demo_assets, what="base model")
    check_output_dir(args.output_dir, args.overwrite_output_dir, [base])
    # An adapter saved from a model built in memory records no base: then there is nothing to compare.
    check_adapter_base(
        adapter_dir, base_name, base, STAGE.name, args.force, producer=STAGE.reads[1], require_record=False
    )
    base_dir = base_checkpoint(base)
    has_tokenizer = [d for d in (adapter_dir, base_dir) if any((d / f).is_file() for f in TOKENIZER_FILES)]
    tokenizer = load_tokenizer(str(has_tokenizer[0])) if has_tokenizer else None
    return Inputs(adapter_dir, adapter_config, adapter_weights, base_name, base_dir, tokenizer)


def merge(args: Any, inputs: Inputs, out: Path) -> MergeInfo:
    """The merged weights (and tokenizer) into `out`; what it took, for run_info.json."""
    start = time.perf_counter()
    with PeakRSS() as rss:
        if args.method == "streaming":
            dtype = DTYPES[args.dtype]
            n_changed = streaming_merge(inputs.base_dir, inputs.adapter_config, inputs.adapter_weights, out, dtype)
            write_config_files(inputs.base_dir, out, args.dtype)
        else:
            n_changed = in_memory_merge(str(inputs.base_dir), inputs.adapter_dir, out, DTYPES[args.dtype])
    seconds = time.perf_counter() - start
    if inputs.tokenizer is not None:
        inputs.tokenizer.save_pretrained(out)
    return MergeInfo(
        stage=STAGE.name,
        base_model=inputs.base_name,
        base_path=str(inputs.base_dir),
        adapter_dir=str(inputs.adapter_dir),
        method=args.method,
        dtype=args.dtype,
        adapted_tensors=n_changed,
        peak_rss_mb=round(rss.peak_mb, 1),
        peak_rss_increase_mb=round(rss.increase_mb, 1),
        seconds=round(seconds, 2),
    )


def verify(args: Any, inputs: Inputs, out: Path, info: MergeInfo) -> MergeInfo:
    """Merged logits against base + adapter on a few prompts; fails above the tolerance."""
    tolerance = args.verify_tolerance or VERIFY_TOLERANCE[args.dtype]
    diff = verify_merge(str(inputs.base_dir), inputs.adapter_dir, out, inputs.tokenizer, tolerance)
    return dataclasses.replace(info, verify_max_logit_diff=diff, verify_tolerance=tolerance)


@entrypoint
def main(argv: list[str] | None = None) -> None:
    args, demo_args = STAGE.parse(argv)
    inputs = preflight(args, demo_args)
    with staged_output_dir(args.output_dir, args.overwrite_output_dir, stage=STAGE.name) as out:
        info = merge(args, inputs, out)
        if args.verify:
            info = verify(args, inputs, out, info)
        (out / "README.md").write_text(model_card(info, inputs.adapter_config))
        save_run_config(out, args, demo_args)
        info.write(out)
    verified = f", verified (max logit diff {info.verify_max_logit_diff:.2g})" if args.verify else ""
    print(
        f"merged {info.adapted_tensors} tensors ({args.method}, {args.dtype}) in {info.seconds:.1f}s, "
        f"peak RSS +{info.peak_rss_increase_mb:.0f} MB{verified} -> {args.output_dir}"
    )
    push_output(args, args.output_dir, STAGE.name)


def model_card(info: MergeInfo, adapter_config: dict[str, Any]) -> str:
    return f"""---
base_model: {info.base_model}
tags: [fitrl, lora-merged]
---
# Merged model

The base model `{info.base_model}` with the LoRA adapter from `{info.adapter_dir}` folded into its
weights by fitrl's `scripts/merge.py`.

| | |
|---|---|
| merge method | {info.method} |
| dtype | {info.dtype} |
| LoRA r / alpha | {adapter_config.get("r")} / {adapter_config.get("lora_alpha")} |
| rsLoRA scaling | {bool(adapter_config.get("use_rslora"))} |
| target modules | {adapter_config.get("target_modules")} |
| adapted tensors | {info.adapted_tensors} |
| peak RSS during merge | {info.peak_rss_mb} MB (+{info.peak_rss_increase_mb} MB) |
"""


if __name__ == "__main__":
    main()
