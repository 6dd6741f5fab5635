"""Frozen bitsandbytes 8-bit layers on a CPU: fitrl's own product, bitsandbytes' training product to
the bit, keeping nothing for backward but the int8 weight (`FrozenInt8Product`), through one shared
dequantization buffer (`DequantScratch`). `fitrl.modeling.load_causal_lm` installs it on CPU loads."""

from __future__ import annotations

import functools
import types
from typing import Any

import torch
from torch import nn


def int8_layers_on_cpu(model: nn.Module) -> None:
    """Run bitsandbytes' frozen 8-bit layers on a CPU through `FrozenInt8Product`.

    bitsandbytes picks an 8-bit layer's CPU product by the layer's training flag: int8-quantized
    inputs in eval, the dequantized weight in training (up to 0.05 apart in a token's log-prob on the
    benchmark's model). PPO divides a probability taken in training (the update) by ones taken in
    eval (sampling, the reference), so the two must agree. Its training product also keeps every
    layer's input for a weight gradient a frozen layer never gets: 19 of the 68 MiB of tensors a PPO
    step holds at the benchmark's shapes. The GPU keeps bitsandbytes' own int8 product.
    """
    import bitsandbytes as bnb

    scratch = DequantScratch()
    for module in model.modules():
        frozen = isinstance(module, bnb.nn.Linear8bitLt) and not module.state.has_fp16_weights
        if frozen and module.weight.device.type == "cpu":
            module.forward = types.MethodType(functools.partial(_frozen_int8_forward, scratch=scratch), module)


def _frozen_int8_forward(self: Any, x: torch.Tensor, scratch: DequantScratch) -> torch.Tensor:
    if self.weight.CB is not None:  # first call: bitsandbytes moves the int8 weight into the layer's state
        self.init_8bit_state()
        self.weight.data = self.state.CB
    bias = None if self.bias is None else self.bias.to(x.dtype)
    return FrozenInt8Product.apply(x, self.state.CB, self.state.SCB, bias, scratch)


class DequantScratch:
    """One buffer per dtype that every layer of a model dequantizes its weight into, in turn.

    A dequantized weight lives for one product only (a forward's output, a backward's input
    gradient), so one buffer the size of the largest weight serves them all. Reused, it stays in
    the CPU's cache, where a fresh tensor per product would be allocated and faulted in each time:
    an 8-bit forward and backward at the TRL benchmark's shapes runs 7-13% faster, and holds no
    more than the one transient weight it held before.
    """

    def __init__(self) -> None:
        self.buffers: dict[torch.dtype, torch.Tensor] = {}

    def dequantized(self, cb: torch.Tensor, scb: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`cb * scb / 127` (a scale per row) in `dtype`, valid until this scratch's next call."""
        buffer = self.buffers.get(dtype)
        if buffer is None or buffer.numel() < cb.numel():
            buffer = self.buffers[dtype] = torch.empty(cb.numel(), dtype=dtype, device=cb.device)
        # bitsandbytes' own form (so the same bits), and on a CPU 25x faster than `torch.mul(cb, scale)`,
        # whose mixed int8-float product with a broadcast scale takes a slow path.
        return buffer[: cb.numel()].view(cb.shape).copy_(cb).mul_(scb.unsqueeze(1).mul(1.0 / 127.0))


class FrozenInt8Product(torch.autograd.Function):
    """`x W^T + b` for a frozen int8 weight `W = CB * SCB / 127` (a scale per output row), as
    bitsandbytes computes it in training on a CPU (the same bits), keeping nothing for backward but
    the int8 weight the layer holds anyway: the gradient reaches `x` only."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        cb: torch.Tensor,
        scb: torch.Tensor,
        bias: torch.Tensor | None,
        scratch: DequantScratch,
    ) -> Any:
        ctx.save_for_backward(cb, scb)
        ctx.scratch = scratch
        return nn.functional.linear(x, scratch.dequantized(cb, scb, x.dtype), bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        cb, scb = ctx.saved_tensors
        grad_x = grad @ ctx.scratch.dequantized(cb, scb, grad.dtype) if ctx.needs_input_grad[0] else None
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.needs_input_grad[3] else None
        return grad_x, None, None, grad_bias, None
