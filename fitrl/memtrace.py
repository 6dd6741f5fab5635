"""One step of a training stage under a tracker of live tensor bytes, on any device, `meta` included.

On `meta` nothing is allocated, so the real architecture of gpt-neox-20b or Llama-3.1-8B runs a
generation, the no-grad passes and a training micro-step on a laptop in seconds; on a CPU or GPU the
same code measures real tensors. The planner (`fitrl.planner`) uses it three ways: its own answer
extrapolates traces of two- and three-block models in depth; `--trace` runs the full depth; tests and
`bench/` measure small models for real.

What stands in for what cannot run on `meta`:
- bitsandbytes' 8-bit and 4-bit layers: a frozen linear in the compute dtype that casts its input to
  that dtype and its output back, and keeps what bitsandbytes keeps for backward (an 8-bit layer's
  input, out of gradient checkpointing's reach); their weights' bytes come from the planner's count
  of the real quantized tensors, not from the stand-in.
- attention: on `meta` torch takes its math path (the full (B, heads, T, T) scores); the trace calls
  the flash kernel instead (output and log-sum-exp only), which is what sdpa runs on a GPU.
- the optimizer step: its states are counted by the planner (exact bytes), not traced.

Shapes follow the stages: SFT trains on (micro_batch, block) blocks; PPO generates `gen_batch`
responses to `prompt_len`-token queries, scores them in `nograd_batch` rows with and without the
adapter, and trains on micro-batches; GRPO generates `gen_batch` completions. SFT and GRPO train
through trl's fused LM head, as their trainers do: the logits are never materialised whole, but its
tile buffer is (up to 4096 tokens x a fixed vocabulary chunk, however small the vocabulary).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fitrl.memory import LiveTensorBytes, optimizer_state_tensors
from fitrl.modeling import SCORE_HEAD, make_optimizer, unloaded_bitsandbytes_hidden
from fitrl.ppo.step import Experience, PolicyAndValue, adapter_disabled, experience_chunk, micro_step_loss
from fitrl.rollout import Rollout
from fitrl.stages.ppo import PPOArguments
from fitrl.workload import Step, Workload

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# What trl 1.16's SFT, DPO and GRPO trainers ask of their fused LM head (the logits are never built whole).
FUSED_HEAD_OUTPUTS = {
    Step.NEXT_TOKEN: ("log_probs", "entropy", "is_top1"),
    Step.GRPO: ("log_probs", "entropy"),
    Step.DPO: ("log_probs", "entropy", "mean_logits", "is_top1"),
}


class _KbitMatmul(torch.autograd.Function):
    """bitsandbytes' frozen k-bit matmul, memory included: compute dtype in, input dtype out, and in
    backward a copy of the weight dequantized to the input's dtype. Its 8-bit matmul (`MatMul8bitLt`,
    `MatMul8bitFp` on CPU) keeps its input as a plain `ctx` attribute rather than a saved tensor, so
    gradient checkpointing cannot free it: every 8-bit layer's input lives until backward reaches
    it (measured on CPU and on an H200). The 4-bit matmul keeps only its weight."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, keep: bool):
        ctx.dtype = x.dtype
        ctx.x = x if keep else None
        ctx.weight = weight  # a parameter: no extra bytes
        out = F.linear(x.to(weight.dtype), weight, None if bias is None else bias.to(weight.dtype))
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        grad_x = grad.to(ctx.dtype) @ ctx.weight.to(ctx.dtype, copy=True) if ctx.needs_input_grad[0] else None
        ctx.x = None
        return grad_x, None, None, None


class KbitLinearStandIn(nn.Linear):
    """A frozen bitsandbytes layer's arithmetic and memory without its kernels (`_KbitMatmul`)."""

    keeps_input = True  # 8-bit; the 4-bit stand-ins set it False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _KbitMatmul.apply(x, self.weight, self.bias, self.keeps_input)


def truncated_config(config: Any, num_layers: int) -> Any:
    """A copy of `config` with only the first `num_layers` blocks (per-layer lists cut to match)."""
    config = copy.deepcopy(config)
    config.num_hidden_layers = num_layers
    for key in ["layer_types", "sliding_window_pattern_list"]:
        value = getattr(config, key, None)
        if isinstance(value, list):
            setattr(config, key, value[:num_layers])
    return config


def _output_embedding_names(model: nn.Module) -> set[str]:
    """The head bitsandbytes leaves unquantized: the LM head, or a reward model's score head."""
    head = model.get_output_embeddings()
    return {name for name, module in model.named_modules() if module is head or name == SCORE_HEAD}


def _stand_in_kbit(model: nn.Module, compute_dtype: torch.dtype, keeps_input: bool) -> None:
    """Swap the linears bitsandbytes would quantize for stand-ins (`keeps_input`: 8-bit), and cast the
    rest to fp32 as `peft.prepare_model_for_kbit_training` does (norms, embeddings, head and biases)."""
    skip = _output_embedding_names(model)
    for module_name, module in list(model.named_modules()):
        if type(module) is nn.Linear and module_name not in skip:
            module.__class__ = KbitLinearStandIn
            module.keeps_input = keeps_input
            module.weight.data = module.weight.data.to(compute_dtype)
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if not (isinstance(module, KbitLinearStandIn) and name == "weight"):
                param.data = param.data.to(torch.float32)
    for p in model.parameters():
        p.requires_grad_(False)


def build_trainable(
    config: Any, w: Workload, device: str | torch.device, num_layers: int | None = None, base: Any = None
) -> nn.Module:
    """The stage's trainable model from `config` (random weights) on `device`: LoRA or full, value head for PPO.

    `base`: a model loaded for real (`fitrl.modeling.load_causal_lm`, bitsandbytes layers and all) to
    wrap instead of building one from `config`.
    """
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    if num_layers is not None:
        config = truncated_config(config, num_layers)
    dtype = TORCH_DTYPES[w.dtype]
    if base is not None:
        model = base
    else:
        auto = AutoModelForCausalLM
        if w.step is Step.PAIRWISE_SCORE:  # a scalar head in place of the LM head (a sequence classifier)
            auto, config = AutoModelForSequenceClassification, copy.copy(config)
            config.num_labels = 1
        with torch.device(device):
            model = auto.from_config(config, dtype=torch.float32 if w.quantized else dtype)
        model.config.pad_token_id = model.config.pad_token_id or 0
        if w.quantized:
            _stand_in_kbit(model, dtype, keeps_input=w.quantization == "8bit" and w.int8_keeps_input)
    if w.gradient_checkpointing and base is None:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        if not w.quantized and w.finetuning == "lora":
            model.enable_input_require_grads()
        model.config.use_cache = False
    if w.step in FUSED_HEAD_OUTPUTS:  # trl's trainers patch the model with their tiled LM head
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model, temperature=w.temperature, outputs=FUSED_HEAD_OUTPUTS[w.step])
    # The adapter and value head are made on `device` itself: made on the CPU and moved, a plan on `meta`
    # would allocate them for real (lora_r 10000000 took gigabytes).
    if w.finetuning == "lora":
        model = _with_lora(model, w, device)
    if w.value_head:
        with torch.device(device):
            model = PolicyAndValue(model, config.hidden_size)
    return model


def _with_lora(model: nn.Module, w: Workload, device: str | torch.device) -> nn.Module:
    """`model` in a fresh trainable LoRA adapter (and the score head for a reward model); with
    `w.reward_adapter`, a second, frozen adapter of the same shape beside it, as PPO scores with."""
    targets: Any = "all-linear" if list(w.lora_targets) == ["all-linear"] else list(w.lora_targets)
    with unloaded_bitsandbytes_hidden(), torch.device(device):
        from peft import LoraConfig, get_peft_model

        task = "SEQ_CLS" if w.step is Step.PAIRWISE_SCORE else "CAUSAL_LM"  # SEQ_CLS trains the score head too
        lora = LoraConfig(r=w.lora_r, lora_alpha=2 * w.lora_r, target_modules=targets, task_type=task)
        model = get_peft_model(model, lora)
        if w.reward_adapter:
            model.add_adapter("reward", lora)
            for name, p in model.named_parameters():
                if ".reward." in name:
                    p.requires_grad_(False)
    return model


def _policy(model: nn.Module) -> nn.Module:
    return model.policy if isinstance(model, PolicyAndValue) else model


def _flash_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.where(attn_mask, 0.0, -math.inf).to(q.dtype)
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )
    return out[0]


@contextlib.contextmanager
def meta_patches(device: str | torch.device) -> Iterator[None]:
    """On `meta`: flash attention, transformers' mask helpers told not to read tensor values, no autocast."""
    if torch.device(device).type != "meta":
        yield
        return
    import transformers.masking_utils as masking

    is_tracing, sdpa, autocast_on = masking.is_tracing, F.scaled_dot_product_attention, torch.is_autocast_enabled
    masking.is_tracing = lambda t=None: (isinstance(t, torch.Tensor) and t.is_meta) or is_tracing(t)
    F.scaled_dot_product_attention = _flash_sdpa
    # autocast has no `meta` device type; trl's fused head asks
    torch.is_autocast_enabled = lambda *a: False if a and str(a[0]) == "meta" else autocast_on(*a)
    try:
        yield
    finally:
        masking.is_tracing, F.scaled_dot_product_attention = is_tracing, sdpa
        torch.is_autocast_enabled = autocast_on


def _tokens(rows: int, length: int, device: Any, vocab: int) -> torch.Tensor:
    if torch.device(device).type == "meta":
        return torch.zeros(rows, length, dtype=torch.long, device=device)
    return torch.randint(0, vocab, (rows, length), device=device)


def _prefill(policy: nn.Module, rows: int, length: int, device: Any, vocab: int) -> tuple[Any, torch.Tensor, Any]:
    from transformers import DynamicCache

    ids = _tokens(rows, length, device, vocab)
    mask = torch.ones_like(ids)
    cache = DynamicCache(config=policy.config)
    out = policy(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True, logits_to_keep=1)
    return out, mask, cache


def _decode_step(policy: nn.Module, out: Any, mask: torch.Tensor, cache: Any) -> tuple[Any, torch.Tensor]:
    scores = out.logits[:, -1, :].to(dtype=torch.float32, copy=True)
    next_ids = scores.softmax(-1).argmax(-1, keepdim=True)
    mask = torch.cat([mask, torch.ones_like(next_ids)], dim=1)
    out = policy(input_ids=next_ids, attention_mask=mask, cache=cache, use_cache=True, logits_to_keep=1)
    return out, mask


@torch.no_grad()
def generation(model: nn.Module, w: Workload, device: Any, vocab: int) -> None:
    """Prefill `gen_batch` prompts, then decode with the KV cache, as `generate` does (last-token logits only)."""
    policy = _policy(model)
    policy.eval()
    out, mask, cache = _prefill(policy, w.gen_batch, w.prompt_len, device, vocab)
    for _ in range(w.completion_len):
        out, mask = _decode_step(policy, out, mask, cache)
    del out, cache


# The generation's two parts as `generation_peak` traces them: either can hold the peak, and which one
# does can change with depth, so the planner extrapolates each in depth before taking the larger.
PREFILL, LAST_DECODE_STEP = "generation: prefill", "generation: last decode step"


@torch.no_grad()
def generation_peak(model: nn.Module, w: Workload, device: Any, vocab: int, tracker: LiveTensorBytes) -> None:
    """The peaks of `generation`'s prefill and of its last decode step, as the tracker's phases
    `PREFILL` and `LAST_DECODE_STEP`.

    A decode step never needs less than the one before (its KV cache and the attention over it only
    grow), so the last one, run on a cache prefilled to full length outside the phases, is the decode
    steps' peak: two forwards and one step instead of `completion_len` steps.
    """
    policy = _policy(model)
    policy.eval()
    with tracker.phase(PREFILL):
        out, mask, cache = _prefill(policy, w.gen_batch, w.prompt_len, device, vocab)
    del out, mask, cache
    if w.completion_len:
        out, mask, cache = _prefill(policy, w.gen_batch, w.prompt_len + w.completion_len - 1, device, vocab)
        with tracker.phase(LAST_DECODE_STEP):
            out, mask = _decode_step(policy, out, mask, cache)
        del out, cache


def _sequences(w: Workload, rows: int, device: Any, vocab: int) -> Rollout:
    """`rows` sampled sequences of full length: a `prompt_len`-token query, a `completion_len`-token response."""
    ids = _tokens(rows, w.seq_len, device, vocab)
    return Rollout(ids, torch.ones_like(ids), torch.ones_like(ids[:, w.prompt_len :]), w.prompt_len)


# The PPO loss's coefficients (clip ranges, value weight) change no tensor the step allocates.
PPO_SETTINGS = PPOArguments()


def nograd_pass(model: nn.Module, w: Workload, device: Any, vocab: int) -> None:
    """PPO: `fitrl.ppo.step.experience_chunk` on one `nograd_batch` chunk, with the policy's forward
    (the planner takes the larger pass: not the log-probs kept from sampling)."""
    model.eval()
    chunk = experience_chunk(model, _sequences(w, w.nograd_batch, device, vocab), PPO_SETTINGS.kl_estimator)
    del chunk


@torch.no_grad()
def grpo_logprob_pass(model: nn.Module, w: Workload, device: Any, vocab: int) -> None:
    """GRPO: reference log-probs (adapter off) of one micro-batch through the fused head."""
    ids = _tokens(w.micro_batch, w.seq_len, device, vocab)
    mask = torch.ones_like(ids)
    with adapter_disabled(_policy(model)):
        _fused_logprobs(model, ids, mask, w.completion_len)


def _fused_logprobs(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, keep: int) -> tuple:
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-keep] = -100
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    return out.log_probs[:, -keep:], out.entropy[:, -keep:]


def _experience(w: Workload, ids: torch.Tensor, device: Any) -> Experience:
    """A micro-batch of PPO experience over the sequences `ids`: every response token real."""
    per_token = [torch.zeros(w.micro_batch, w.completion_len, device=device) for _ in range(6)]
    mask, logprobs, values, kl, entropy, advantages = per_token
    mask += 1
    return Experience(
        ids, torch.ones_like(ids), mask, logprobs, values, kl, entropy, w.prompt_len, advantages, returns=advantages
    )


def training_micro_step(model: nn.Module, w: Workload, device: Any, vocab: int) -> None:
    """One forward and backward of the stage's loss on a micro-batch; gradients accumulate."""
    model.train()
    ids = _tokens(w.micro_batch, w.seq_len, device, vocab)
    mask = torch.ones_like(ids)
    if w.step is Step.NEXT_TOKEN:  # trl's SFTTrainer: the mean negative log-prob from the fused head
        out = model(input_ids=ids, attention_mask=mask, labels=ids, fused_lm_head=True)
        loss = -out.log_probs.sum() / out.label_mask.sum().clamp(min=1)
    elif w.step is Step.PPO:  # `fitrl.ppo.step.micro_step_loss` on a micro-batch of experience
        loss, _stats = micro_step_loss(model, _experience(w, ids, device), PPO_SETTINGS)
    elif (
        w.step is Step.PAIRWISE_SCORE
    ):  # trl's RewardTrainer: the chosen and rejected halves of one batch, Bradley-Terry
        chosen, rejected = model(input_ids=ids, attention_mask=mask).logits[:, 0].chunk(2)
        loss = -F.logsigmoid(chosen - rejected).mean()
    elif w.step is Step.DPO:  # trl's DPOTrainer: the policy's log-probs, then the reference's (adapter off)
        logps, _entropy = _fused_logprobs(model, ids, mask, w.completion_len)
        ref = torch.zeros_like(logps)  # precomputed before training
        if w.reference_pass:
            with torch.no_grad(), adapter_disabled(_policy(model)):
                ref, _ = _fused_logprobs(model, ids, mask, w.completion_len)
        ratios = (logps - ref).sum(-1)
        chosen, rejected = ratios.chunk(2)
        loss = -F.logsigmoid(0.1 * (chosen - rejected)).mean()
    else:  # Step.GRPO, trl's dapo loss with one iteration: ratio exp(logp - logp.detach())
        logps, _entropy = _fused_logprobs(model, ids, mask, w.completion_len)
        advantages = torch.zeros(w.micro_batch, 1, device=device)
        loss = -(torch.exp(logps - logps.detach()) * advantages).mean()
    loss.backward()


def trace_step(
    model: nn.Module, w: Workload, device: Any, micro_steps: int = 2, every_decode_step: bool = True
) -> dict[str, int]:
    """Peak live bytes per phase of one stage step, beyond the tensors that exist before it (the weights).

    The training phase runs `micro_steps` accumulating micro-steps, so its peak includes gradients
    held from the one before, as under gradient accumulation. `every_decode_step=False` traces the
    generation as its prefill and its last step apart (`generation_peak`: far fewer ops).
    """
    vocab = _policy(model).config.vocab_size
    tracker = LiveTensorBytes()
    with meta_patches(device), tracker:
        if w.gen_batch and every_decode_step:
            with tracker.phase("generation"):
                generation(model, w, device, vocab)
        elif w.gen_batch:
            generation_peak(model, w, device, vocab, tracker)
        if w.step is Step.PPO and w.nograd_batch:
            with tracker.phase("no-grad pass"):
                nograd_pass(model, w, device, vocab)
        if w.step is Step.GRPO and w.reference_pass:
            with tracker.phase("no-grad pass"):
                grpo_logprob_pass(model, w, device, vocab)
        with tracker.phase("training step"):
            for _ in range(micro_steps):
                training_micro_step(model, w, device, vocab)
    for p in model.parameters():
        p.grad = None
    return tracker.phase_peaks


def measure_step(model: nn.Module, w: Workload, device: str | torch.device = "cpu") -> dict[str, int]:
    """Total live tensor bytes at each phase's peak of a real step: the model's own tensors, the
    optimizer's states after a first step, and what the step allocates (the same `trace_step`)."""
    from fitrl.memory import tensor_bytes

    optimizer = make_optimizer(model, w.optimizer)
    vocab = _policy(model).config.vocab_size
    with meta_patches(device):
        training_micro_step(model, w, device, vocab)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    held = tensor_bytes([*model.parameters(), *model.buffers(), *optimizer_state_tensors(optimizer)])
    return {phase: held + b for phase, b in trace_step(model, w, device).items()}
