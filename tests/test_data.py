"""Dataset loading from local files and the demo, and the errors a user can fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fitrl.config import UsageError
from fitrl.data import load_text_dataset


def test_local_jsonl_and_csv(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"review": f"text {i}"}) + "\n" for i in range(5)))
    ds = load_text_dataset(str(tmp_path / "a.jsonl"), "train", "review", str(tmp_path))
    assert ds.column_names == ["text"] and len(ds) == 5
    (tmp_path / "b.csv").write_text("text,label\nhello,1\n,0\nworld,0\n")
    ds = load_text_dataset(str(tmp_path / "b.csv"), "train", "text", str(tmp_path))
    assert list(ds["text"]) == ["hello", "world"], "empty rows are dropped"


def test_demo_reviews(demo_cache: Path) -> None:
    ds = load_text_dataset("demo://reviews", "train", "text", str(demo_cache), max_samples=10)
    assert len(ds) == 10


@pytest.mark.parametrize(
    ("setup", "column", "message"),
    [
        (lambda p: None, "text", "does not exist"),
        (lambda p: (p / "d.jsonl").write_text('{"body": "x"}\n'), "text", "has no column 'text'"),
        (lambda p: (p / "d.jsonl").write_text('{"text": ""}\n'), "text", "has no text"),
        (
            lambda p: (p / "d.jsonl").write_text('{"text": "a fine row"}\n{not json\n'),
            "text",
            "line 2 is not valid JSON",
        ),
        (lambda p: (p / "d.jsonl").write_text("\n  \n\n"), "text", "has no rows"),
        (lambda p: (p / "d.txt").write_text("x"), "text", "unsupported data file"),
    ],
)
def test_bad_data_is_a_usage_error(tmp_path: Path, setup, column: str, message: str) -> None:
    setup(tmp_path)
    name = "d.txt" if message == "unsupported data file" else "d.jsonl"
    source = str(tmp_path / name) if message != "does not exist" else "./missing/data.jsonl"
    with pytest.raises(UsageError, match=message):
        load_text_dataset(source, "train", column, str(tmp_path))
