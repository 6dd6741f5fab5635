"""The files one program writes and another reads back, each defined once as a typed dataclass.

A writer builds the dataclass and calls `write`; every reader (the report, the stages' figures, the
checks of an adapter's base, the evaluations) calls `read`, which checks each field's type and turns a
damaged file into one line naming it. The layouts:

- `run_info.json` (`RunInfo`): what a training stage found and measured (`fitrl.ending`), or a merge
  (`MergeInfo`); a stage's own figures sit beside the common fields (`RunInfo.details`);
- `eval.json` of the sentiment evaluation (`SentimentEval`), of the rm stage (`RMEval`) and of DPO
  (`DPOEval`), both `PairEval`s;
- `summary.json` of the GSM8K evaluation (`GSM8KSummary`).

Key order in the files is the fields' order; a field marked `OMIT_NONE` is left out when it is None.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from fitrl.config import UsageError, first_line
from fitrl.outputs import write_json

OMIT_NONE = {"omit_none": True}  # field metadata: the key is left out when the value is None
FLATTEN = {"flatten": True}  # field metadata: the nested object's keys sit at this level
A = TypeVar("A", bound="Artifact")


class _Bad(Exception):
    pass


def _build(hint: Any, value: Any, where: str) -> Any:
    """`value` (parsed JSON) checked against the type `hint`, dataclasses built."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        return _build(options[0] if len(options) == 1 else Any, value, where)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise _Bad(f"{where} is not an object")
        return _from_dict(hint, value, where)
    if origin is dict:
        if not isinstance(value, dict):
            raise _Bad(f"{where} is not an object")
        return {k: _build(args[1], v, f"{where}.{k}") for k, v in value.items()}
    if origin is list:
        if not isinstance(value, list):
            raise _Bad(f"{where} is not a list")
        return [_build(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
    allowed = (int, float) if hint is float else hint
    if not isinstance(value, allowed) or (hint in (int, float) and isinstance(value, bool)):
        raise _Bad(f"{where} is not {getattr(hint, '__name__', hint)}")
    return value


def _from_dict(cls: type, obj: dict[str, Any], where: str) -> Any:
    hints = typing.get_type_hints(cls)
    values, known = {}, set()
    for f in dataclasses.fields(cls):
        if f.metadata.get("flatten"):
            if hints[f.name] == dict[str, Any]:  # the rest of the object: a stage's own figures
                continue
            values[f.name] = _from_dict(hints[f.name], obj, where)
            known |= {g.name for g in dataclasses.fields(hints[f.name])}
            continue
        known.add(f.name)
        if f.name in obj:
            values[f.name] = _build(hints[f.name], obj[f.name], f"{where}.{f.name}".lstrip("."))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise _Bad(f"it has no '{f.name}'" if not where else f"{where} has no '{f.name}'")
    for f in dataclasses.fields(cls):
        if f.metadata.get("flatten") and hints[f.name] == dict[str, Any]:
            values[f.name] = {k: v for k, v in obj.items() if k not in known}
    return cls(**values)


def to_dict(obj: Any) -> dict[str, Any]:
    """A schema dataclass as the JSON object its file holds (nested ones too), in field order."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.metadata.get("omit_none") and value is None:
            continue
        if dataclasses.is_dataclass(value):
            value = to_dict(value)
        elif isinstance(value, dict):
            value = {k: to_dict(v) if dataclasses.is_dataclass(v) else v for k, v in value.items()}
        if f.metadata.get("flatten"):
            out.update(value)
        else:
            out[f.name] = value
    return out


def _plain(value: Any) -> Any:
    """Paths (a stage's own figures may hold some) as strings."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


class Artifact:
    """A file a program writes into its output directory: `FILE` is its name."""

    FILE: ClassVar[str]

    @classmethod
    def path(cls, directory: str | Path) -> Path:
        return Path(directory) / cls.FILE

    @classmethod
    def read(cls: type[A], directory: str | Path) -> A | None:
        """The file in `directory`, checked field by field (None when there is none)."""
        path = cls.path(directory)
        if not path.is_file():
            return None
        try:
            obj = json.loads(path.read_bytes())
        except (ValueError, OSError) as e:  # UnicodeDecodeError is a ValueError
            raise damaged(path, f"is not JSON ({first_line(e)})") from None
        if not isinstance(obj, dict):
            raise damaged(path, "does not hold a JSON object")
        try:
            return _from_dict(cls, obj, "")
        except _Bad as e:
            raise damaged(path, f"is not a {cls.__name__} ({e})") from None

    def write(self, directory: str | Path) -> Path:
        """The file into `directory` (NaN and infinity written as null)."""
        path = self.path(directory)
        write_json(path, _plain(to_dict(self)))
        return path


def damaged(path: Path, problem: str) -> UsageError:
    return UsageError(f"{path} {problem}; it is damaged: rerun the stage that wrote it (or delete the file)")


def carved_note(split: str | None, carved_from: str | None) -> str:
    """' (the split)' after a held-out figure whose rows were carved out of one dataset, else ''."""
    return f" ({split})" if carved_from else ""


def written_by(directory: str | Path) -> str | None:
    """The stage whose `run_info.json` is in `directory` (None: none is)."""
    info = RunInfo.read(directory)
    return None if info is None else info.stage


@dataclass(frozen=True)
class GuardVerdict:
    """One guard's verdict (`fitrl.guards.Health`): passed, fired (False, at `step`) or not run (None)."""

    passed: bool | None
    saw: str
    step: int | None = field(default=None, metadata=OMIT_NONE)


@dataclass(frozen=True)
class MemoryFigures:
    """The planner's step peak beside what the run measured (`fitrl.memory.memory_report`), in MiB."""

    planned_peak_mb: float | None = None
    device: str | None = None
    measured_peak_mb: float | None = None  # tensors, as the plan counts them
    measured_reserved_mb: float | None = field(default=None, metadata=OMIT_NONE)  # the CUDA allocator's
    peak_rss_mb: float | None = field(default=None, metadata=OMIT_NONE)  # the whole process (CPU runs)


@dataclass(frozen=True)
class RunInfo(Artifact):
    """`run_info.json`: the stage that wrote it, the base it trained on, its memory and guards, then the
    stage's own figures (`details`). A merge's (`MergeInfo`) reads as one too: its stage and details."""

    FILE: ClassVar[str] = "run_info.json"
    stage: str
    resolved_model_path: str | None = None
    world_size: int | None = None
    resumed_from: str | None = None  # the checkpoint the run resumed from
    trainable_parameters: int | None = None
    rank_weight_digests: list[str] = field(default_factory=list)  # one per rank: equal, or the run failed
    memory: MemoryFigures | None = None
    health: dict[str, GuardVerdict] = field(default_factory=dict)
    guard_seconds: float | None = None  # the guards' own work in this process
    details: dict[str, Any] = field(default_factory=dict, metadata=FLATTEN)


@dataclass(frozen=True)
class MergeInfo(Artifact):
    """The merge stage's `run_info.json`: what was merged into what, what it took, and the verification."""

    FILE: ClassVar[str] = "run_info.json"
    stage: str
    base_model: str
    base_path: str
    adapter_dir: str
    method: str
    dtype: str
    adapted_tensors: int
    peak_rss_mb: float
    peak_rss_increase_mb: float
    seconds: float
    verify_max_logit_diff: float | None = field(default=None, metadata=OMIT_NONE)
    verify_tolerance: float | None = field(default=None, metadata=OMIT_NONE)


@dataclass(frozen=True)
class ResponseScores:
    """One side's (policy or reference) rewards on the held-out prompts: their distribution, how many the
    reward calls positive, and the share of response words that are corpus words."""

    mean: float
    std: float | None  # None (null in the file) for one prompt
    p10: float
    p25: float
    median: float
    p75: float
    p90: float
    positive_share: float
    corpus_word_share: float


@dataclass(frozen=True)
class JudgeFigures:
    """The judge's positive share of each side, and its mean verdict in [-1, 1]."""

    model: str
    policy: float
    policy_mean: float
    reference: float
    reference_mean: float


@dataclass(frozen=True)
class SentimentEval(Artifact):
    """The sentiment evaluation's `eval.json`: policy (adapter on) against reference (adapter off) on the
    same held-out prompts, and every sample."""

    FILE: ClassVar[str] = "eval.json"
    n_prompts: int
    adapter_dir: str
    model: str
    policy: ResponseScores
    reference: ResponseScores
    kl_mean: float  # KL(policy || reference) per response, summed over its tokens
    win_rate: float  # the share of prompts whose policy response the reward scores above the reference's
    split: str | None = field(default=None, metadata=OMIT_NONE)  # the prompts' (`fitrl.data.split_name`)
    carved_from: str | None = field(default=None, metadata=OMIT_NONE)  # `fitrl.data.carved_from`
    judge: JudgeFigures | None = field(default=None, metadata=OMIT_NONE)
    samples: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class PairEval(Artifact):
    """A preference stage's `eval.json` begins alike: the held-out split (`fitrl.data.split_name`), its
    pairs, and how often the chosen text wins."""

    FILE: ClassVar[str] = "eval.json"
    split: str
    n_pairs: int
    accuracy: float


@dataclass(frozen=True)
class RMEval(PairEval):
    """The rm stage's: the reward's margins and spread, and every pair's rewards."""

    margin_mean: float
    reward_chosen_mean: float
    reward_rejected_mean: float
    reward_std: float | None  # None (null in the file) for one pair
    pairs: list[dict[str, float]] = field(default_factory=list)
    # How far sigmoid(reward difference) is from how often the labelled text wins (`calibration.png`)
    calibration_error: float | None = field(default=None, metadata=OMIT_NONE)
    carved_from: str | None = field(default=None, metadata=OMIT_NONE)  # `fitrl.data.carved_from`


@dataclass(frozen=True)
class DPOEval(PairEval):
    """DPO's: the implicit reward on held-out pairs (0 at the start)."""

    margin: float
    reward_chosen: float
    reward_rejected: float
    beta: float
    carved_from: str | None = field(default=None, metadata=OMIT_NONE)  # `fitrl.data.carved_from`


@dataclass(frozen=True)
class GSM8KScores:
    """Completions graded: fitrl's accuracy (pass@k of k samples), the format, the harness's two
    extractions, why the rest failed, and each extra reward function's mean (None: it abstained)."""

    accuracy: float
    pass_at_k: float
    format_compliance: float
    k: int
    harness_strict_match: float
    harness_flexible_extract: float
    failures: dict[str, int]
    rewards: dict[str, float | None] | None = field(default=None, metadata=OMIT_NONE)


@dataclass(frozen=True)
class GSM8KSummary(Artifact):
    """The GSM8K evaluation's `summary.json`: what was evaluated, the scores with the adapter, and without
    it (None unless compared)."""

    FILE: ClassVar[str] = "summary.json"
    model: str
    adapter: str | None
    dataset: str
    split: str
    num_fewshot: int
    problems: int
    skipped_non_numeric_gold: int
    dropped_long_prompts: int
    decoding: str
    scores: GSM8KScores = field(metadata=FLATTEN)
    without_adapter: GSM8KScores | None = None
    carved_from: str | None = field(default=None, metadata=OMIT_NONE)  # `fitrl.data.carved_from`
