"""The embedded demo: everything the `demo` profile needs, built from a seed with no network.

`build(cache_dir)` makes, once, into `cache_dir/v<VERSION>-seed<seed>/`:

- `reviews/{train,test}.jsonl`: the project's own movie reviews (`text`, `label` 0=neg 1=pos);
- `arithmetic/{train,test}.jsonl`: word problems in GSM8K's format (`question`, `answer` ending
  in `#### <number>`);
- `lm/`: a tiny random-init GPT-NeoX (the gpt-neox-20b family) with a byte-level BPE tokenizer
  trained on those texts;
- `reasoner/`: that LM after a short SFT on worked arithmetic in GRPO's `<reasoning>`/`<answer>`
  format, with a plain chat template: the GRPO demo's starting point;
- `classifier/`: a tiny DistilBERT sentiment classifier with its own WordPiece tokenizer, trained on
  the reviews: the demo's reward model (labels NEGATIVE / POSITIVE, like lvwerra/distilbert-imdb).

Stages name them with `demo://lm`, `demo://reasoner`, `demo://classifier`, `demo://reviews`, `demo://arithmetic`.
"""

from __future__ import annotations

import json
import random
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

from fitrl.config import UsageError

VERSION = 2
DEFAULT_SEED = 1234
N_REVIEWS = 2400
N_TEST_REVIEWS = 400
N_PROBLEMS = 2000
N_TEST_PROBLEMS = 300
ASSETS = {
    "lm": "lm",
    "reasoner": "reasoner",
    "classifier": "classifier",
    "reviews": "reviews",
    "arithmetic": "arithmetic",
}
MANIFEST = "manifest.json"
PRETRAIN_STEPS = 40
REASONER_STEPS = 100
REASONER_LR = 3e-3
REASONER_PROBLEMS = 850

# --- the review corpus -------------------------------------------------------------------------

_TITLE_A = "Silent Broken Golden Last Hidden Crimson Endless Paper Midnight Distant Iron Quiet Frozen Wild".split()
_TITLE_B = "Harbor Garden Letters Horizon Kingdom Road Winter Mirror Promise River Engine Summer Orchard".split()
_FIRST = "Anna Marco Priya Tom Lena Omar Grace Felix Nadia Owen Sofia Ravi Clara Jonas Maya Ivan".split()
_LAST = "Keller Duarte Nakamura Brooks Varga Okafor Lindqvist Moreau Patel Rossi Haddad Novak".split()
_GENRES = ["drama", "thriller", "comedy", "romance", "western", "war film", "mystery", "science fiction film"]
_ROLES = [
    "a retired detective",
    "a young teacher",
    "a lonely pilot",
    "an estranged sister",
    "a small-town mayor",
    "a jazz pianist",
    "a runaway soldier",
    "an ambitious chef",
    "a grieving father",
    "a stubborn farmer",
]
_PLOTS = [
    "returns home after twenty years",
    "tries to save a failing business",
    "uncovers an old family secret",
    "crosses the country by train",
    "falls for a rival",
    "hunts for a missing friend",
    "prepares for one last competition",
    "hides from a dangerous past",
]
_PLACES = [
    "a fishing village",
    "post-war Berlin",
    "a desert town",
    "a crowded hospital",
    "a mountain hotel",
    "a Paris suburb",
    "a lighthouse",
    "a failing circus",
]
_ASPECTS = [
    "the acting",
    "the script",
    "the soundtrack",
    "the cinematography",
    "the pacing",
    "the ending",
    "the dialogue",
    "the lead performance",
    "the direction",
    "the plot",
    "the editing",
    "the cast",
]
_POS_ADJ = [
    "wonderful",
    "superb",
    "moving",
    "brilliant",
    "gripping",
    "charming",
    "clever",
    "delightful",
    "stunning",
    "heartfelt",
    "excellent",
    "beautiful",
    "funny",
    "powerful",
    "memorable",
]
_NEG_ADJ = [
    "dull",
    "clumsy",
    "tedious",
    "awful",
    "lifeless",
    "predictable",
    "messy",
    "boring",
    "forgettable",
    "painful",
    "weak",
    "terrible",
    "flat",
    "confusing",
    "annoying",
]
_INTENSIFIERS = ["", "", "truly ", "really ", "simply ", "quite ", "absolutely "]
_POS_VERDICTS = [
    "I would happily watch it again.",
    "Highly recommended.",
    "A real gem.",
    "One of the best films of the year.",
    "I loved every minute of it.",
    "Go and see it.",
    "It stayed with me for days.",
    "A joy from start to finish.",
]
_NEG_VERDICTS = [
    "I want my two hours back.",
    "Skip this one.",
    "A complete waste of time.",
    "One of the worst films of the year.",
    "I nearly walked out.",
    "Avoid it.",
    "I forgot it the moment it ended.",
    "A chore from start to finish.",
]


def _neutral(rng: random.Random, title: str) -> str:
    director = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
    actor = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
    options = [
        f"{title} is a {rng.choice(_GENRES)} directed by {director}.",
        f"{actor} plays {rng.choice(_ROLES)} who {rng.choice(_PLOTS)}.",
        f"The story follows {rng.choice(_ROLES)} in {rng.choice(_PLACES)}.",
        f"It runs about {rng.randrange(85, 170, 5)} minutes.",
        f"I saw {title} on a {rng.choice(['Sunday', 'rainy evening', 'long flight', 'Friday night'])}.",
    ]
    return rng.choice(options)


def _opinion(rng: random.Random, positive: bool) -> str:
    """One sentence whose sentiment is `positive`; some say it through a negation, so words alone mislead."""
    aspect = rng.choice(_ASPECTS)
    aspect = aspect[0].upper() + aspect[1:]
    kind = rng.random()
    if kind < 0.6:
        adj = rng.choice(_POS_ADJ if positive else _NEG_ADJ)
        return f"{aspect} was {rng.choice(_INTENSIFIERS)}{adj}."
    if kind < 0.8:  # "not <opposite>"
        adj = rng.choice(_NEG_ADJ if positive else _POS_ADJ)
        return f"{aspect} was {rng.choice(['not', 'never', 'not at all'])} {adj}."
    if positive:
        return f"I {rng.choice(['loved', 'enjoyed', 'admired', 'adored'])} {aspect.lower()}."
    return f"I {rng.choice(['hated', 'disliked', 'could not stand', 'was bored by'])} {aspect.lower()}."


def make_review(rng: random.Random, positive: bool) -> str:
    title = f"The {rng.choice(_TITLE_A)} {rng.choice(_TITLE_B)}"
    parts = [_neutral(rng, title)]
    if rng.random() < 0.5:
        parts.append(_neutral(rng, title))
    n_major = rng.randint(2, 3)
    n_minor = 1 if rng.random() < 0.35 else 0
    opinions = [_opinion(rng, positive) for _ in range(n_major)] + [_opinion(rng, not positive)] * n_minor
    rng.shuffle(opinions)
    parts += opinions
    if rng.random() < 0.7:
        parts.append(rng.choice(_POS_VERDICTS if positive else _NEG_VERDICTS))
    return " ".join(parts)


def make_reviews(seed: int, n: int = N_REVIEWS) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"text": make_review(rng, bool(i % 2)), "label": i % 2} for i in range(n)]


# --- the arithmetic word problems ----------------------------------------------------------------

_NAMES = ["Mia", "Leo", "Ava", "Sam", "Zoe", "Ben", "Ivy", "Max", "Ella", "Noah", "Lily", "Omar"]
_ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "stamps", "shells"]


def make_problem(rng: random.Random) -> dict[str, str]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    kind = rng.choice(["add", "sub", "mul", "add_sub"])
    a, b = rng.randint(2, 20), rng.randint(2, 12)
    if kind == "add":
        q = f"{name} has {a} {item}. {name} gets {b} more. How many {item} does {name} have now?"
        steps, result = [f"{name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {item}."], a + b
    elif kind == "sub":
        a = a + b
        q = f"{name} has {a} {item} and gives away {b}. How many {item} are left?"
        steps, result = [f"{name} has {a} - {b} = <<{a}-{b}={a - b}>>{a - b} {item} left."], a - b
    elif kind == "mul":
        a = rng.randint(2, 9)
        q = f"{name} buys {a} boxes with {b} {item} in each box. How many {item} does {name} buy?"
        steps, result = [f"{name} buys {a} * {b} = <<{a}*{b}={a * b}>>{a * b} {item}."], a * b
    else:
        c = rng.randint(1, a + b - 1)
        q = f"{name} has {a} {item}, finds {b} more and then loses {c}. How many {item} does {name} have?"
        s = a + b
        steps = [
            f"After finding some, {name} has {a} + {b} = <<{a}+{b}={s}>>{s} {item}.",
            f"After losing some, {name} has {s} - {c} = <<{s}-{c}={s - c}>>{s - c} {item}.",
        ]
        result = s - c
    return {"question": q, "answer": "\n".join(steps) + f"\n#### {result}"}


def make_problems(seed: int, n: int = N_PROBLEMS) -> list[dict[str, str]]:
    rng = random.Random(seed + 1)
    return [make_problem(rng) for _ in range(n)]


# --- building and caching -------------------------------------------------------------------------


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _train_lm_tokenizer(texts: list[str], out_dir: Path) -> Any:
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        texts, vocab_size=1024, min_frequency=2, special_tokens=["<|endoftext|>"], show_progress=False
    )
    # No pad token on purpose: like gpt-neox-20b's tokenizer, so the loader's pad fallback is exercised.
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        model_max_length=256,
    )
    tok.save_pretrained(out_dir)
    return tok


def _build_lm(tok: Any, texts: list[str], out_dir: Path, seed: int) -> None:
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(seed)
    config = GPTNeoXConfig(
        vocab_size=len(tok),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        max_position_embeddings=256,
        rotary_pct=0.25,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )
    model = GPTNeoXForCausalLM(config)
    _pretrain(model, tok, texts, seed)
    model.save_pretrained(out_dir)


def _pretrain(
    model: Any, tok: Any, texts: list[str], seed: int, steps: int = PRETRAIN_STEPS, block: int = 64, batch: int = 16
) -> None:
    """A short full-parameter pretraining from the random init, so the base writes text like a base model.

    A frozen *random* base cannot stand in for gpt-neox-20b: its output head is near zero, so no LoRA
    on top of it can make a confident prediction. A few hundred steps on a slice of the demo texts
    give a weak base that SFT, PPO and GRPO can then improve, as on the real model.
    """
    import torch

    ids = [i for t in texts for i in tok(t).input_ids + [tok.eos_token_id]]
    data = torch.tensor(ids[: len(ids) // block * block]).view(-1, block)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        x = data[torch.randint(len(data), (batch,), generator=gen)]
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def _build_reasoner(lm_dir: Path, problems: list[dict[str, str]], out_dir: Path, seed: int) -> None:
    """The demo LM after a short full-parameter SFT on worked arithmetic in the <reasoning>/<answer> format.

    GRPO only improves what a model sometimes does: a tiny model that never writes the answer format
    never earns a reward. Like the instruct models the real recipe starts from, this one has seen
    the format, and writes it sometimes, but it is not yet reliable or accurate; GRPO's job is the rest.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fitrl.gsm8k import ensure_chat_template, format_solution, prompt_messages, render_prompt

    tok = AutoTokenizer.from_pretrained(lm_dir)
    ensure_chat_template(tok)
    model = AutoModelForCausalLM.from_pretrained(lm_dir)
    rows = []
    for p in problems:
        prompt = tok(render_prompt(tok, prompt_messages(p["question"])), add_special_tokens=False).input_ids
        target = tok(format_solution(p["answer"]), add_special_tokens=False).input_ids + [tok.eos_token_id]
        rows.append((prompt, target))
    width = max(len(a) + len(b) for a, b in rows)
    ids = torch.full((len(rows), width), tok.eos_token_id)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (prompt, target) in enumerate(rows):
        seq = prompt + target
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, len(prompt) : len(seq)] = torch.tensor(target)  # loss on the answer only
        mask[i, : len(seq)] = 1
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=REASONER_LR, weight_decay=0.0)
    model.train()
    for _ in range(REASONER_STEPS):
        idx = torch.randint(len(rows), (16,), generator=gen)
        loss = model(input_ids=ids[idx], attention_mask=mask[idx], labels=labels[idx]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)


def _build_classifier(train: list[dict[str, Any]], test: list[dict[str, Any]], out_dir: Path, seed: int) -> float:
    """Train the tiny DistilBERT reward model; returns its held-out accuracy."""
    import torch
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import DistilBertConfig, DistilBertForSequenceClassification, PreTrainedTokenizerFast

    # Its own WordPiece vocabulary, unlike the LM's BPE: the PPO reward must re-tokenize text, as with
    # the real distilbert-imdb reward model. Built by hand (words by count, then characters as the
    # fallback for unseen words) because the tokenizers trainer breaks ties differently run to run.
    normalizer, pre = normalizers.BertNormalizer(lowercase=True), pre_tokenizers.BertPreTokenizer()
    counts: Counter[str] = Counter()
    for r in train:
        counts.update(w for w, _ in pre.pre_tokenize_str(normalizer.normalize_str(r["text"])))
    chars = sorted({c for w in counts for c in w})
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words = [w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    vocab_list = list(dict.fromkeys(specials + chars + ["##" + c for c in chars] + words))
    wp = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab_list)}, unk_token="[UNK]"))
    wp.normalizer, wp.pre_tokenizer, wp.decoder = normalizer, pre, decoders.WordPiece()
    # DistilBERT classifies from the first position: every input must start with [CLS].
    wp.post_processor = processors.BertProcessing(("[SEP]", 3), ("[CLS]", 2))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=wp,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=128,
    )

    torch.manual_seed(seed)
    config = DistilBertConfig(
        vocab_size=len(tok),
        dim=64,
        n_layers=2,
        n_heads=2,
        hidden_dim=128,
        max_position_embeddings=128,
        id2label={0: "NEGATIVE", 1: "POSITIVE"},
        label2id={"NEGATIVE": 0, "POSITIVE": 1},
        seq_classif_dropout=0.1,
    )
    model = DistilBertForSequenceClassification(config)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)
    enc = tok([r["text"] for r in train], padding=True, truncation=True, return_tensors="pt")
    labels = torch.tensor([r["label"] for r in train])
    model.train()
    for _epoch in range(6):
        order = torch.randperm(len(train), generator=gen)
        for i in range(0, len(order), 32):
            idx = order[i : i + 32]
            loss = model(input_ids=enc.input_ids[idx], attention_mask=enc.attention_mask[idx], labels=labels[idx]).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        enc_t = tok([r["text"] for r in test], padding=True, truncation=True, return_tensors="pt")
        pred = model(**enc_t).logits.argmax(-1)
    accuracy = (pred == torch.tensor([r["label"] for r in test])).float().mean().item()
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return accuracy


def demo_dir(cache_dir: str | Path, seed: int = DEFAULT_SEED) -> Path:
    return Path(cache_dir).expanduser() / f"v{VERSION}-seed{seed}"


def build(cache_dir: str | Path, seed: int = DEFAULT_SEED) -> Path:
    """Build the demo assets into `cache_dir` (or reuse them) and return their directory."""
    from filelock import FileLock

    root = demo_dir(cache_dir, seed)
    if (root / MANIFEST).is_file():
        return root
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"demo cache directory {root.parent} is not writable ({e.strerror})") from None
    # Several processes (accelerate launch) may ask at once: one builds, the others wait and reuse.
    with FileLock(str(root) + ".lock"):
        if (root / MANIFEST).is_file():
            return root
        import torch

        staging = root.with_name(root.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # bit-identical weights whatever the machine's core count
        try:
            reviews = make_reviews(seed)
            train, test = reviews[N_TEST_REVIEWS:], reviews[:N_TEST_REVIEWS]
            problems = make_problems(seed)
            _write_jsonl(staging / "reviews" / "train.jsonl", train)
            _write_jsonl(staging / "reviews" / "test.jsonl", test)
            _write_jsonl(staging / "arithmetic" / "train.jsonl", problems[N_TEST_PROBLEMS:])
            _write_jsonl(staging / "arithmetic" / "test.jsonl", problems[:N_TEST_PROBLEMS])
            texts = [r["text"] for r in reviews] + [p["question"] + "\n" + p["answer"] for p in problems]
            tok = _train_lm_tokenizer(texts, staging / "lm")
            # Pretrain on half the reviews and problems: SFT then adapts it to the other half.
            _build_lm(
                tok,
                texts[: len(reviews) // 2] + texts[len(reviews) : len(reviews) + len(problems) // 2],
                staging / "lm",
                seed,
            )
            # The format SFT uses the training problems only: the test split stays unseen for evaluation.
            _build_reasoner(staging / "lm", problems[N_TEST_PROBLEMS:][:REASONER_PROBLEMS], staging / "reasoner", seed)
            accuracy = _build_classifier(train, test, staging / "classifier", seed)
            manifest = {
                "version": VERSION,
                "seed": seed,
                "classifier_test_accuracy": round(accuracy, 4),
                "n_reviews": len(reviews),
                "n_problems": len(problems),
            }
            (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        finally:
            torch.set_num_threads(threads)
        shutil.rmtree(root, ignore_errors=True)
        staging.rename(root)
    return root


def manifest(cache_dir: str | Path, seed: int = DEFAULT_SEED) -> dict[str, Any]:
    return json.loads((build(cache_dir, seed) / MANIFEST).read_text())


def asset_path(uri: str, cache_dir: str | Path, seed: int = DEFAULT_SEED) -> Path:
    """`demo://lm` -> the built asset's directory (building the demo on first use)."""
    name = uri.removeprefix("demo://").strip("/")
    if name not in ASSETS:
        raise UsageError(f"unknown demo asset {uri}; known: " + ", ".join(f"demo://{a}" for a in ASSETS))
    return build(cache_dir, seed) / ASSETS[name]
