"""A draft's weights as 8-bit blocks (``draft_weights="q8"``): its linear layers quantized once at load.

The target's weights are never touched: the draft only proposes, and verification keeps the output exactly the
target's whatever the draft computes. What a draft's forward costs, c (one draft forward over one target step), is
what the draft-model methods live on, and at one row that forward reads every weight once: as Q8_0-like blocks
(int8 codes and one fp16 scale per 32 weights, round to nearest, 8.5 bits a weight) it reads 0.53x the bytes of
bf16 through the same quantized kernel the target's GGUF blocks run on (:mod:`specdec.gguf_weights`).
"""
from __future__ import annotations

import torch
from torch import nn

from specdec.gguf_blocks import AffineCodes
from specdec.gguf_weights import QuantLinear, swap_in_quant

DRAFT_WEIGHTS = ("dense", "q8")
GROUP = 32


def q8_codes(weight: torch.Tensor, group: int = GROUP) -> AffineCodes:
    """Symmetric 8-bit codes of ``weight [N, K]`` (``K`` a multiple of ``group``): per group of ``group`` weights
    an fp16 scale ``max |w| / 127`` and codes ``round(w / scale)`` in -127..127 (GGUF's Q8_0)."""
    n, k = weight.shape
    if k % group:
        raise ValueError(f"a weight of {k} columns cannot be split into groups of {group}")
    w = weight.detach().float().reshape(n, k // group, group)
    scale = (w.abs().amax(-1) / 127.0).half().float()  # exact fp16 values, as the kernel stores them
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(w / safe[..., None]).clamp_(-127, 127).to(torch.int8).reshape(n, k)
    return AffineCodes(codes, scale, None, 8, group, True, "q8_0")


def quantize_draft(model: nn.Module, widen_prompts: bool = True) -> int:
    """Swap every linear layer of ``model`` whose input width is a multiple of :data:`GROUP` for a
    :class:`specdec.gguf_weights.QuantLinear` over its 8-bit codes, in place (dense Parameters kept: prompts
    and gradients use them); returns the number swapped. widen_prompts: as in
    :meth:`specdec.gguf_weights.QuantLinear.from_quant` (False for ``--linear packed``)."""
    if not any(isinstance(m, nn.Linear) for m in model.modules()):
        raise ValueError("draft_weights='q8': the draft has no linear layers to quantize")
    swapped = 0
    for name, linear in list(model.named_modules()):
        if not isinstance(linear, nn.Linear) or isinstance(linear, QuantLinear) or linear.in_features % GROUP:
            continue
        swap_in_quant(model, name, q8_codes(linear.weight), widen_prompts=widen_prompts)
        swapped += 1
    return swapped
