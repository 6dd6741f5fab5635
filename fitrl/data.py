"""Load a dataset from a hub id, local files (jsonl / json / csv / parquet) or the embedded demo.

Every failure a user can fix (missing file, missing column, empty data, no network) becomes one
`UsageError` line.

Splits of local data: a folder with a held-out file (`test.jsonl`, `validation.jsonl`, ...) beside
`train.jsonl` gives each split its own file, and a split it lacks is an error. One file, or a folder of
files that name no held-out split, is one dataset: every stage carves the same held-out share out of
it (`HELDOUT_SHARE` of its rows, drawn with `CARVE_SEED`), so that the `train` split never holds a row
that a held-out split (any other name) holds. `split_name` says which rows a split was.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fitrl import demo
from fitrl.config import UsageError, first_line, offline_note

LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
TRAIN_SPLIT = "train"
HELDOUT_SPLIT = "test"  # what an evaluation reads unless told
HELDOUT_SPLITS = ("test", "validation", "valid", "dev", "heldout")  # file names that split a folder
HELDOUT_SHARE = 0.1
CARVE_SEED = 0


def _data_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.suffix in LOCAL_FORMATS)


def _split_files(directory: Path, split: str) -> list[Path]:
    """The data files of `directory` that `split` names (`test.jsonl` for 'test'), or all of them."""
    files = _data_files(directory)
    return [p for p in files if p.stem == split] or files


def _check_files(path: Path, files: list[Path]) -> None:
    if not files:
        raise UsageError(f"no .jsonl/.json/.csv/.parquet files in {path}")
    if all(p.stat().st_size == 0 for p in files):
        raise UsageError(f"dataset {path} is empty; give a file with at least one row")
    if len({LOCAL_FORMATS[p.suffix] for p in files}) > 1:
        raise UsageError(f"mixed file formats in {path}; keep one format per dataset")


def _local_files(path: Path, split: str, carve: bool) -> tuple[list[Path], str | None]:
    """The files of `split` in a local file or folder, and the part of their rows it is: None (all),
    'train' or 'heldout' (carved: `_carved_rows`)."""
    if path.is_dir():
        files = _data_files(path)
        _check_files(path, files)
        if not carve:
            return _split_files(path, split), None
        splits = sorted({p.stem for p in files} & {TRAIN_SPLIT, *HELDOUT_SPLITS})
        if set(splits) - {TRAIN_SPLIT}:  # a folder split into files: each split is its own file
            named = [p for p in files if p.stem == split]
            if not named:
                raise UsageError(
                    f"dataset {path} has no split '{split}' (its splits: {', '.join(splits)}); set the split "
                    f"setting to one of them, or add {split}{files[0].suffix}"
                )
            return named, None
    else:
        if path.suffix not in LOCAL_FORMATS:
            raise UsageError(f"unsupported data file {path}; use .jsonl, .json, .csv or .parquet")
        files = [path]
        _check_files(path, files)
        if not carve or (split != TRAIN_SPLIT and path.stem == split):  # the held-out file itself
            return files, None
    return files, TRAIN_SPLIT if split == TRAIN_SPLIT else "heldout"


def _source_files(
    source: str, split: str, demo_assets: str, carve: bool = True
) -> tuple[list[Path], str | None] | None:
    """The data files of a demo or local `source` and the part of their rows `split` is (`_local_files`),
    or None for a hub id."""
    if demo.is_demo_uri(source):
        file = demo.resolve(source, demo_assets) / f"{split}.jsonl"
        if not file.is_file():
            raise UsageError(f"demo dataset {source} has no split '{split}'; use train or test")
        return [file], None
    path = Path(source).expanduser()
    if path.exists():
        return _local_files(path, split, carve)
    if source.startswith((".", "/", "~")) or source.count("/") > 1:
        raise UsageError(f"dataset path {source} does not exist; give a local file or directory, or a hub id")
    return None


def heldout_rows(n: int) -> set[int]:
    """The rows of an `n`-row dataset that its held-out splits carve out: `HELDOUT_SHARE` of them (at least
    one when there are two or more), the same for every stage."""
    k = max(1, round(HELDOUT_SHARE * n)) if n >= 2 else 0
    return set(random.Random(CARVE_SEED).sample(range(n), k))


def _carved_rows(n: int, part: str | None, source: str) -> list[int] | None:
    """The row indices of `part` of an `n`-row dataset (None: all rows)."""
    if part is None:
        return None
    held = heldout_rows(n)
    if part != TRAIN_SPLIT and not held:
        raise UsageError(
            f"dataset {source} has {n} row(s): none can be held out; give more rows, or a folder with "
            "train.jsonl and test.jsonl"
        )
    return [i for i in range(n) if (i in held) == (part != TRAIN_SPLIT)]


def _json_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a .jsonl file: every non-blank line one JSON object, at least one of them."""
    rows = []
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UsageError(
                    f"{path} line {number} is not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                    "save the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(f"{path} line {number} is not valid JSON ({e.msg}); fix or remove that row") from None
            if not isinstance(row, dict):
                raise UsageError(f"{path} line {number} is not a JSON object; each line must be one row")
            rows.append(row)
    if not rows:
        raise UsageError(f"dataset {path} has no rows (only blank lines); give a file with at least one row")
    return rows


def load_dataset_any(
    source: str, split: str = "train", demo_assets: str = "", config_name: str | None = None, carve: bool = True
) -> Any:
    """A `datasets.Dataset` for `source`: 'demo://reviews', a local file or directory, or a hub id. One
    local dataset without split files is carved into train and held-out rows unless `carve` is False
    (a stage that evaluates on nothing reads every row)."""
    import datasets

    datasets.disable_progress_bars()
    try:
        found = _source_files(source, split, demo_assets, carve)
        if found is None:
            return datasets.load_dataset(source, config_name, split=split)
        files, part = found
        for p in files:
            if p.suffix == ".jsonl":
                _json_rows(p)  # a bad row as one line naming it, before datasets' own parse error
        ds = datasets.load_dataset(LOCAL_FORMATS[files[0].suffix], data_files=[str(p) for p in files], split="train")
        rows = _carved_rows(len(ds), part, source)
        return ds if rows is None else ds.select(rows)
    except UsageError:
        raise
    except (FileNotFoundError, ValueError, OSError, ConnectionError) as e:
        raise UsageError(f"cannot load dataset {source} split '{split}'{offline_note()}: {first_line(e)}") from None
    except Exception as e:  # datasets wraps parse errors of corrupt files in its own exception types
        raise UsageError(f"cannot read dataset {source}: {type(e).__name__}: {first_line(e)}") from None


def split_name(source: str, split: str, demo_assets: str = "") -> str:
    """The rows a split was read as: a local file's own name (`test.jsonl` is 'test'), a carved split
    with the files it was carved from ('test: 10% held out of pairs.jsonl'), else `split`."""
    path = Path(source).expanduser()
    if demo.is_demo_uri(source) or not path.exists():
        return split
    files, part = _local_files(path, split, carve=True)
    names = "+".join(p.name for p in files)
    if part == TRAIN_SPLIT:
        return f"{split}: {names} less the {HELDOUT_SHARE:.0%} held out of it"
    if part is not None:
        return f"{split}: {HELDOUT_SHARE:.0%} held out of {names} (seed {CARVE_SEED})"
    return "+".join(p.stem for p in files)


def carved_from(source: str, split: str) -> str | None:
    """The files a split was carved out of (`heldout_rows`), or None for a split of its own."""
    path = Path(source).expanduser()
    if demo.is_demo_uri(source) or not path.exists():
        return None
    files, part = _local_files(path, split, carve=True)
    return "+".join(p.name for p in files) if part is not None else None


def check_columns(
    columns: Sequence[str], wanted: Sequence[str], source: str, fix: str = "pick the right column in the config"
) -> None:
    """Raise a `UsageError` naming the first of `wanted` that `columns` lacks, with `fix` as the way out."""
    missing = [c for c in wanted if c not in columns]
    if missing:
        raise UsageError(f"dataset {source} has no column '{missing[0]}' (columns: {', '.join(columns)}); {fix}")


def require_columns(
    dataset: Any, columns: Sequence[str], source: str, fix: str = "pick the right column in the config"
) -> None:
    """Raise a `UsageError` naming the first missing column, with `fix` as the way out, or if it is empty."""
    check_columns(dataset.column_names, columns, source, fix)
    if len(dataset) == 0:
        raise UsageError(f"dataset {source} is empty")


def _is_text(value: Any, min_chars: int) -> bool:
    return isinstance(value, str) and len(value.strip()) >= min_chars


def _no_text(source: str, min_chars: int, column: str) -> UsageError:
    return UsageError(f"dataset {source} has no text of at least {min_chars} characters in '{column}'")


def load_text_dataset(
    source: str, split: str, text_column: str, demo_assets: str, max_samples: int | None = None, min_chars: int = 1
) -> Any:
    """A dataset with one non-empty `text` column, for causal-LM training or PPO prompts."""
    return text_rows(load_dataset_any(source, split, demo_assets), source, text_column, max_samples, min_chars)


def text_rows(ds: Any, source: str, text_column: str, max_samples: int | None = None, min_chars: int = 1) -> Any:
    """`ds` (loaded from `source`) cut to one `text` column of texts of at least `min_chars` characters."""
    require_columns(ds, [text_column], source)
    ds = ds.select_columns([text_column])
    if text_column != "text":
        ds = ds.rename_column(text_column, "text")
    ds = ds.filter(lambda r: _is_text(r["text"], min_chars))
    if len(ds) == 0:
        raise _no_text(source, min_chars, text_column)
    if max_samples is not None:
        ds = ds.select(range(min(max_samples, len(ds))))
    return ds


def load_column(source: str, split: str, column: str, demo_assets: str, carve: bool = True) -> list[Any]:
    """Every row's value in `column` (None where a .jsonl row lacks it). .jsonl files (the demo's too) are
    read here, without importing `datasets` (76 MB of a PPO process's memory and most of a second of its
    start-up)."""
    try:
        found = _source_files(source, split, demo_assets, carve)
        if found is None or any(p.suffix != ".jsonl" for p in found[0]):
            ds = load_dataset_any(source, split, demo_assets, carve=carve)
            require_columns(ds, [column], source)
            return list(ds[column])
        rows = [row for p in found[0] for row in _json_rows(p)]
        carved = _carved_rows(len(rows), found[1], source)
        rows = rows if carved is None else [rows[i] for i in carved]
    except OSError as e:
        raise UsageError(f"cannot read dataset {source}: {first_line(e)}") from None
    check_columns(list(dict.fromkeys(key for row in rows for key in row)), [column], source)
    return [row.get(column) for row in rows]


def load_texts(
    source: str, split: str, text_column: str, demo_assets: str, max_samples: int | None = None, min_chars: int = 1
) -> list[str]:
    """The texts of `text_column` with at least `min_chars` characters, the first `max_samples` of them."""
    return texts_in(load_column(source, split, text_column, demo_assets), source, text_column, max_samples, min_chars)


def texts_in(
    values: list[Any], source: str, text_column: str, max_samples: int | None = None, min_chars: int = 1
) -> list[str]:
    """The texts among a column's `values` (`load_texts`, for a column already read)."""
    texts = [v for v in values if _is_text(v, min_chars)]
    if not texts:
        raise _no_text(source, min_chars, text_column)
    return texts[:max_samples]
