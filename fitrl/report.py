"""What a run achieved: one line per stage for the console, and `report.md` / `report.html` for the run.

Everything is read back from what the stages wrote (`metrics.jsonl`, `run_info.json`, `eval.json`,
`summary.json`, their plots and samples), so a report can be rebuilt at any time:

    python -m fitrl.report outputs/demo          # rewrite outputs/demo/report.md and report.html
"""

from __future__ import annotations

import base64
import html
import json
import re
import sys
from pathlib import Path

from fitrl.artifacts import GuardVerdict, MemoryFigures, RunInfo
from fitrl.reward import probes
from fitrl.stages import STAGES, Stage, get

TIMINGS = "logs/timings.json"


def _run_memory(out: Path) -> MemoryFigures:
    info = RunInfo.read(out) if out.is_dir() else None
    return (info and info.memory) or MemoryFigures(None)


def _run_health(out: Path) -> dict[str, GuardVerdict]:
    info = RunInfo.read(out)
    return {} if info is None else info.health


def _run_details(out: Path) -> dict:
    info = RunInfo.read(out)
    return {} if info is None else info.details


def _step(v: GuardVerdict) -> str:
    return "?" if v.step is None else str(v.step)


def _memory(out: Path) -> str:
    memory = _run_memory(out)
    planned, measured = memory.planned_peak_mb, memory.measured_peak_mb
    if planned is None and measured is None:
        return ""
    parts = [f"planned {planned:.0f} MiB" if planned is not None else "no plan"]
    if measured is not None:
        parts.append(f"measured {measured:.0f} MiB on {memory.device or '?'}")
    return "peak memory " + ", ".join(parts) + " (tensors)"


def _health(out: Path) -> str:
    """What the guards saw (`fitrl.guards`): each one that fired with its step and numbers, or that all passed."""
    health = _run_health(out)
    fired = [f"guard {k} fired at step {_step(v)}: {v.saw}" for k, v in health.items() if v.passed is False]
    if fired:
        return "; ".join(fired)
    passed = [k for k, v in health.items() if v.passed]
    skipped = [f"{k} ({v.saw.removeprefix('not run: ')})" for k, v in health.items() if v.passed is None]
    parts = [f"guards passed: {', '.join(passed)}"] if passed else []
    return "; ".join(parts + ([f"not run: {', '.join(skipped)}"] if skipped else []))


def figures(stage: Stage, out: Path) -> list[str]:
    """The stage's key figures, read from its output directory, then its memory and health."""
    return [line for line in [*stage.figures(out), _memory(out), _health(out)] if line]


def one_line(stage: Stage, out: Path) -> str:
    found = figures(stage, out)
    return "; ".join(found) if found else "done"


def read_timings(run_dir: Path) -> dict[str, float]:
    """Each stage's seconds from the run's `logs/timings.json`; a damaged file (a run killed while writing
    it, before writes were atomic) starts afresh rather than failing every later run."""
    path = run_dir / TIMINGS
    if not path.is_file():
        return {}
    try:
        timings = json.loads(path.read_bytes())
    except (ValueError, OSError):
        timings = None
    if not isinstance(timings, dict) or not all(isinstance(v, (int, float)) for v in timings.values()):
        print(f"note: {path} was damaged; the stage timings start afresh", file=sys.stderr)
        return {}
    return timings


def write_timings(run_dir: Path, timings: dict[str, float]) -> None:
    path = run_dir / TIMINGS
    staging = path.with_name(path.name + ".partial")
    staging.write_text(json.dumps(timings, indent=2) + "\n")
    staging.replace(path)


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _samples(stage: Stage, out: Path, limit: int = 40) -> str:
    """The stage's samples (markdown), its headings demoted under the stage's own, cut to `limit` lines."""
    path = out / stage.samples if stage.samples else None
    if path is None or not path.is_file():
        return ""
    lines = [re.sub(r"^#+\s*", "### ", line) for line in path.read_text().splitlines()]
    cut = len(lines) > limit
    return "\n".join(lines[:limit]) + (f"\n\n(first {limit} lines of `{path.name}`)" if cut else "")


def side_by_side(run_dir: Path, stages: list[Stage], timings: dict[str, float]) -> list[str]:
    """One evaluation of several policies (PPO's, DPO's) as a table, a row per policy: its figures, and
    the training stage's wall time and planned and measured peaks. Empty unless two or more ran."""
    rows = []
    for stage in stages:
        out = run_dir / stage.output_dir
        cells = stage.side_by_side(out) if stage.side_by_side and out.is_dir() else {}
        if not cells:
            continue
        trained_by = stage.reads[1] if stage.reads else stage.name
        trained = run_dir / get(trained_by).output_dir
        memory = _run_memory(trained)
        planned, measured = memory.planned_peak_mb, memory.measured_peak_mb
        cells["training time"] = _minutes(timings[trained_by]) if trained_by in timings else "?"
        cells["peak MiB planned / measured"] = " / ".join("?" if v is None else f"{v:.0f}" for v in (planned, measured))
        rows.append((f"{trained_by} ({stage.name})", cells))
    if len(rows) < 2:
        return []
    columns = list(dict.fromkeys(c for _name, cells in rows for c in cells))
    lines = ["## side by side", "", "| policy | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(cells.get(c, "") for c in columns) + " |" for name, cells in rows]
    return [*lines, ""]


def _guards_cell(out: Path) -> str:
    health = _run_health(out)
    fired = [f"{k} (step {_step(v)})" for k, v in health.items() if v.passed is False]
    if fired:
        return "fired: " + ", ".join(fired)
    skipped = sum(v.passed is None for v in health.values())
    passed = f"all {len(health) - skipped} passed" if len(health) > skipped else ""
    return ", ".join(p for p in [passed, f"{skipped} not run" if skipped else ""] if p)


def summary(run_dir: Path, stages: list[Stage], timings: dict[str, float]) -> list[str]:
    """The first page: a row per stage that ran, its key result, guards, wall time and memory (planned and
    measured step peaks, the figures the console's done line and `run_info.json` give)."""
    lines = ["## summary", "", "| stage | key result | guards | wall time | peak MiB planned / measured |"]
    lines.append("|---|---|---|---|---|")
    for stage in stages:
        out = run_dir / stage.output_dir
        if not out.is_dir():
            continue
        found = stage.figures(out)
        memory = _run_memory(out)
        peaks = [memory.planned_peak_mb, memory.measured_peak_mb]
        peak = " / ".join("-" if v is None else f"{v:.0f}" for v in peaks) if any(v is not None for v in peaks) else ""
        wall = _minutes(timings[stage.name]) if stage.name in timings else ""
        lines.append(f"| {stage.name} | {found[0] if found else 'done'} | {_guards_cell(out)} | {wall} | {peak} |")
    return [*lines, ""] if len(lines) > 2 else []


def markdown(run_dir: Path, stages: list[Stage], title: str) -> tuple[str, list[Path]]:
    """The report as markdown (images linked relative to the run directory), and the images it shows."""
    timings = read_timings(run_dir)
    first_page = [*summary(run_dir, stages, timings), *side_by_side(run_dir, stages, timings)]
    parts, images = [f"# {title}", "", *first_page], []
    for stage in stages:
        out = run_dir / stage.output_dir
        if not out.is_dir():
            parts += [f"## {stage.name}", "", "not run", ""]
            continue
        parts += [f"## {stage.name}", ""]
        parts += [f"- {f}" for f in figures(stage, out)]
        if stage.name in timings:
            parts.append(f"- wall time {_minutes(timings[stage.name])}")
        parts += ["", f"Output: `{out}`; log: `{run_dir / 'logs' / (stage.name + '.log')}`", ""]
        parts += probes.table(_run_details(out))
        for name in [*([stage.plot] if stage.plot else []), *stage.more_plots]:
            plot = out / name
            if plot.is_file():
                images.append(plot)
                alt = stage.name if name == stage.plot else f"{stage.name}: {plot.stem}"
                parts += [f"![{alt}]({plot.relative_to(run_dir)})", ""]
        samples = _samples(stage, out)
        if samples:
            parts += [samples, ""]
    return "\n".join(parts), images


def _kind(line: str, open_block: str | None) -> str:
    """Which block a markdown line belongs to: pre (a code fence or inside one), img, h, ul, table, p, blank."""
    if line.startswith("```") or open_block == "pre":
        return "pre"
    if re.fullmatch(r"!\[(.*)\]\((.*)\)", line):
        return "img"
    for prefix, kind in [("#", "h"), ("- ", "ul"), ("|", "table")]:
        if line.startswith(prefix):
            return kind
    return "p" if line.strip() else "blank"


def _inline(text: str) -> str:
    """Escaped text with its code spans (`...`) as <code>."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))


def _render(kind: str, line: str, run_dir: Path) -> str:
    if kind == "img":
        alt, src = re.fullmatch(r"!\[(.*)\]\((.*)\)", line).groups()
        data = base64.b64encode((run_dir / src).read_bytes()).decode()
        return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'
    if kind == "h":
        level = min(len(line) - len(line.lstrip("#")), 6)
        return f"<h{level}>{_inline(line.lstrip('#').strip())}</h{level}>"
    if kind == "ul":
        return f"<li>{_inline(line[2:])}</li>"
    if kind == "table":
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if all(set(c) <= {"-", ":"} for c in cells):  # the header rule
            return ""
        return "<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in cells) + "</tr>"
    if kind == "pre":
        return html.escape(line)
    return f"<p>{_inline(line)}</p>" if kind == "p" else ""


STYLE = (
    "body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;line-height:1.45}"
    "img{max-width:100%}table{border-collapse:collapse;font-size:.9rem}"
    "td{border:1px solid #ccc;padding:.2rem .4rem}pre{background:#f5f5f5;padding:.5rem;overflow-x:auto}"
    "code{background:#f5f5f5;padding:0 .2rem}"
)


def _html(md: str, run_dir: Path) -> str:
    """One self-contained page: headings, lists, tables, code, and the images inlined as base64."""
    body: list[str] = []
    open_block: str | None = None  # the enclosing element a run of lines shares: ul, table or pre
    for line in md.splitlines():
        kind = _kind(line, open_block)
        fence = line.startswith("```")
        if open_block is not None and (kind != open_block or (fence and open_block == "pre")):
            body.append(f"</{open_block}>")
            open_block = None
            if fence:
                continue
        if kind in ("ul", "table", "pre") and open_block is None:
            body.append(f"<{kind}>")
            open_block = kind
            if fence:
                continue
        body.append(_render(kind, line, run_dir))
    if open_block is not None:
        body.append(f"</{open_block}>")
    head = f"<!doctype html><meta charset='utf-8'><title>fitrl report</title><style>{STYLE}</style>"
    return "\n".join([head, *filter(None, body)])


def write(run_dir: str | Path, stages: list[Stage] | None = None, title: str | None = None) -> tuple[Path, Path]:
    """Write `report.md` and `report.html` into `run_dir` for `stages` (default: every stage it holds)."""
    run_dir = Path(run_dir)
    stages = stages or [s for s in STAGES if (run_dir / s.output_dir).is_dir()]
    md, _images = markdown(run_dir, stages, title or f"fitrl run: {run_dir}")
    (run_dir / "report.md").write_text(md + "\n")
    (run_dir / "report.html").write_text(_html(md, run_dir) + "\n")
    return run_dir / "report.md", run_dir / "report.html"


if __name__ == "__main__":
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        print("usage: python -m fitrl.report RUN_DIR", file=sys.stderr)
        raise SystemExit(2)
    for path in write(sys.argv[1]):
        print(path)
