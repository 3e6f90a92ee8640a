"""Linear layers for CPU targets that verify drafts: :class:`SkinnyLinear` and :func:`use_skinny_linear`.

A speculative step runs the target over T drafted tokens (T ~ 2-32). On CPUs without bf16 matrix
instructions torch's bf16 GEMM for more than one row re-reads the weights once per row, so the step
costs about T one-token steps, and its fp32 GEMM takes a slow path for 2-3 rows; speculation then
cannot gain. :func:`specdec.kernels.skinny_linear` streams the weights once for all rows and is
batch-invariant (a row's result does not depend on which other rows share the call), so verifying T
tokens agrees bit for bit with one-token decoding through every linear layer.

Prefill has the opposite problem: a bf16/fp16 product over many rows on such a CPU is 3-6x slower
than widening the weights to fp32 and calling the fp32 GEMM, so those calls are widened (where the
CPU has native bf16 matrix instructions, torch's own kernel is kept).

The swap replaces modules the way transformers' quantizers do (same parameters, same state dict);
no model code is changed. Calls with more rows than ``max_rows`` (prefill), with gradients, or off
the CPU go to ``nn.Linear.forward`` (widened as above).
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from specdec.kernels import has_native, native_ops

LINEAR_KERNELS = ("auto", "skinny", "torch")


@functools.lru_cache(maxsize=None)
def _op():
    """``torch.ops.specdec.skinny_linear.default``; raises where the compiled extension is missing."""
    ops = native_ops()
    if ops is None or not hasattr(ops, "skinny_linear"):
        raise RuntimeError("SkinnyLinear needs the compiled extension specdec._C (pip install --no-build-isolation -e .)")
    return ops.skinny_linear.default


_HALF_GEMM_FEATURES = {
    torch.bfloat16: ("_is_avx512_bf16_supported", "_is_amx_tile_supported"),
    torch.float16: ("_is_amx_fp16_supported",),
}


@functools.lru_cache(maxsize=None)
def cpu_has_half_gemm(dtype: torch.dtype) -> bool:
    """Whether this CPU has matrix instructions for ``dtype`` (bf16: AVX-512 BF16 or AMX; fp16: AMX-FP16),
    for which torch's half-precision GEMM is fast; without them it is a slow fallback."""
    cpu = torch.cpu
    return any(getattr(cpu, name, lambda: False)() for name in _HALF_GEMM_FEATURES.get(dtype, ()))


def widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x . W^T + b`` for half-precision CPU tensors through the fp32 GEMM, rounded back to ``x``'s dtype.

    x: ``[..., K]``; weight: ``[N,K]``; bias: ``[N]`` or None -> ``[..., N]``. Widening costs one pass
    over the weights, repaid from a few dozen rows on: :class:`SkinnyLinear` uses it for every call over
    ``max_rows`` rows (a prompt, or a verification wider than ``max_rows`` tokens).
    """
    out = nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return out.to(x.dtype)


def default_max_rows(dtype: torch.dtype) -> int:
    """Rows up to which the skinny kernel is used on CPU. Measured on an AVX2 CPU: torch's fp32 GEMM
    catches up at about 16 rows. For bf16 the kernel beats torch's bf16 fallback at any size and the
    widened fp32 GEMM (:func:`widened_linear`) up to about 64 rows (2.7 ms for a [1536, 576] product over
    64 rows, 2 threads, against about 2.5 ms for the skinny kernel). fp16 was not measured and shares bf16's limit."""
    return 16 if dtype == torch.float32 else 64


class SkinnyLinear(nn.Linear):
    """``nn.Linear`` whose CPU products over at most ``max_rows`` rows use :func:`specdec.kernels.skinny_linear`;
    with ``widen``, half-precision CPU products over more rows use :func:`widened_linear`."""

    max_rows: int = 16
    widen: bool = False

    @classmethod
    def from_linear(cls, linear: nn.Linear, max_rows: int, widen: bool | None = None) -> "SkinnyLinear":
        """A SkinnyLinear sharing ``linear``'s weight and bias Parameters (ties are kept).

        widen: run half-precision products over more than ``max_rows`` rows through
        :func:`widened_linear` (default: where the CPU lacks bf16/fp16 matrix instructions)."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        new.weight = linear.weight
        new.bias = linear.bias
        new.max_rows = max_rows
        new.widen = (not cpu_has_half_gemm(linear.weight.dtype)) if widen is None else widen
        new.train(linear.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: ``[..., in_features]`` -> ``[..., out_features]``."""
        # Called ~200 times per target step: the checks are the cheap ones, and the operator is called
        # directly (skinny_linear's argument checks cost more than the kernel at one row).
        k = self.in_features
        if (x.is_cpu and x.dtype == self.weight.dtype
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
            if 0 < x.numel() <= self.max_rows * k and x.shape[-1] == k:
                shape = x.shape[:-1] + (self.out_features,)
                return _op()(x.reshape(-1, k), self.weight, self.bias).view(shape)
            if self.widen and x.dtype in (torch.bfloat16, torch.float16):
                return widened_linear(x, self.weight, self.bias)
        return super().forward(x)


def use_skinny_linear(model: nn.Module, max_rows: int | None = None) -> int:
    """Replace every ``nn.Linear`` of ``model`` in place by a :class:`SkinnyLinear` sharing its parameters.

    max_rows: largest product sent to the kernel (default :func:`default_max_rows` of the weights'
    dtype). Returns the number of layers replaced.
    """
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                rows = max_rows if max_rows is not None else default_max_rows(child.weight.dtype)
                setattr(parent, name, SkinnyLinear.from_linear(child, rows))
                count += 1
    return count


def apply_linear_kernel(model: nn.Module, kernel: str, device: str) -> bool:
    """Apply the ``--linear`` choice: ``skinny``, ``torch`` (leave as is) or ``auto`` (skinny on CPU when
    the compiled extension is built). Returns whether the skinny kernel was installed."""
    if kernel not in LINEAR_KERNELS:
        raise ValueError(f"unknown linear kernel {kernel!r}: use one of {', '.join(LINEAR_KERNELS)}")
    if kernel == "torch":
        return False
    if kernel == "auto" and not (torch.device(device).type == "cpu" and has_native("skinny_linear")):
        return False
    _op()  # fail here, not in the first forward, without the extension
    use_skinny_linear(model)
    return True
