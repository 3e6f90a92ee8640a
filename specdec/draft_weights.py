"""A draft's weights as 8-bit or 4-bit blocks (``draft_weights="q8"`` / ``"q4"``): its linear layers quantized once at load.

The target's weights are never touched: the draft only proposes, and verification keeps the output exactly the
target's whatever the draft computes. What a draft's forward costs, c (one draft forward over one target step), is
what the draft-model methods live on, and at one row that forward reads every weight once: as Q8_0-like blocks
(int8 codes and one fp16 scale per 32 weights, round to nearest, 8.5 bits a weight) it reads 0.53x the bytes of
bf16 through the same quantized kernel the target's GGUF blocks run on (:mod:`specdec.gguf_weights`). As 4-bit
blocks with a scale and a minimum per 32 weights (GGUF's Q4_1, 5 bits a weight) it reads 0.31x the bytes of bf16, and
proposes a little worse: the codes are coarser.
"""
from __future__ import annotations

import torch
from torch import nn

from specdec.gguf_blocks import AffineCodes
from specdec.gguf_weights import QuantLinear, swap_in_quant

DRAFT_WEIGHTS = ("dense", "q8", "q4")
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


def q4_codes(weight: torch.Tensor, group: int = GROUP) -> AffineCodes:
    """Asymmetric 4-bit codes of ``weight [N, K]`` (``K`` a multiple of ``group``): per group of ``group`` weights
    an fp16 minimum ``m`` and scale ``d = (max - m) / 15``, and codes ``round((w - m) / d)`` in 0..15, so that a
    weight reads back as ``d * code + m`` (GGUF's Q4_1)."""
    n, k = weight.shape
    if k % group:
        raise ValueError(f"a weight of {k} columns cannot be split into groups of {group}")
    w = weight.detach().float().reshape(n, k // group, group)
    lo = w.amin(-1).half().float()  # exact fp16 values, as the kernel stores them
    scale = ((w.amax(-1) - lo) / 15.0).half().float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((w - lo[..., None]) / safe[..., None]).clamp_(0, 15).to(torch.int8).reshape(n, k)
    return AffineCodes(codes, scale, lo, 4, group, True, "q4_1")


CODES = {"q8": q8_codes, "q4": q4_codes}


def _codes(kind: str):
    """The function that makes ``kind``'s codes (:data:`CODES`), or a clear error."""
    if kind not in CODES:
        raise ValueError(f"draft weights {kind!r}: expected one of {', '.join(CODES)}")
    return CODES[kind]


def quantize_draft(model: nn.Module, widen_prompts: bool = True, kind: str = "q8") -> int:
    """Swap every linear layer of ``model`` whose input width is a multiple of :data:`GROUP` for a
    :class:`specdec.gguf_weights.QuantLinear` over its ``kind`` codes (``"q8"``: :func:`q8_codes`, ``"q4"``:
    :func:`q4_codes`), in place (dense Parameters kept: prompts and gradients use them); returns the number swapped.
    widen_prompts: as in :meth:`specdec.gguf_weights.QuantLinear.from_quant` (False for ``--linear packed``)."""
    codes = _codes(kind)
    if not any(isinstance(m, nn.Linear) for m in model.modules()):
        raise ValueError(f"draft_weights={kind!r}: the draft has no linear layers to quantize")
    swapped = 0
    for name, linear in list(model.named_modules()):
        if not _quantizable(linear):
            continue
        swap_in_quant(model, name, codes(linear.weight), widen_prompts=widen_prompts)
        swapped += 1
    return swapped


def _quantizable(module: nn.Module) -> bool:
    """Whether :func:`quantize_draft` swaps ``module`` (and :func:`round_weights` rounds it): a dense linear layer
    whose input width is a multiple of :data:`GROUP`."""
    return isinstance(module, nn.Linear) and not isinstance(module, QuantLinear) and module.in_features % GROUP == 0


def round_weights(model: nn.Module, kind: str) -> int:
    """Replace the weight of every linear layer of ``model`` that :func:`quantize_draft` would swap by its ``kind``
    codes' values (dequantized, in the weight's dtype), in place; returns the number rounded. The model then computes,
    at any row count, the function a quantized draft's few-row forwards compute (up to summation order): what
    ``python -m specdec.distill.agreement --draft-weights`` measures."""
    codes = _codes(kind)
    rounded = 0
    for linear in list(model.modules()):
        if _quantizable(linear):
            # A new Parameter, not an in-place copy: a weight tied to the embedding stays dense there, as in a
            # quantized draft (its QuantLinear keeps the dense Parameter for everything but its products).
            w = codes(linear.weight).dequantize().to(linear.weight.dtype)
            linear.weight = nn.Parameter(w, requires_grad=False)
            rounded += 1
    return rounded
