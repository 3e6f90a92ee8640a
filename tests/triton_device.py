"""Where the Triton tests run, decided once for every Triton test module.

In Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, the default here and in
``tests/conftest.py``), or on CUDA tensors with ``TRITON_INTERPRET=0`` and a GPU. Import this module before
anything imports triton: the interpreter is chosen when triton is first imported.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first `import triton`

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def triton_device() -> str:
    """``"cpu"`` (the interpreter) or ``"cuda"``; skips the calling test module where neither can run Triton
    (no triton, no GPU with ``TRITON_INTERPRET=0``, or triton imported before the interpreter was chosen)."""
    triton = pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")
    if INTERPRET:
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(triton.language.standard.topk, InterpretedFunction):
            pytest.skip("triton was imported before TRITON_INTERPRET=1 was set: export TRITON_INTERPRET=1",
                        allow_module_level=True)
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    pytest.skip("no GPU and TRITON_INTERPRET != 1: nothing can run the Triton kernels", allow_module_level=True)
