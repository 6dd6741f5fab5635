"""How every training stage ends, in one place: the ranks agree, then rank 0 writes the trained weights,
the tokenizer, `run_config.yaml`, `run_info.json` (one layout for every stage), the curves, the
samples, and prints one summary line.

`run_info.json` has one layout for every training stage, `fitrl.artifacts.RunInfo`: the base, ranks,
memory (planned and measured peaks), each guard's verdict, then the stage's own figures (`details`).
`README.md` is the adapter's model card: what it is, its figures, and how to load it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fitrl.artifacts import MemoryFigures, RunInfo
from fitrl.config import RunFailed, save_run_config
from fitrl.distributed import check_ranks_in_sync
from fitrl.guards import Health
from fitrl.outputs import markdown_cell, plot_curves


@dataclass
class TrainingEnd:
    """What a training stage leaves behind."""

    stage: str
    configs: tuple[Any, ...]
    model_path: str  # the base, resolved
    world_size: int
    trained: dict[str, torch.Tensor]  # the weights every rank must hold alike
    save_weights: Callable[[Path], None]  # writes them into the output directory (rank 0)
    tokenizer: Any
    trainable_parameters: int
    memory: MemoryFigures
    metrics: Sequence[dict[str, Any]]
    curves: list[str]  # metrics to plot, one panel each
    plot: str  # its file name
    title: str
    summary: str  # one line for the console
    resumed_from: str | None = None
    health: Health = field(default_factory=Health)  # what the guards saw
    details: dict[str, Any] = field(default_factory=dict)  # the stage's own figures for run_info.json
    samples: tuple[str, str] | None = None  # (file name, markdown)


def finish_training(end: TrainingEnd, out: Path, is_main: bool) -> None:
    """Every rank checks that all hold the same, finite weights; rank 0 writes the stage's outputs into `out`."""
    broken = [name for name, t in end.trained.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if broken:
        raise RunFailed(
            f"{len(broken)} trained tensors hold NaN or inf (first: {broken[0]}); nothing was written; "
            "lower learning_rate"
        )
    digests = check_ranks_in_sync(end.trained, f"{end.stage} weights")
    if not is_main:
        return
    end.save_weights(out)
    stable_adapter_config(out)
    end.tokenizer.save_pretrained(out)
    save_run_config(out, *end.configs)
    RunInfo(
        stage=end.stage,
        resolved_model_path=end.model_path,
        world_size=end.world_size,
        resumed_from=end.resumed_from,
        trainable_parameters=end.trainable_parameters,
        rank_weight_digests=digests,
        memory=end.memory,
        health=end.health.verdicts(),
        guard_seconds=round(end.health.seconds, 3),
        details=end.details,
    ).write(out)
    plot_curves(end.metrics, end.curves, out / end.plot, title=end.title)
    (out / "README.md").write_text(model_card(end, out))
    if end.samples is not None:
        name, text = end.samples
        (out / name).write_text(text)
    print(end.summary)


def model_card(end: TrainingEnd, out: Path) -> str:
    """The adapter's model card (in place of peft's empty template): the base it needs, the stage and
    data that made it, its figures and guards as the report reads them, and how to load it."""
    from fitrl.report import figures
    from fitrl.stages import get

    stage = get(end.stage)
    # The base as it resolved (a folder's absolute path, a hub id as given): the card works from anywhere.
    base = end.model_path
    data = next((c.dataset for c in end.configs if isinstance(getattr(c, "dataset", None), str)), None)
    auto = stage.card_model_class
    lines = [
        "---",
        f"base_model: {base}",
        "library_name: peft",
        f"tags: [fitrl, {end.stage}, lora]",
        "---",
        f"# {end.title}",
        "",
        f"A LoRA adapter trained by fitrl's `{end.stage}` stage (`fitrl {end.stage}`) on `{base}`"
        + (f" with `{data}`." if data else "."),
        "Its resolved settings are `run_config.yaml`; what it measured, `run_info.json` and `metrics.jsonl`.",
        "",
        "## Results",
        "",
        *[f"- {line}" for line in figures(stage, out)],
        "",
        "## Use",
        "",
        "```python",
        *(
            stage.card_snippet.format(base=base).splitlines()
            if stage.card_snippet
            else [
                "from peft import PeftModel",
                f"from transformers import {auto}",
                "",
                f'base = {auto}.from_pretrained("{base}"{stage.card_model_kwargs})',
                'model = PeftModel.from_pretrained(base, "<this folder or its hub id>")',
            ]
        ),
        "```",
    ]
    for note in stage.card_notes:
        lines += ["", note]
    return "\n".join(lines) + "\n"


def stable_adapter_config(out: Path) -> None:
    """peft keeps `target_modules` as a set and writes it in the process's hash order, which differs from
    run to run: written sorted, the same run writes the same `adapter_config.json`."""
    path = out / "adapter_config.json"
    if not path.is_file():
        return
    config = json.loads(path.read_text())
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = sorted(config["target_modules"])
        path.write_text(json.dumps(config, indent=2, sort_keys=True))


def samples_markdown(title: str, groups: dict[str, list[dict[str, Any]]]) -> str:
    """Samples as markdown: a heading, then per group a table whose columns are the rows' keys."""
    lines = [f"# {title}"]
    for name, rows in groups.items():
        if not rows:
            continue
        columns = list(rows[0])
        lines += ["", f"## {name}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        for row in rows:
            cells = [f"{v:.3f}" if isinstance(v, float) else markdown_cell(str(v)) for v in row.values()]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
