"""specdec: fast, lossless speculative decoding for transformers causal LMs.

>>> import specdec
>>> out = specdec.generate("Summarise: ...", method="pld")   # embedded SmolLM2-135M-Instruct
>>> out.text, out.stats.target_calls

Engines that bring their own loop import the operators from :mod:`specdec.kernels`.
"""
from specdec.api import METHODS, GenerateOutput, SpecDecoder, generate
from specdec.verify import SamplingConfig

__version__ = "0.1.0"
__all__ = ["generate", "SpecDecoder", "GenerateOutput", "SamplingConfig", "METHODS", "__version__"]
