"""The demo's three tiny models, trained from a seed on the demo corpus with one training loop.

- the LM: a tiny GPT-NeoX (the gpt-neox-20b family) with a byte-level BPE tokenizer, pretrained
  until it writes the corpus's sentences, as a base model does;
- the reasoner: that LM after an SFT on worked arithmetic in the `<reasoning>`/`<answer>` format;
- the classifier: a tiny DistilBERT sentiment classifier with its own WordPiece tokenizer.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from fitrl.tasks.answer_format import FORMAT_TAGS, ensure_chat_template, format_solution, prompt_messages, render_prompt

# The LM must write sentences of the corpus's kind before SFT and PPO start (perplexity ~3.4 on the
# held-out reviews; 40 steps of a 4x smaller model left it at ~107 and word salad): ~6 passes over
# its half of the training texts, ~75 s on two threads.
LM_SIZE = {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 512}
PRETRAIN_STEPS = 1000
PRETRAIN_LR = 3e-3
# Long enough that the reasoner keeps the format and solves about a fifth of the held-out problems
# greedily (22%, most of them easy ones): GRPO needs correct samples to learn from.
REASONER_STEPS = 300
REASONER_LR = 3e-3
CLASSIFIER_EPOCHS = 6


def fit(
    model: Any,
    batches: Iterable[dict[str, torch.Tensor]],
    lr: float,
    weight_decay: float = 0.0,
    cosine_steps: int | None = None,
) -> None:
    """Full-parameter AdamW on `model(**batch).loss` for every batch; leaves the model in eval mode.

    With `cosine_steps`, a 20-step warm-up then a cosine decay to a tenth of `lr` over that many steps.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    sched = None
    if cosine_steps:
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt,
            lambda s: (
                min(1.0, (s + 1) / 20) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(s, cosine_steps) / cosine_steps)))
            ),
        )
    model.train()
    for batch in batches:
        loss = model(**batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if sched:
            sched.step()
    model.eval()


def train_lm_tokenizer(texts: list[str], out_dir: Path) -> Any:
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


def build_lm(tok: Any, texts: list[str], held_out: list[str], out_dir: Path, seed: int) -> float:
    """A tiny random-init GPT-NeoX (1M parameters), pretrained on `texts`; returns its perplexity on
    `held_out` (texts it never saw).

    A frozen *random* base cannot stand in for gpt-neox-20b: its output head is near zero, so no LoRA
    on top of it can make a confident prediction, and a barely trained one writes word salad that PPO
    then turns into other word salad. Pretrained until it writes the corpus's sentences, it is a base
    that SFT, PPO and GRPO can then improve, as on the real model.
    """
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(seed)
    config = GPTNeoXConfig(
        vocab_size=len(tok),
        **LM_SIZE,
        max_position_embeddings=256,
        rotary_pct=0.25,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )
    model = GPTNeoXForCausalLM(config)
    ids = [i for t in texts for i in tok(t).input_ids + [tok.eos_token_id]]
    block = 64
    data = torch.tensor(ids[: len(ids) // block * block]).view(-1, block)
    fit(model, _random_blocks(data, PRETRAIN_STEPS, batch=16, seed=seed), lr=PRETRAIN_LR, cosine_steps=PRETRAIN_STEPS)
    model.save_pretrained(out_dir)
    return perplexity(model, tok, held_out)


def perplexity(model: Any, tok: Any, texts: list[str]) -> float:
    """exp of the mean next-token loss over every token of `texts` (each text scored on its own)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([tok(text).input_ids + [tok.eos_token_id]])
            total += model(input_ids=ids, labels=ids).loss.item() * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    return math.exp(total / count)


def _random_blocks(data: torch.Tensor, steps: int, batch: int, seed: int) -> Iterator[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = data[torch.randint(len(data), (batch,), generator=gen)]
        yield {"input_ids": x, "labels": x}


def build_reasoner(lm_dir: Path, problems: list[dict[str, str]], out_dir: Path, seed: int) -> None:
    """The demo LM after a short full-parameter SFT on worked arithmetic in the <reasoning>/<answer> format.

    GRPO only improves what a model sometimes does: a tiny model that never writes the answer format
    never earns a reward. Like the instruct models the real recipe starts from, this one has seen
    the format, and writes it sometimes, but it is not yet reliable or accurate; GRPO's job is the rest.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(lm_dir)
    ensure_chat_template(tok)
    model = AutoModelForCausalLM.from_pretrained(lm_dir)
    # The format's tags as one token each (ordinary tokens: decoding keeps them), not six or seven of
    # the LM's BPE: a completion takes ~20 tokens instead of ~42, and a GRPO step a third less time.
    # The LM itself (SFT, PPO) keeps its tokenizer; the new embedding rows are seeded.
    tok.add_tokens(list(FORMAT_TAGS))
    torch.manual_seed(seed)
    model.resize_token_embeddings(len(tok))
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

    def batches() -> Iterator[dict[str, torch.Tensor]]:
        gen = torch.Generator().manual_seed(seed)
        for _ in range(REASONER_STEPS):
            idx = torch.randint(len(rows), (16,), generator=gen)
            yield {"input_ids": ids[idx], "attention_mask": mask[idx], "labels": labels[idx]}

    fit(model, batches(), lr=REASONER_LR)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)


def _wordpiece_tokenizer(train: list[dict[str, Any]]) -> Any:
    """A WordPiece tokenizer over the training reviews' words, then characters as the fallback.

    Its own vocabulary, unlike the LM's BPE: the PPO reward must re-tokenize text, as with the real
    distilbert-imdb reward model. Built by hand (words by count) because the tokenizers trainer
    breaks ties differently run to run.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

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
    return PreTrainedTokenizerFast(
        tokenizer_object=wp,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=128,
    )


def build_classifier(train: list[dict[str, Any]], test: list[dict[str, Any]], out_dir: Path, seed: int) -> float:
    """Train the tiny DistilBERT reward model; returns its held-out accuracy."""
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    tok = _wordpiece_tokenizer(train)
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
    enc = tok([r["text"] for r in train], padding=True, truncation=True, return_tensors="pt")
    labels = torch.tensor([r["label"] for r in train])

    def batches() -> Iterator[dict[str, torch.Tensor]]:
        gen = torch.Generator().manual_seed(seed)
        for _epoch in range(CLASSIFIER_EPOCHS):
            order = torch.randperm(len(train), generator=gen)
            for i in range(0, len(order), 32):
                idx = order[i : i + 32]
                yield {
                    "input_ids": enc.input_ids[idx],
                    "attention_mask": enc.attention_mask[idx],
                    "labels": labels[idx],
                }

    fit(model, batches(), lr=2e-3, weight_decay=0.01)
    with torch.no_grad():
        enc_t = tok([r["text"] for r in test], padding=True, truncation=True, return_tensors="pt")
        pred = model(**enc_t).logits.argmax(-1)
    accuracy = (pred == torch.tensor([r["label"] for r in test])).float().mean().item()
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return accuracy
