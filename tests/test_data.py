"""Dataset loading from local files and the demo, and the errors a user can fix."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fitrl.config import UsageError
from fitrl.data import load_text_dataset, load_texts


def test_local_jsonl_and_csv(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"review": f"text {i}"}) + "\n" for i in range(5)))
    ds = load_text_dataset(str(tmp_path / "a.jsonl"), "train", "review", str(tmp_path))
    assert ds.column_names == ["text"] and len(ds) == 5
    (tmp_path / "b.csv").write_text("text,label\nhello,1\n,0\nworld,0\n")
    ds = load_text_dataset(str(tmp_path / "b.csv"), "train", "text", str(tmp_path))
    assert list(ds["text"]) == ["hello", "world"], "empty rows are dropped"


def test_demo_reviews(demo_assets: Path) -> None:
    ds = load_text_dataset("demo://reviews", "train", "text", str(demo_assets), max_samples=10)
    assert len(ds) == 10


def test_texts_read_without_datasets_are_the_datasets_texts(tmp_path: Path, demo_assets: Path) -> None:
    rows = [{"review": "a good film"}, {"review": "  "}, {"other": 1}, {"review": "bad", "x": 2}]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    for source, column, min_chars, limit in [
        (str(tmp_path / "a.jsonl"), "review", 1, None),
        (str(tmp_path / "a.jsonl"), "review", 4, None),
        ("demo://reviews", "text", 60, 50),
    ]:
        expected = list(load_text_dataset(source, "train", column, str(demo_assets), limit, min_chars)["text"])
        assert load_texts(source, "train", column, str(demo_assets), limit, min_chars) == expected
    assert load_texts(str(tmp_path / "a.jsonl"), "train", "review", str(tmp_path)) == ["a good film", "bad"]
    # datasets refuses a column of mixed types (one line of pyarrow); a non-text value is no text
    (tmp_path / "b.jsonl").write_text(json.dumps({"review": 7}) + "\n" + json.dumps({"review": "fine"}) + "\n")
    assert load_texts(str(tmp_path / "b.jsonl"), "train", "review", str(tmp_path)) == ["fine"]


def test_jsonl_texts_do_not_import_datasets(tmp_path: Path) -> None:
    """PPO reads its prompts through `load_texts`; `datasets` would add 76 MB to its process."""
    (tmp_path / "p.jsonl").write_text(json.dumps({"text": "a prompt"}) + "\n")
    code = (
        "import sys; from fitrl.data import load_texts; "
        f"print(load_texts({str(tmp_path / 'p.jsonl')!r}, 'train', 'text', '.'), 'datasets' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["['a", "prompt']", "False"]


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
@pytest.mark.parametrize("loader", [load_text_dataset, load_texts])
def test_bad_data_is_a_usage_error(tmp_path: Path, setup, column: str, message: str, loader) -> None:
    setup(tmp_path)
    name = "d.txt" if message == "unsupported data file" else "d.jsonl"
    source = str(tmp_path / name) if message != "does not exist" else "./missing/data.jsonl"
    with pytest.raises(UsageError, match=message):
        loader(source, "train", column, str(tmp_path))
