"""A sequence classifier as the reward: the positive label's logit, probability or margin, or a scalar reward
model's one output, read from the whole text (query + response) with the classifier's own tokenizer."""

from __future__ import annotations

import sys

import torch

from fitrl.config import UsageError, first_line
from fitrl.modeling import load_classifier, loading_errors, resolve_model_path
from fitrl.reward.base import TextReward
from fitrl.reward.settings import RewardArguments


def check_reward_label(reward_path: str, positive_label: str, reward_kind: str = "logit") -> None:
    """Stop before any model loads if the reward model is no trained classifier, has no such label, or is a
    scalar reward model (one output, `num_labels=1`) asked for a score only a classifier has."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(reward_path, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot load the reward model's config from {reward_path}: {first_line(e)}") from None
    architectures = config.architectures or []
    if architectures and not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise UsageError(
            f"reward model {reward_path} is a {architectures[0]}, not a trained sequence classifier "
            "(its classification head would be newly initialized); give a ...ForSequenceClassification model"
        )
    if config.num_labels == 1:  # a scalar reward model: its one output is the reward, it has no labels
        if reward_kind != "logit":
            raise UsageError(
                f"reward model {reward_path} has one output (a scalar reward model), so reward_kind "
                f"'{reward_kind}' would be constant; set reward_kind logit (the output itself)"
            )
        return
    labels = list(config.id2label.values())
    if positive_label not in labels:
        raise UsageError(f"reward model has no label '{positive_label}' (its labels: {labels}); set positive_label")


class ClassifierReward(TextReward):
    """Scores texts with a sequence classifier, which may use another tokenizer than the policy."""

    def __init__(self, args: RewardArguments, demo_assets: str, device: torch.device):
        from transformers import AutoTokenizer

        path = resolve_model_path(args.reward_model, demo_assets, what="reward model")
        check_reward_label(path, args.positive_label, args.reward_kind)
        model, loading = load_classifier(path, args.reward_dtype, args.reward_quantization)
        if loading["missing_keys"]:
            missing = sorted(loading["missing_keys"])
            raise UsageError(
                f"reward model {path} has no saved weights for {missing[0]} ({len(missing)} missing): its "
                "classification head would be random; give a trained ...ForSequenceClassification model"
            )
        # bitsandbytes places a quantized model as it loads it
        self.model = model if args.reward_quantization != "none" else model.to(device)
        with loading_errors("reward model", path):
            self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        if self.tokenizer.pad_token is None:  # common in decoder reward models: batches need one
            if self.tokenizer.eos_token is None:
                raise UsageError(f"reward model {path}: its tokenizer has neither a pad nor an EOS token; add one")
            self.tokenizer.pad_token = self.tokenizer.eos_token
            print(f"note: reward model {path} has no pad token; padding with its EOS token", file=sys.stderr)
        if self.model.config.pad_token_id is None:  # a decoder classifier reads its head at the last non-pad token
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        # A scalar reward model (one output) is its own reward; a classifier's is its positive label's.
        self.scalar = self.model.config.num_labels == 1
        self.label = 0 if self.scalar else self.model.config.label2id[args.positive_label]
        self.kind, self.batch_size, self.device = args.reward_kind, args.reward_batch_size, device
        self.held = self.model

    @torch.no_grad()
    def classify(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores, called positive): the reward of each text, and whether the positive label wins (a scalar
        reward model: whether its output is above 0)."""
        scores, positive = [], []
        for i in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(texts[i : i + self.batch_size], padding=True, truncation=True, return_tensors="pt")
            logits = self.model(**enc.to(self.device)).logits.float()
            positive.append(logits[:, 0] > 0 if self.scalar else logits.argmax(-1) == self.label)
            if self.kind == "logit":
                scores.append(logits[:, self.label])
            elif self.kind == "probability":
                scores.append(logits.softmax(-1)[:, self.label])
            else:
                others = torch.cat([logits[:, : self.label], logits[:, self.label + 1 :]], dim=1)
                scores.append(logits[:, self.label] - others.max(-1).values)
        return torch.cat(scores).cpu(), torch.cat(positive).cpu()
