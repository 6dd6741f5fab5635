"""What every stage writes: a staged output directory, `metrics.jsonl` and curve plots.

A stage writes into `.<name>.partial` beside its output directory and renames it into place only
when everything is written, so a crash or a bad input never leaves a half-written output behind.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import unicodedata
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fitrl import demo
from fitrl.config import UsageError
from fitrl.distributed import process_state

METRICS_NAME = "metrics.jsonl"


OUTPUT_MARKER = ".fitrl-output.json"
NAME_MAX = 255  # bytes in one file name on Linux, macOS and Windows file systems
NAME_SUFFIXES = 24  # the longest name made from an output's: `.<name>.write-test-<pid>`


def refuse_shared_dir(path: Path, what: str, example: str) -> None:
    """A directory fitrl may fill must not be the current directory, one of its parents, home or root."""
    resolved, cwd = path.resolve(), Path.cwd().resolve()
    if resolved in {Path(resolved.anchor), Path.home().resolve(), cwd, *cwd.parents}:
        raise UsageError(
            f"{what} {path} is the current, home or root directory or a parent of the current one; "
            f"give it a directory of its own, e.g. {example}"
        )


def check_output_dir(
    output_dir: str | Path,
    overwrite: bool,
    inputs: Iterable[str | Path | None] = (),
    demo_assets: str | None = None,
) -> Path:
    """Resolve `output_dir` and check that writing there loses nothing; raise `UsageError` if it would.

    Refused: the current directory, one of its parents, the home or root directory; a directory equal
    to, inside or containing one of the stage's `inputs` (a `demo://` input: the demo's whole build in
    the `demo_assets` folder); a non-empty directory unless `overwrite`, and even then one that holds anything
    fitrl did not write (its `.fitrl-output.json` lists what it wrote).
    """
    final = Path(output_dir).expanduser().absolute()
    if len(final.name.encode()) > NAME_MAX - NAME_SUFFIXES:
        raise UsageError(
            f"output directory name {final.name[:24]}... is {len(final.name.encode())} bytes long; file names hold "
            f"{NAME_MAX} and fitrl adds up to {NAME_SUFFIXES} ('.checkpoints', '.partial'): shorten it"
        )
    resolved = final.resolve()
    refuse_shared_dir(final, "output directory", "outputs/<stage>")
    for item in inputs:
        if demo_assets is not None and isinstance(item, str) and demo.is_demo_uri(item):
            item = demo.assets_root(demo_assets)  # every demo asset lives under it
        if item is None or not Path(item).expanduser().exists():  # hub ids are not paths
            continue
        source = Path(item).expanduser().resolve()
        if source == resolved or resolved in source.parents or source in resolved.parents:
            raise UsageError(f"output directory {final} overlaps the stage's input {source}; write somewhere else")
    if final.exists() and not final.is_dir():
        raise UsageError(f"output directory {final} is a file; choose a directory path")
    if final.is_dir() and any(final.iterdir()):
        if not overwrite:
            raise UsageError(f"output directory {final} is not empty; pass --overwrite_output_dir true or pick another")
        _check_replaceable(final)
    # Probed where it would be made, making nothing: a refused run leaves no new (empty) parent folders.
    existing = next(p for p in [final.parent, *final.parent.parents] if p.exists())
    if not existing.is_dir():
        raise UsageError(f"output directory {final} is inside {existing}, which is a file; choose another path")
    try:
        probe = existing / f".{final.name}.write-test-{os.getpid()}"
        probe.mkdir()
        probe.rmdir()
    except OSError as e:
        raise UsageError(f"output directory {final} is not writable ({e.strerror}); choose another path") from None
    return final


def make_parents(directory: Path) -> list[Path]:
    """Make `directory` and its missing parents; the ones made, deepest first (`remove_made`)."""
    missing = [p for p in [directory, *directory.parents] if not p.exists()]
    directory.mkdir(parents=True, exist_ok=True)
    return missing


def remove_made(made: list[Path]) -> None:
    """Remove the folders `make_parents` made, deepest first, while they are empty."""
    for p in made:
        try:
            p.rmdir()
        except OSError:
            return


def _files(directory: Path) -> set[str]:
    """What `directory` holds, as an overwrite must account for it: files, links (to folders too, which
    are not followed) and empty folders."""
    entries = {p for p in directory.rglob("*") if p.is_symlink() or not p.is_dir() or not any(p.iterdir())}
    return {str(p.relative_to(directory)) for p in entries} - {OUTPUT_MARKER}


def _check_replaceable(final: Path) -> None:
    """Overwrite replaces only what fitrl wrote: every file must be listed in the directory's marker."""
    marker = final / OUTPUT_MARKER
    try:
        written = set(json.loads(marker.read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        raise UsageError(
            f"output directory {final} was not written by fitrl (no valid {OUTPUT_MARKER}); "
            "--overwrite_output_dir replaces only fitrl's outputs: pick another output_dir"
        ) from None
    foreign = sorted(_files(final) - written)
    if foreign:
        raise UsageError(
            f"output directory {final} holds {foreign[0]}, which fitrl did not write; move it away or pick another"
        )


def staging_dir(output_dir: str | Path) -> Path:
    """Where `staged_output_dir` stages `output_dir`: what is written there ends up inside the output."""
    final = Path(output_dir).expanduser().absolute()
    return final.parent / f".{final.name}.partial"


@contextmanager
def output_lock(final: Path) -> Iterator[None]:
    """Hold `final`'s lock (`.<name>.lock` beside it) for a run: a second run on the same output is
    refused with one line, instead of sharing its staging directory and mixing both runs' files."""
    import fcntl

    with (final.parent / f".{final.name}.lock").open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(
                f"output directory {final} is in use by another run; wait for it to finish or pick another output_dir"
            ) from None
        yield


@contextmanager
def staged_output_dir(output_dir: str | Path, overwrite: bool = False, stage: str = "") -> Iterator[Path]:
    """Yield a staging directory that replaces `output_dir` only if the block finishes without error.

    The finished directory gets a marker listing the files it holds, so that a later overwrite knows
    what it may delete. Safe under `accelerate launch`: the main process creates, renames or removes;
    all ranks wait.
    """
    state = process_state()
    final = check_output_dir(output_dir, overwrite)
    staging = staging_dir(final)
    made: list[Path] = []
    with contextlib.ExitStack() as held:
        if state.is_main_process:
            made = make_parents(final.parent)
            held.enter_context(output_lock(final))
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir()
        state.wait_for_everyone()
        try:
            yield staging
        except BaseException:
            if state.is_main_process:
                shutil.rmtree(staging, ignore_errors=True)
                held.close()
                if made:  # the lock file in a folder this run made goes with the folder
                    (final.parent / f".{final.name}.lock").unlink(missing_ok=True)
                    remove_made(made)
            raise
        state.wait_for_everyone()
        if state.is_main_process:
            _publish(staging, final, stage)
        state.wait_for_everyone()


def _publish(staging: Path, final: Path, stage: str) -> None:
    """The finished staging directory, with its marker, in place of `final`."""
    marker = {"fitrl_stage": stage, "files": sorted(_files(staging))}
    (staging / OUTPUT_MARKER).write_text(json.dumps(marker, indent=1) + "\n")
    if final.exists():
        if any(final.iterdir()):
            _check_replaceable(final)  # nothing foreign may have appeared while the stage ran
        shutil.rmtree(final)
    staging.rename(final)


class MetricsLog:
    """Append one JSON object per line to `metrics.jsonl` (main process only) and keep them in memory."""

    def __init__(self, directory: str | Path, enabled: bool = True):
        self.path = Path(directory) / METRICS_NAME
        self.enabled = enabled
        self.rows: list[dict[str, Any]] = []

    def log(self, row: dict[str, Any]) -> None:
        row = {k: _json_number(v) for k, v in row.items()}
        self.rows.append(row)
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")

    def rewrite(self) -> None:
        """Write every row again (after one was corrected)."""
        if self.enabled:
            write_jsonl(self.path, self.rows)


def _json_number(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def write_json(path: str | Path, obj: Any) -> None:
    """`obj` as indented JSON that every reader takes: a non-finite number (a spread of one value) is
    written as null, never as the `NaN` most JSON readers refuse."""

    def finite(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: finite(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [finite(x) for x in v]
        return v

    Path(path).write_text(json.dumps(finite(obj), indent=2, allow_nan=False) + "\n")


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file (`metrics.jsonl`, a demo dataset), blank lines skipped."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def write_jsonl(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def markdown_cell(text: str) -> str:
    """`text` safe inside a markdown table cell: pipes escaped, line breaks (`\r` and `\n`, and the other
    control characters a sampled response can hold) as spaces."""
    text = "".join(" " if unicodedata.category(c) == "Cc" else c for c in text)
    return text.replace("|", "\\|")


def plot_curves(
    rows: Sequence[dict[str, Any]], keys: Sequence[str], path: str | Path, title: str, x_key: str = "step"
) -> Path | None:
    """Plot each of `keys` against `x_key` in its own panel; keys absent from every row are skipped.

    With more than a dozen points the raw values are drawn faintly under their rolling mean (`smooth`),
    so that a noisy per-step curve (GRPO's rewards) still shows its trend.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in keys if any(isinstance(r.get(k), (int, float)) for r in rows)]
    if not keys:
        return None
    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.6 * len(keys)), squeeze=False, sharex=True)
    for ax, key in zip(axes[:, 0], keys):
        pts = [(r[x_key], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and x_key in r]
        xs, ys = zip(*pts)
        if len(xs) > 12:
            ax.plot(xs, ys, linewidth=0.8, alpha=0.3, color="C0", label="raw")
            ax.plot(xs, smooth(ys), linewidth=1.6, color="C0", label=f"rolling mean ({smoothing_window(len(ys))})")
            ax.legend(loc="best", fontsize=7, frameon=False)
        else:
            ax.plot(xs, ys, marker=".", linewidth=1.2)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel(x_key)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_histograms(groups: dict[str, Sequence[float]], path: str | Path, xlabel: str, ylabel: str) -> None:
    """One histogram per group, on shared bins, each labelled with its mean."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    values = {name: np.asarray(v, dtype=float) for name, v in groups.items()}
    everything = np.concatenate(list(values.values()))
    bins = np.linspace(everything.min(), everything.max(), 30)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for name, v in values.items():
        ax.hist(v, bins=bins, alpha=0.6, label=f"{name} (mean {v.mean():.2f})")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def smoothing_window(n: int) -> int:
    """Points per rolling mean: a tenth of the curve, at least 3, odd so it centres on its point."""
    window = max(3, n // 10)
    return window + (window % 2 == 0)


def smooth(values: Sequence[float], window: int | None = None) -> list[float]:
    """Centred rolling mean; the ends average over the points they have (no shift, no padding)."""
    window = window or smoothing_window(len(values))
    half = window // 2
    out = []
    for i in range(len(values)):
        part = values[max(0, i - half) : i + half + 1]
        out.append(sum(part) / len(part))
    return out


def metrics_callback(log: MetricsLog, extra: Callable[[], dict[str, Any]] | None = None) -> Any:
    """A transformers `TrainerCallback` that streams every Trainer log line (plus `extra()`) into `log`."""
    from transformers import TrainerCallback

    class _MetricsCallback(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any) -> None:
            if logs and state.is_world_process_zero:
                log.log({"step": state.global_step, **logs, **(extra() if extra else {})})

    return _MetricsCallback()
