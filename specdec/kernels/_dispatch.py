"""Backend selection for the specdec operators.

Each operator has a torch reference (always available) and optional native backends: the C++
extension ``specdec._C`` for CPU tensors (``cpp``), and for CUDA tensors CUDA kernels in the same
extension (``cuda``) or Triton kernels in ``specdec.triton_kernels`` (``triton``). The backend is
chosen per call from the tensors' device, unless forced by ``backend=`` or by the environment
variable ``SPECDEC_BACKEND`` (``torch`` forces the references everywhere).

``auto`` prefers, on CPU: C++ then torch; on CUDA: the CUDA kernel, then Triton, then torch (with
a warning when Triton is missing). A forced backend that cannot run the operator on the tensors'
device raises. ``triton`` may also be forced on CPU tensors when ``TRITON_INTERPRET=1`` (Triton's
interpreter; the tests use it).
"""
from __future__ import annotations

import functools
import importlib
import os
import warnings
from types import ModuleType

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


def has_native(op: str, device_type: str | None = None) -> bool:
    """Whether the compiled extension provides ``op`` (with a kernel for ``device_type == "cuda"`` if asked)."""
    ops = native_ops()
    if ops is None or not hasattr(ops, op):
        return False
    if device_type == "cuda":
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"specdec::{op}", "CUDA")
    return True


@functools.lru_cache(maxsize=None)
def has_triton() -> bool:
    """Whether ``triton`` imports (checked once, lazily)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_kernels(module: str) -> ModuleType:
    """``specdec.triton_kernels.<module>``, imported on first use."""
    return importlib.import_module(f"specdec.triton_kernels.{module}")


@functools.lru_cache(maxsize=None)
def _warn_no_triton(op: str) -> None:
    warnings.warn(f"triton is not installed: {op} on CUDA tensors runs the torch reference", stacklevel=3)


def choose(
    op: str,
    device: torch.device,
    backend: str | None,
    native_devices: tuple[str, ...],
    triton: bool = False,
    triton_pays: bool = True,
) -> str:
    """Return ``"torch"``, ``"native"`` (``torch.ops.specdec.<op>``) or ``"triton"`` for one call of ``op``.

    native_devices: device types (``"cpu"``, ``"cuda"``) on which the extension may implement ``op``;
    triton: whether ``specdec.triton_kernels`` implements ``op`` (for CUDA tensors);
    triton_pays: whether ``auto`` should take that Triton kernel for this call's shape (False where it was
    measured slower than the torch reference; a forced ``triton`` still runs it).
    """
    backend = backend or os.environ.get("SPECDEC_BACKEND", "auto")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    if backend == "torch":
        return "torch"
    kind = device.type
    native = kind in native_devices and has_native(op, kind)
    if backend == "auto":
        if native:
            return "native"
        if triton and triton_pays and kind == "cuda":
            if has_triton():
                return "triton"
            _warn_no_triton(op)
        return "torch"
    if backend == "cpp" and kind == "cpu" and native:
        return "native"
    if backend == "cuda" and kind == "cuda" and native:
        return "native"
    interpreted = kind == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    if backend == "triton" and triton and (kind == "cuda" or interpreted) and has_triton():
        return "triton"
    raise RuntimeError(f"backend {backend!r} has no {op} kernel for {kind} tensors")
