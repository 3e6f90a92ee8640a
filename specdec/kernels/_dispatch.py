"""Backend selection for the specdec operators.

Each operator has a torch reference (always available) and optional native backends: the C++
extension ``specdec._C`` for CPU tensors and Triton/CUDA kernels for CUDA tensors. The backend is
chosen per call from the tensors' device, unless forced by ``backend=`` or by the environment
variable ``SPECDEC_BACKEND`` (``torch`` forces the references everywhere).
"""
from __future__ import annotations

import functools
import os
import warnings

import torch

BACKENDS = ("auto", "torch", "cpp", "triton", "cuda")


@functools.lru_cache(maxsize=None)
def native_ops() -> object | None:
    """``torch.ops.specdec`` if the compiled extension ``specdec._C`` loads, else None."""
    try:
        from specdec import _C  # noqa: F401  (registers torch.ops.specdec.*)
    except ImportError as exc:  # the package still works, on the references
        if os.environ.get("SPECDEC_REQUIRE_EXT"):
            raise
        warnings.warn(f"specdec._C is not built ({exc}); using the torch reference kernels", stacklevel=2)
        return None
    from specdec.kernels import _fake  # noqa: F401  (fake kernels for torch.compile)
    return torch.ops.specdec


def has_native(op: str) -> bool:
    """Whether the compiled extension provides ``op``."""
    ops = native_ops()
    return ops is not None and hasattr(ops, op)


def choose(op: str, device: torch.device, backend: str | None, native_devices: tuple[str, ...]) -> str:
    """Return ``"torch"`` or ``"native"`` for one call of ``op`` on ``device``."""
    backend = backend or os.environ.get("SPECDEC_BACKEND", "auto")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    if backend == "torch":
        return "torch"
    available = device.type in native_devices and has_native(op)
    if backend == "auto":
        return "native" if available else "torch"
    if not available:
        raise RuntimeError(f"backend {backend!r} has no {op} kernel for {device.type} tensors")
    return "native"
