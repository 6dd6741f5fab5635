"""PPO's prompts (`fitrl.tasks.sentiment.build_queries`): whole texts, chats in a chat template, the IMDB
prefix shaping, a real length limit, and every row not used counted."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from fitrl.config import UsageError
from fitrl.tasks.sentiment import PromptArguments, build_queries

CUE = "Answer:\n"  # the end of the plain template's prompt: the assistant's cue


def _tokenizer(demo_assets: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_assets / "lm")


def _file(tmp_path: Path, rows: list[dict]) -> str:
    """The rows as the train split of a folder with a held-out file too: read whole (one file alone would
    have a share held out, `fitrl.data`)."""
    folder = tmp_path / "prompts"
    folder.mkdir(exist_ok=True)
    for split in ("train", "test"):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(folder)


def _chat(question: str) -> dict:
    return {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}]}


def test_chats_render_up_to_the_assistants_cue_and_long_ones_are_dropped_or_cut(
    tmp_path: Path, demo_assets: Path
) -> None:
    tokenizer = _tokenizer(demo_assets)
    long_question = "the film was " * 40
    source = _file(tmp_path, [_chat("Was it good?"), _chat(long_question), _chat("Who won?"), {"messages": None}])
    args = PromptArguments(dataset=source, text_column="messages", max_prompt_tokens=32)
    queries = build_queries(tokenizer, args, str(tmp_path), seed=0)
    assert queries.plain_template and queries.chat
    assert (len(queries), queries.rows, queries.short, queries.long, queries.cut) == (2, 4, 1, 1, 0)
    first = tokenizer.decode(queries.ids[0])
    assert first == "Be brief.\n\nQuestion: Was it good?\n" + CUE
    assert "dropped: over 32 tokens" in queries.summary(args) and "no chat template" in queries.summary(args)

    cut = build_queries(tokenizer, replace(args, prompt_overflow="left_truncate"), str(tmp_path), seed=0)
    assert (len(cut), cut.long, cut.cut) == (3, 0, 1)
    assert len(cut.ids[1]) == 32 and tokenizer.decode(cut.ids[1]).endswith(CUE)  # the end kept: the cue

    mine = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    queries = build_queries(tokenizer, replace(args, chat_template=mine), str(tmp_path), seed=0)
    assert not queries.plain_template
    assert tokenizer.decode(queries.ids[0]) == "<system>Be brief.<user>Was it good?<assistant>"


def test_whole_texts_and_the_imdb_prefix_shaping(tmp_path: Path, demo_assets: Path) -> None:
    tokenizer = _tokenizer(demo_assets)
    texts = ["A quiet film about a lighthouse keeper.", "Short.", "Another film, loud and long."]
    source = _file(tmp_path, [{"text": t} for t in texts])
    whole = build_queries(tokenizer, PromptArguments(dataset=source, min_prompt_chars=6), str(tmp_path), seed=0)
    assert [tokenizer.decode(q) for q in whole.ids] == [texts[0], texts[2]] and whole.short == 1

    args = PromptArguments(dataset=source, prompt_shaping="prefix", query_min_tokens=2, query_max_tokens=5)
    prefix = build_queries(tokenizer, args, str(tmp_path), seed=7)
    rng = random.Random(7)  # one length drawn per text, in order: the seed's shaping, unchanged
    expected = [tokenizer(t, add_special_tokens=False).input_ids[: rng.randint(2, 5)] for t in texts]
    assert prefix.ids == expected


@pytest.mark.parametrize(
    ("rows", "extra", "message"),
    [
        ([{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hey"}]}], {},
         "row 1 of column 'messages' ends with the assistant's turn"),
        ([_chat("fine"), {"messages": [{"role": "user"}]}], {}, "row 2 of column 'messages' is not a chat"),
        ([_chat("fine")], {"prompt_shaping": "prefix"}, "holds chats, which prompt_shaping prefix cannot cut"),
        ([_chat("fine")], {"chat_template": "my_template.jinja"}, "is neither a file nor a Jinja template"),
        ([_chat("fine")], {"max_prompt_tokens": 4}, "gives no prompts: 0 prompts from 1 chats"),
        ([{"prompt": "hi"}], {}, "has no column 'messages' (columns: prompt)"),
    ],
)  # fmt: skip
def test_prompt_rows_a_stage_cannot_use_are_one_line(
    tmp_path: Path, demo_assets: Path, rows: list[dict], extra: dict, message: str
) -> None:
    args = PromptArguments(dataset=_file(tmp_path, rows), text_column="messages", **extra)
    with pytest.raises(UsageError, match="^") as raised:
        build_queries(_tokenizer(demo_assets), args, str(tmp_path), seed=0)
    assert message in str(raised.value) and "\n" not in str(raised.value)
