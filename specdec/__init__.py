"""specdec: fast, lossless speculative decoding for transformers causal LMs.

>>> import specdec
>>> out = specdec.generate("Summarise: ...", method="pld")   # embedded SmolLM2-135M-Instruct
>>> out.text, out.stats.target_calls

Engines that bring their own loop import the operators from :mod:`specdec.kernels`, which needs
torch alone: this top level is lazy, so ``import specdec.kernels`` does not load transformers (the
names below are imported on first access).
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "generate": "specdec.api",
    "SpecDecoder": "specdec.api",
    "GenerateOutput": "specdec.api",
    "SamplingConfig": "specdec.verify",
    "METHODS": "specdec.methods",
}
__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
