"""Sampling responses: left padding, positions, the EOS cut and the response mask, on tiny models."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from fitrl.rollout import Rollout, left_pad, position_ids, response_logprobs, sample_responses, sentence_end_ids

PAD, EOS = 0, 1


def tiny_neox(vocab: int = 40) -> nn.Module:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    config = GPTNeoXConfig(
        vocab_size=vocab,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    return GPTNeoXForCausalLM(config).eval()


class ScriptedModel(nn.Module):
    """A stand-in policy whose `generate` appends fixed responses, to check the cut exactly."""

    def __init__(self, responses: list[list[int]]):
        super().__init__()
        self.config = SimpleNamespace(use_cache=False)
        self.responses = torch.tensor(responses)
        self.calls: list[dict] = []

    def generate(self, input_ids: torch.Tensor, **kw: object) -> SimpleNamespace:
        self.calls.append(kw)
        return SimpleNamespace(sequences=torch.cat([input_ids, self.responses], 1), logits=None)


TOKENIZER = SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS)


def test_left_pad_and_positions_skip_the_padding() -> None:
    ids, mask = left_pad([[5, 6, 7], [8]], PAD)
    assert ids.tolist() == [[5, 6, 7], [PAD, PAD, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    # the padded query starts at position 0, as it would alone
    assert position_ids(mask).tolist() == [[0, 1, 2], [0, 0, 0]]
    assert position_ids(torch.tensor([[0, 1, 1, 1, 0]])).tolist() == [[0, 0, 1, 2, 2]]


def test_responses_are_cut_to_their_drawn_lengths() -> None:
    model = ScriptedModel([[10, 11, 12, 13], [20, 21, 22, 23]])
    r = sample_responses(model, TOKENIZER, [[5, 6], [7]], [4, 2], stop_at_eos=False, device=torch.device("cpu"))
    assert r.query_len == 2
    assert r.response_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert r.input_ids.tolist() == [[5, 6, 10, 11, 12, 13], [PAD, 7, 20, 21, PAD, PAD]]
    assert r.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0]]
    # without stop_at_eos, EOS is suppressed up to the longest drawn length
    assert model.calls[0]["min_new_tokens"] == 4 and model.calls[0]["max_new_tokens"] == 4


def test_stop_at_eos_ends_a_response_at_its_first_eos_inclusive() -> None:
    model = ScriptedModel([[10, EOS, 12, EOS], [20, 21, 22, 23], [EOS, 31, 32, 33]])
    r = sample_responses(model, TOKENIZER, [[5], [6], [7]], [4, 3, 4], stop_at_eos=True, device=torch.device("cpu"))
    assert model.calls[0]["min_new_tokens"] == 0
    assert r.response_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]]
    assert r.responses.tolist() == [[10, EOS, PAD, PAD], [20, 21, 22, PAD], [EOS, PAD, PAD, PAD]]


def test_a_response_is_cut_after_its_last_sentence_end_within_its_length() -> None:
    END = 3  # a token that ends a sentence
    model = ScriptedModel(
        [[10, END, 12, END, 14], [20, 21, 22, 23, 24], [END, 31, END, 33, 34], [40, END, EOS, 43, 44]]
    )
    queries, lengths = [[5], [6], [7], [8]], [5, 5, 2, 5]
    ends = torch.tensor([END])
    r = sample_responses(model, TOKENIZER, queries, lengths, True, torch.device("cpu"), sentence_ends=ends)
    # the last end within the length; none: the drawn length; one past the length does not count; with
    # an EOS, the last end before it
    assert r.response_mask.sum(1).tolist() == [4, 5, 1, 2]
    assert r.responses.tolist()[0] == [10, END, 12, END, PAD]


class _Vocabulary:
    texts = ["The", " cast", ".", " Wow!", "?\n", " 3.5", "...", " a"]

    def __len__(self) -> int:
        return len(self.texts)

    def batch_decode(self, ids: list[list[int]]) -> list[str]:
        return [self.texts[i] for [i] in ids]


def test_sentence_end_ids_are_the_tokens_whose_text_ends_a_sentence() -> None:
    assert sentence_end_ids(_Vocabulary()).tolist() == [2, 3, 4, 6]


def test_generation_shorter_than_asked_is_padded_to_the_width() -> None:
    model = ScriptedModel([[EOS], [EOS]])  # every sequence stopped after one token
    r = sample_responses(model, TOKENIZER, [[5], [6]], [3, 2], stop_at_eos=True, device=torch.device("cpu"))
    assert r.responses.shape == (2, 3)
    assert r.response_mask.tolist() == [[1, 0, 0], [1, 0, 0]]


def test_a_padded_row_scores_exactly_as_it_would_alone() -> None:
    model = tiny_neox()
    torch.manual_seed(1)
    batch = sample_responses(model, TOKENIZER, [[5, 6, 7, 8], [9, 10]], [5, 3], False, torch.device("cpu"))
    with torch.no_grad():
        together = response_logprobs(model, batch)
    for i, q_len in enumerate([4, 2]):
        r_len = int(batch.response_mask[i].sum())
        alone_ids = batch.input_ids[i : i + 1, batch.query_len - q_len : batch.query_len + r_len]
        alone = Rollout(alone_ids, torch.ones_like(alone_ids), torch.ones(1, r_len, dtype=torch.long), q_len)
        with torch.no_grad():
            expected = response_logprobs(model, alone)[0]
        assert together[i, :r_len] == pytest.approx(expected.tolist(), abs=1e-5)


def test_sampling_follows_the_seed_and_restores_training_mode() -> None:
    model = tiny_neox().train()
    draws = []
    for _ in range(2):
        torch.manual_seed(3)
        draws.append(sample_responses(model, TOKENIZER, [[5, 6]] * 4, [6] * 4, False, torch.device("cpu")).input_ids)
    assert torch.equal(draws[0], draws[1])
    assert len({tuple(row) for row in draws[0].tolist()}) > 1, "four samples of one prompt should differ"
    assert model.training


def _tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=40,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        pad_token_id=PAD,
    )
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("make", [tiny_neox, _tiny_llama], ids=["gpt_neox", "llama"])
@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
def test_policy_and_value_keeps_only_the_response_logits_and_the_last_hidden_state(make, lora: bool) -> None:
    """The lean forward (logits of the last R + 1 positions, one hidden state) is the full forward, sliced."""
    from peft import LoraConfig, get_peft_model

    from fitrl.ppo.step import PolicyAndValue
    from fitrl.rollout import response_window

    lm = make()
    policy = get_peft_model(lm, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)) if lora else lm
    model = PolicyAndValue(policy, lm.config.hidden_size).eval()
    ids, mask = left_pad([[5, 6, 7], [8, 9]], PAD)
    responses = torch.tensor([[11, 12, 13, 14], [15, 16, PAD, PAD]])
    rollout = Rollout(
        torch.cat([ids, responses], 1),
        torch.cat([mask, (responses != PAD).long()], 1),
        (responses != PAD).long(),
        ids.shape[1],
    )
    with torch.no_grad():
        full = policy(
            input_ids=rollout.input_ids,
            attention_mask=rollout.attention_mask,
            position_ids=position_ids(rollout.attention_mask),
            output_hidden_states=True,
        )
        logits, values = model(rollout.input_ids, rollout.attention_mask, logits_to_keep=response_window(rollout))
        expected_values = model.value_head(full.hidden_states[-1]).squeeze(-1)
    assert logits.shape == (2, 5, 40)
    torch.testing.assert_close(logits[:, :-1], full.logits[:, rollout.query_len - 1 : -1], rtol=0, atol=1e-6)
    torch.testing.assert_close(values, expected_values, rtol=0, atol=1e-6)
    torch.testing.assert_close(
        response_logprobs(policy, rollout),
        torch.log_softmax(full.logits[:, rollout.query_len - 1 : -1], -1)
        .gather(2, rollout.responses.unsqueeze(-1))
        .squeeze(-1),
        rtol=0,
        atol=1e-5,
    )


@pytest.mark.parametrize("make", [tiny_neox, _tiny_llama], ids=["gpt_neox", "llama"])
@pytest.mark.parametrize("stop_at_eos", [False, True], ids=["fixed", "eos"])
def test_policy_outputs_kept_from_sampling_equal_a_forward_pass(make, stop_at_eos: bool) -> None:
    """What `keep_policy` reads off the KV-cached sampling pass is what a forward of the whole batch
    gives: log-probs, entropies and values, left padding and early ends included."""
    from peft import LoraConfig, get_peft_model

    from fitrl.ppo import core as ppo
    from fitrl.ppo.step import PolicyAndValue
    from fitrl.rollout import response_window

    lm = make()
    policy = get_peft_model(lm, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    model = PolicyAndValue(policy, lm.config.hidden_size).eval()
    torch.manual_seed(2)
    queries, lengths = [[5, 6, 7, 8], [9, 10], [11]], [6, 3, 5]
    r = sample_responses(policy, TOKENIZER, queries, lengths, stop_at_eos, torch.device("cpu"), keep_policy=True)
    with torch.no_grad():
        logits, values = model(r.input_ids, r.attention_mask, logits_to_keep=response_window(r))
        kept_values = model.values(r.policy.hidden)
    logits, mask = logits[:, :-1], r.response_mask.float()
    expected = [
        ppo.logprobs_from_logits(logits, r.responses),
        ppo.entropy_from_logits(logits),
        values[:, r.query_len - 1 : -1],
    ]
    for kept, full in zip([r.policy.logprobs, r.policy.entropy, kept_values], expected):
        torch.testing.assert_close(kept * mask, full * mask, rtol=0, atol=1e-5)
    assert (r.policy.logprobs * (1 - mask) == 0).all(), "nothing kept past a response's end"
    parts = r.split(2)
    assert [len(p.input_ids) for p in parts] == [2, 1]
    torch.testing.assert_close(torch.cat([p.policy.hidden for p in parts]), r.policy.hidden, rtol=0, atol=0)


def test_sampling_frees_the_kv_cache_before_the_policy_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The generation's KV cache is as big as its batch (51 MiB for the TRL benchmark's 128 prompts):
    it is dropped before the log-probs and entropies are read off the kept logits."""
    import gc

    from transformers.cache_utils import Cache

    from fitrl import rollout

    caches_alive = []
    real = rollout._policy_outputs

    def spy(*args: object) -> object:
        gc.collect()
        caches_alive.append(sum(isinstance(o, Cache) for o in gc.get_objects()))
        return real(*args)

    monkeypatch.setattr(rollout, "_policy_outputs", spy)
    torch.manual_seed(0)
    r = sample_responses(tiny_neox(), TOKENIZER, [[5, 6, 7], [8]], [4, 4], False, torch.device("cpu"), keep_policy=True)
    assert caches_alive == [0] and r.policy is not None


def test_generation_batch_defaults_to_the_no_grad_batch_and_never_exceeds_a_step() -> None:
    from fitrl.rollout import generation_batch

    assert generation_batch(None, 8, 32) == 8
    assert generation_batch(32, 8, 128) == 32
    assert generation_batch(None, 16, 4) == generation_batch(64, 8, 4) == 4


def test_a_reward_adapter_reads_a_chat_prompt_as_rendered_and_logs_read_it_as_text(demo_assets) -> None:
    """The rm stage trains on conversational pairs rendered in the chat template, special tokens and all:
    PPO's reward adapter reads a chat prompt the same way (`rendered_queries`), the logs without them."""
    from fitrl.modeling import load_tokenizer
    from fitrl.rollout import decode, rendered_queries

    tokenizer = load_tokenizer(str(demo_assets / "lm"))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    prompt = "<|im_start|>user\nHow was it?<|im_end|>\n<|im_start|>assistant\n"
    q = tokenizer(prompt).input_ids
    r = tokenizer(" Fine.").input_ids
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad, *q, *r]])
    rollout = Rollout(ids, torch.tensor([[0] + [1] * (len(q) + len(r))]), torch.ones(1, len(r)), len(q) + 1)
    assert rendered_queries(tokenizer, rollout) == [prompt]  # padding gone, the template's tokens kept
    assert decode(tokenizer, rollout) == (["user\nHow was it?\nassistant\n"], [" Fine."])
