"""Dataset loading from local files and the demo, and the errors a user can fix."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fitrl.config import UsageError
from fitrl.data import carved_from, heldout_rows, load_dataset_any, load_text_dataset, load_texts, split_name


def test_local_jsonl_and_csv(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"review": f"text {i}"}) + "\n" for i in range(5)))
    ds = load_text_dataset(str(tmp_path / "a.jsonl"), "train", "review", str(tmp_path))
    assert ds.column_names == ["text"] and len(ds) == 4  # one of the five is held out
    (tmp_path / "b.csv").write_text("text,label\nhello,1\n,0\nworld,0\nlast,1\n")  # the last row is held out
    ds = load_text_dataset(str(tmp_path / "b.csv"), "train", "text", str(tmp_path))
    assert list(ds["text"]) == ["hello", "world"], "empty rows are dropped"


def test_demo_reviews(demo_assets: Path) -> None:
    ds = load_text_dataset("demo://reviews", "train", "text", str(demo_assets), max_samples=10)
    assert len(ds) == 10


def test_texts_read_without_datasets_are_the_datasets_texts(tmp_path: Path, demo_assets: Path) -> None:
    # Row 3 of 5 is the one held out of a single file (`heldout_rows`): "train" reads the other four.
    rows = [{"review": "a good film"}, {"review": "  "}, {"other": 1}, {"review": "held"}, {"review": "bad", "x": 2}]
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
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"review": v}) + "\n" for v in [7, "held", "fine"]))
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


def _rows(path: Path, n: int) -> None:
    path.write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(n)))


@pytest.mark.parametrize("n", [2, 10, 96])
def test_one_data_file_is_carved_into_train_and_held_out_rows_the_same_way_by_every_reader(
    tmp_path: Path, n: int
) -> None:
    """rm, DPO and the evaluations used to report 'held-out' figures on the very rows trained on."""
    _rows(tmp_path / "data.jsonl", n)
    source = str(tmp_path / "data.jsonl")
    train = load_texts(source, "train", "text", "")
    test = load_texts(source, "test", "text", "")
    assert len(test) == max(1, round(n / 10)) and sorted(train + test, key=lambda s: int(s.split()[1])) == [
        f"row {i}" for i in range(n)
    ]
    assert test == [f"row {i}" for i in sorted(heldout_rows(n))]
    # datasets' reader and fitrl's own .jsonl reader carve the same rows; any other split name is held out
    assert list(load_dataset_any(source, "test")["text"]) == test
    assert list(load_dataset_any(source, "train")["text"]) == train
    assert load_texts(source, "validation", "text", "") == test
    assert len(load_dataset_any(source, "train", carve=False)) == n  # SFT evaluates on nothing: every row
    assert split_name(source, "test") == "test: 10% held out of data.jsonl (seed 0)"
    assert carved_from(source, "test") == carved_from(source, "train") == "data.jsonl"
    assert split_name(source, "train") == "train: data.jsonl less the 10% held out of it"


def test_a_folder_split_into_files_gives_each_split_its_file_and_a_missing_split_is_an_error(tmp_path: Path) -> None:
    _rows(tmp_path / "train.jsonl", 4)
    _rows(tmp_path / "test.jsonl", 2)
    assert len(load_texts(str(tmp_path), "train", "text", "")) == 4
    assert len(load_texts(str(tmp_path), "test", "text", "")) == 2
    assert split_name(str(tmp_path), "test") == "test" and carved_from(str(tmp_path), "test") is None
    for loader in (
        lambda: load_texts(str(tmp_path), "validation", "text", ""),
        lambda: load_dataset_any(str(tmp_path), "validation"),
    ):
        with pytest.raises(UsageError) as e:  # it used to read train and test together, without a word
            loader()
        assert str(e.value) == (
            f"dataset {tmp_path} has no split 'validation' (its splits: test, train); set the split setting to "
            "one of them, or add validation.jsonl"
        )
    # A folder whose files name no held-out split is one dataset, carved like one file.
    only_train = tmp_path / "only_train"
    only_train.mkdir()
    _rows(only_train / "train.jsonl", 10)
    assert len(load_texts(str(only_train), "train", "text", "")) == 9
    assert load_texts(str(only_train), "test", "text", "") == ["row 6"]


def test_the_held_out_file_itself_is_read_whole_and_one_row_cannot_be_held_out(tmp_path: Path) -> None:
    _rows(tmp_path / "test.jsonl", 3)
    assert len(load_texts(str(tmp_path / "test.jsonl"), "test", "text", "")) == 3
    _rows(tmp_path / "one.jsonl", 1)
    assert load_texts(str(tmp_path / "one.jsonl"), "train", "text", "") == ["row 0"]
    with pytest.raises(UsageError, match=r"has 1 row\(s\): none can be held out; give more rows, or a folder"):
        load_texts(str(tmp_path / "one.jsonl"), "test", "text", "")
