"""A reward model that is an adapter on the policy's own backbone: the rm stage's LoRA and score head,
loaded as a second adapter beside the policy's, so policy, reference, value and reward share one copy
of the (8-bit) base. An rm adapter trained on another model (or `reward_adapter_shared: false`) is
loaded on its own copy of its base instead (`SeparateAdapterReward`); the planner counts that base.

Scoring switches every LoRA layer to the reward adapter for one no-grad pass and back: the policy's
adapter, its trainable flags and the frozen base are untouched (the tests hold the policy's log-probs
bit for bit across a scoring pass). A text is scored as the rm stage trained on it: EOS appended,
tokenized by the same tokenizer, the head read at the last token that is not padding.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fitrl.artifacts import RunInfo
from fitrl.checkpoints import adapter_bases, check_adapter_base, check_adapter_files, is_model, load_safetensors
from fitrl.config import UsageError
from fitrl.modeling import (
    SCORE_HEAD,
    ModelArguments,
    load_causal_lm,
    load_tokenizer,
    loading_errors,
    resolve_model_path,
)
from fitrl.reward.base import TextReward

REWARD_ADAPTER = "reward"  # its name beside the policy's ("default")


def _score_weights(state: dict[str, torch.Tensor], adapter_dir: Path) -> dict[str, torch.Tensor]:
    """The score head's tensors among an rm adapter's (peft saves `modules_to_save` copies by module path)."""
    head = {k.rsplit(".", 1)[1]: v for k, v in state.items() if f".{SCORE_HEAD}." in k}
    if "weight" not in head:
        raise UsageError(
            f"{adapter_dir} holds no score head: it is not a reward model of the rm stage; train one with "
            "`fitrl rm` or give reward_model a classifier"
        )
    return head


@contextlib.contextmanager
def active_adapter(model: nn.Module, name: str) -> Iterator[None]:
    """Every LoRA layer computes with adapter `name` alone inside the block, its own adapters again after;
    nothing's `requires_grad` changes (peft's `set_adapter` would make the active one trainable)."""
    from peft.tuners.lora import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    saved = [m._active_adapter for m in layers]
    for m in layers:
        m._active_adapter = [name]
    try:
        yield
    finally:
        for m, active in zip(layers, saved):
            m._active_adapter = active


class AdapterReward(TextReward):
    """Scores texts with the reward adapter and head on `policy`'s backbone (a peft model)."""

    rendered = True  # the rm stage trained on texts (and chats) as rendered, special tokens and all

    def __init__(self, policy: Any, adapter_dir: str | Path, tokenizer: Any, batch_size: int):
        from peft import LoraConfig, set_peft_model_state_dict

        adapter_dir = Path(adapter_dir)
        check_adapter_files(adapter_dir, "reward model")
        config = json.loads((adapter_dir / "adapter_config.json").read_text())
        state = load_safetensors(adapter_dir / "adapter_model.safetensors", adapter_dir)
        head = _score_weights(state, adapter_dir)
        lora = LoraConfig(
            r=config["r"],
            lora_alpha=config["lora_alpha"],
            target_modules=config["target_modules"],
            lora_dropout=0.0,  # scoring is evaluation
            bias=config.get("bias", "none"),
            use_rslora=config.get("use_rslora", False),
            task_type="CAUSAL_LM",  # its LoRA only: the head is read here, not wrapped by peft
        )
        policy.add_adapter(REWARD_ADAPTER, lora)
        lora_state = {k: v for k, v in state.items() if f".{SCORE_HEAD}." not in k}
        result = set_peft_model_state_dict(policy, lora_state, adapter_name=REWARD_ADAPTER)
        missing = [k for k in result.missing_keys if f".{REWARD_ADAPTER}." in k]
        if missing or result.unexpected_keys:
            what = (missing or result.unexpected_keys)[0]
            raise UsageError(
                f"reward adapter {adapter_dir} does not fit this model's layers (first: {what}); train the "
                "reward model on the model PPO starts from"
            )
        for name, p in policy.named_parameters():
            if f".{REWARD_ADAPTER}." in name:
                p.requires_grad_(False)
        device = next(p for p in policy.parameters()).device
        self.head = nn.Linear(head["weight"].shape[1], head["weight"].shape[0], bias="bias" in head).to(device)
        self.head.load_state_dict(head)
        self.head.requires_grad_(False)
        self.policy, self.tokenizer, self.batch_size, self.device = policy, tokenizer, batch_size, device
        self.held = self.head  # the adapter rides on the policy's backbone: only the head is its own

    @torch.no_grad()
    def classify(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores, called positive): the reward of each text, and whether it is above 0."""
        scores = []
        backbone = self.policy.get_base_model().base_model  # the body below the LM head
        training = self.policy.training
        self.policy.eval()
        try:
            with active_adapter(self.policy, REWARD_ADAPTER):
                for enc in eos_batches(self.tokenizer, texts, self.batch_size, self.device):
                    hidden = backbone(**enc).last_hidden_state  # (B, T, H)
                    scores.append(self.head(last_token(hidden, enc.input_ids, self.tokenizer.pad_token_id)))
        finally:
            self.policy.train(training)
        rewards = torch.cat(scores)[:, 0].float().cpu()
        return rewards, rewards > 0


def eos_batches(tokenizer: Any, texts: list[str], batch_size: int, device: torch.device) -> Iterator[Any]:
    """The texts as the rm stage trained on them: EOS appended, in right-padded batches on `device`."""
    eos = tokenizer.eos_token
    for i in range(0, len(texts), batch_size):
        batch = [t if t.endswith(eos) else t + eos for t in texts[i : i + batch_size]]
        yield tokenizer(batch, padding=True, padding_side="right", return_tensors="pt").to(device)


@torch.no_grad()
def score_texts(model: Any, tokenizer: Any, texts: list[str], batch_size: int, device: torch.device) -> torch.Tensor:
    """The reward of each text from a reward model with its score head (the rm stage's output), as the rm
    stage trains and evaluates it: EOS appended, right-padded, the head's output at the last token (B,)."""
    return torch.cat(
        [model(**enc).logits[:, 0].float().cpu() for enc in eos_batches(tokenizer, texts, batch_size, device)]
    )


def last_token(hidden: torch.Tensor, input_ids: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """(B, T, H) -> (B, H): each row's hidden state at its last token that is not padding, where
    transformers' sequence classifiers read their head (an EOS that is also the pad token is skipped)."""
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    last = (positions * (input_ids != pad_token_id)).argmax(-1)
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), last].to(torch.float32)


def separate_base(
    adapter_dir: str | Path,
    model_name: str,
    model_path: str,
    demo_assets: str,
    shared: bool,
    stage: str,
    producer: str,
) -> str | None:
    """Where a reward adapter is scored in `stage`: None on the policy's backbone (it was trained on
    `model_name` and `shared`), else the resolved path of the base it was trained on, which it is loaded
    on by itself. Checks that a run of `producer` (the stage that trains reward models) made it, before
    anything loads."""
    adapter_dir = Path(adapter_dir).expanduser()
    check_adapter_files(adapter_dir, producer)
    recorded, trained_on = adapter_bases(adapter_dir, producer)
    if shared and (not recorded or is_model(recorded, model_name, model_path)):
        check_adapter_base(adapter_dir, model_name, model_path, stage, force=False, producer=producer, forceable=False)
        return None
    info = RunInfo.read(adapter_dir)
    base = (info and info.resolved_model_path) or trained_on
    if base is None:
        raise UsageError(
            f"reward adapter {adapter_dir} records no base model; give the output_dir of an {producer} run"
        )
    path = resolve_model_path(base, demo_assets, what="the reward adapter's base")
    check_adapter_base(adapter_dir, base, path, stage, force=False, producer=producer, forceable=False)
    return path


class SeparateAdapterReward(TextReward):
    """An rm stage's adapter and score head on its own copy of the base it was trained on, loaded beside
    the policy in `reward_dtype` / `reward_quantization`: a reward model trained on another model than
    the policy's. A text is scored as `AdapterReward` scores it (EOS appended, the head read at the last
    token)."""

    rendered = True

    def __init__(self, base: str, args: Any, device: torch.device) -> None:
        """`args`: PPO's `RewardArguments` (reward_adapter, reward_dtype, reward_quantization, reward_batch_size)."""
        from peft import PeftModel

        adapter_dir, quantization = str(args.reward_adapter), args.reward_quantization
        self.tokenizer = load_tokenizer(adapter_dir)  # the rm run's own, saved beside its adapter
        loaded = ModelArguments(base, quantization=quantization, dtype=args.reward_dtype)
        model = load_causal_lm(
            loaded, path=base, for_training=False, pad_token_id=self.tokenizer.pad_token_id, score_head=True
        )
        if quantization == "none":  # bitsandbytes places a quantized model as it loads it
            model.to(device)
        with loading_errors("reward adapter", str(adapter_dir)):
            self.model = PeftModel.from_pretrained(model, adapter_dir).eval()
        self.batch_size, self.device, self.held = args.reward_batch_size, device, self.model

    @torch.no_grad()
    def classify(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores, called positive): the reward of each text, and whether it is above 0."""
        rewards = score_texts(self.model, self.tokenizer, texts, self.batch_size, self.device)
        return rewards, rewards > 0
