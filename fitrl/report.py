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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fitrl.config import load_run_info
from fitrl.outputs import METRICS_NAME, read_jsonl

# The directory each stage writes inside a run directory.
STAGE_DIRS = {
    "sft": "sft",
    "merge": "merged",
    "ppo": "ppo",
    "eval": "eval",
    "grpo": "grpo",
    "eval_gsm8k": "eval_gsm8k",
}
PLOTS = {"sft": "loss.png", "ppo": "ppo_curves.png", "eval": "reward_hist.png", "grpo": "grpo_curves.png"}
SAMPLES = {"ppo": "samples.md", "eval": "eval.md", "grpo": "samples.md"}
TIMINGS = "logs/timings.json"


def _metrics(out: Path) -> list[dict[str, Any]]:
    path = out / METRICS_NAME
    return read_jsonl(path) if path.is_file() else []


def _series(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [r[key] for r in rows if isinstance(r.get(key), (int, float))]


def _start_end(values: list[float], span: int = 5) -> tuple[float, float]:
    """Mean of the first and of the last `span` points: the trend, not one noisy step."""
    span = max(1, min(span, len(values) // 4 or 1))
    return sum(values[:span]) / span, sum(values[-span:]) / span


def _memory(out: Path) -> str:
    memory = load_run_info(out).get("memory") or {}
    planned, measured = memory.get("planned_peak_mb"), memory.get("measured_peak_mb")
    if planned is None and measured is None:
        return ""
    parts = [f"planned {planned:.0f} MiB" if planned is not None else "no plan"]
    if measured is not None:
        parts.append(f"measured {measured:.0f} MiB on {memory.get('device', '?')}")
    return "peak memory " + ", ".join(parts)


def _sft(out: Path) -> list[str]:
    losses = _series(_metrics(out), "loss")
    return [f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} logged steps"] if losses else []


def _merge(out: Path) -> list[str]:
    info = load_run_info(out)
    figures = []
    if "peak_rss_mb" in info:
        figures.append(f"peak RAM {info['peak_rss_mb']:.0f} MB ({info.get('method', '?')} merge)")
    if info.get("verify_max_logit_diff") is not None:
        ok = info["verify_max_logit_diff"] <= info.get("verify_tolerance", float("inf"))
        figures.append(
            f"verified: max logit difference {info['verify_max_logit_diff']:.2e} ({'ok' if ok else 'FAILED'})"
        )
    return figures


def _ppo(out: Path) -> list[str]:
    rows = _metrics(out)
    rewards, kls = _series(rows, "env/reward_mean"), _series(rows, "objective/kl")
    if not rewards:
        return []
    start, end = _start_end(rewards)
    return [f"reward {start:.2f} -> {end:.2f} over {len(rewards)} steps", f"KL to the reference {kls[-1]:.2f} nats"]


def _eval(out: Path) -> list[str]:
    path = out / "eval.json"
    if not path.is_file():
        return []
    e = json.loads(path.read_text())
    figures = [
        f"held-out reward {e['reference']['mean']:.2f} (reference) -> {e['policy']['mean']:.2f} (policy) "
        f"on {e['n_prompts']} prompts",
        f"KL {e['kl_mean']:.2f} nats",
    ]
    if "positive_share" in e["policy"]:
        r, p = e["reference"], e["policy"]
        figures.append(f"called positive by the reward model {r['positive_share']:.0%} -> {p['positive_share']:.0%}")
        figures.append(f"corpus words in responses {r['corpus_word_share']:.1%} -> {p['corpus_word_share']:.1%}")
    if "judge" in e:
        j = e["judge"]
        figures.append(f"positive by the judge ({j.get('model', 'judge')}) {j['reference']:.0%} -> {j['policy']:.0%}")
    return figures


def _grpo(out: Path) -> list[str]:
    rows = _metrics(out)
    rewards, accuracy = _series(rows, "reward"), _series(rows, "rewards/accuracy_reward/mean")
    if not rewards:
        return []
    start, end = _start_end(rewards)
    figures = [f"reward {start:.3f} -> {end:.3f} over {len(rewards)} steps"]
    if accuracy:
        a0, a1 = _start_end(accuracy)
        figures.append(f"accuracy reward {a0:.3f} -> {a1:.3f}")
    return figures


def _eval_gsm8k(out: Path) -> list[str]:
    path = out / "summary.json"
    if not path.is_file():
        return []
    s = json.loads(path.read_text())
    base = s.get("without_adapter") or {}
    line = f"accuracy {s['accuracy']:.1%} with the adapter"
    if "accuracy" in base:
        line += f", {base['accuracy']:.1%} without"
    figures = [line + f" ({s['problems']} {s.get('split', '')} problems)"]
    if "format_compliance" in s:
        figures.append(
            f"format compliance {s['format_compliance']:.0%}"
            + (f" (without: {base['format_compliance']:.0%})" if "format_compliance" in base else "")
        )
    return figures


FIGURES: dict[str, Callable[[Path], list[str]]] = {
    "sft": _sft,
    "merge": _merge,
    "ppo": _ppo,
    "eval": _eval,
    "grpo": _grpo,
    "eval_gsm8k": _eval_gsm8k,
}


def figures(stage: str, out: Path) -> list[str]:
    """The stage's key figures, read from its output directory."""
    found = FIGURES[stage](out)
    memory = _memory(out)
    return [*found, memory] if memory else found


def one_line(stage: str, out: Path) -> str:
    found = figures(stage, out)
    return "; ".join(found) if found else "done"


def _timings(run_dir: Path) -> dict[str, float]:
    path = run_dir / TIMINGS
    return json.loads(path.read_text()) if path.is_file() else {}


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _samples(stage: str, out: Path, limit: int = 40) -> str:
    """The stage's samples (markdown), its headings demoted under the stage's own, cut to `limit` lines."""
    path = out / SAMPLES[stage] if stage in SAMPLES else None
    if path is None or not path.is_file():
        return ""
    lines = [re.sub(r"^#+\s*", "### ", line) for line in path.read_text().splitlines()]
    cut = len(lines) > limit
    return "\n".join(lines[:limit]) + (f"\n\n(first {limit} lines of `{path.name}`)" if cut else "")


def markdown(run_dir: Path, stages: list[str], title: str) -> tuple[str, list[Path]]:
    """The report as markdown (images linked relative to the run directory), and the images it shows."""
    timings = _timings(run_dir)
    parts, images = [f"# {title}", ""], []
    for stage in stages:
        out = run_dir / STAGE_DIRS[stage]
        if not out.is_dir():
            parts += [f"## {stage}", "", "not run", ""]
            continue
        parts += [f"## {stage}", ""]
        parts += [f"- {f}" for f in figures(stage, out)]
        if stage in timings:
            parts.append(f"- wall time {_minutes(timings[stage])}")
        parts += ["", f"Output: `{out}`; log: `{run_dir / 'logs' / (stage + '.log')}`", ""]
        plot = out / PLOTS[stage] if stage in PLOTS else None
        if plot is not None and plot.is_file():
            images.append(plot)
            parts += [f"![{stage}]({plot.relative_to(run_dir)})", ""]
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


def _render(kind: str, line: str, run_dir: Path) -> str:
    if kind == "img":
        alt, src = re.fullmatch(r"!\[(.*)\]\((.*)\)", line).groups()
        data = base64.b64encode((run_dir / src).read_bytes()).decode()
        return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'
    if kind == "h":
        level = min(len(line) - len(line.lstrip("#")), 6)
        return f"<h{level}>{html.escape(line.lstrip('#').strip())}</h{level}>"
    if kind == "ul":
        return f"<li>{html.escape(line[2:])}</li>"
    if kind == "table":
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if all(set(c) <= {"-", ":"} for c in cells):  # the header rule
            return ""
        return "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>"
    if kind == "pre":
        return html.escape(line)
    return f"<p>{html.escape(line)}</p>" if kind == "p" else ""


STYLE = (
    "body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;line-height:1.45}"
    "img{max-width:100%}table{border-collapse:collapse;font-size:.9rem}"
    "td{border:1px solid #ccc;padding:.2rem .4rem}pre{background:#f5f5f5;padding:.5rem;overflow-x:auto}"
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


def write(run_dir: str | Path, stages: list[str] | None = None, title: str | None = None) -> tuple[Path, Path]:
    """Write `report.md` and `report.html` into `run_dir` for `stages` (default: every stage it holds)."""
    run_dir = Path(run_dir)
    stages = stages or [s for s, d in STAGE_DIRS.items() if (run_dir / d).is_dir()]
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
