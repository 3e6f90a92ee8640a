"""Every environment switch specdec reads, declared in one place: its name, what it changes, its default.

Modules read a switch through :func:`get`, which refuses an undeclared name, so :data:`SWITCHES` is the whole
list (``tests/test_imports.py`` checks that no other module reads a ``SPECDEC_*`` variable itself). The one
exceptions are :mod:`specdec.kernels`, which engines import with torch alone and which reads its two switches
(``SPECDEC_BACKEND``, ``SPECDEC_REQUIRE_EXT``) directly, and the C++ extension (``SPECDEC_ATTENTION_DIRECT_ROWS``,
``SPECDEC_ATTENTION_DIRECT8_ROWS``, ``SPECDEC_ATTENTION_SPLIT_KEYS``, ``SPECDEC_AMX``);
they are declared here all the same.
This module imports nothing but the standard library.
"""
from __future__ import annotations

import os

SWITCHES: dict[str, str] = {
    # where things are kept
    "SPECDEC_CACHE": "the cache folder: unpacked models, n-gram tables, decoded GGUF codes, compiled graphs "
                     "(default ~/.cache/specdec)",
    "SPECDEC_TABLES_CACHE": "where model-derived n-gram tables are cached (default $SPECDEC_CACHE/ngram_tables)",
    # the compiled forward
    "SPECDEC_COMPILE": "the default of --compile / compile=: auto, on, off or saved (default auto)",
    "SPECDEC_PRECOMPILE": "0: do not save or load whole-forward graphs; compiled runners compile in process "
                          "(default 1)",
    # routes inside a forward (baked into a compiled graph: see GRAPH_SWITCHES)
    "SPECDEC_ATTN": "tree attention: kernel or sdpa (default: kernel where a tree-attention kernel exists for the "
                    "device, else sdpa)",
    "SPECDEC_WIDE_TREE_SDPA": "on AVX-512 CPUs, forwards of at least this many tokens per row attend through SDPA; "
                              "0: always the kernel (default 8)",
    "SPECDEC_BF16_DOT": "0: bf16 products of the packed linear kernel stay on its fp32 path even where the CPU has "
                        "AVX-512-BF16 (an A/B switch)",
    "SPECDEC_AMX": "0: quantized-weight products stay on the vector kernel even where a caller lets bf16 products of "
                   "many rows run on the CPU's AMX tiles (read by csrc/quant_linear.cpp at each call), and GGUF "
                   "models loaded then hand bf16 products past 12 rows, not 32, to torch's GEMM: the configuration "
                   "before the tiles, for A/B runs",
    "SPECDEC_ATTENTION_DIRECT_ROWS": "the row limit (query heads x queries) up to which the C++ tree-attention "
                                     "kernel skips its key panels, on any CPU; 0 forces the panels (default: 32 "
                                     "with AVX-512, else 0; read by csrc/tree_attention.cpp at each call)",
    "SPECDEC_ATTENTION_DIRECT8_ROWS": "the row limit up to which the C++ tree-attention kernel takes its 8-lane "
                                      "direct paths (before the 16-lane ones and the key panels), on any CPU; 0: "
                                      "never (default: 32 on AVX2 without AVX-512, else 0; read by "
                                      "csrc/tree_attention.cpp at each call)",
    "SPECDEC_ATTENTION_SPLIT_KEYS": "key rows per split of the C++ tree-attention kernel (cut at fixed rows, run as "
                                    "tasks of their own, merged afterwards), rounded up to 256, in every call; 0 "
                                    "or less: no splits (default: 512 in calls of at most 3 (row, kv head) pairs, "
                                    "none in wider ones; read by csrc/tree_attention.cpp at each call)",
    "SPECDEC_BACKEND": "the kernels' backend: auto, native, triton or torch (torch: the references everywhere; "
                       "default auto)",
    "SPECDEC_REQUIRE_EXT": "set: fail when the compiled extension specdec._C does not load, instead of falling "
                           "back to the torch references with a warning",
    # integrations
    "SPECDEC_VLLM_OPTIONS": "the specdec proposers' options inside vLLM, a JSON object (vLLM's config has no "
                            "field for them)",
}

# Read at import or inside a forward and baked into a compiled graph: part of a saved graph's fingerprint.
GRAPH_SWITCHES = ("SPECDEC_ATTN", "SPECDEC_WIDE_TREE_SDPA", "SPECDEC_BACKEND", "SPECDEC_BF16_DOT")


def get(name: str, default: str | None = None) -> str | None:
    """The value of switch ``name`` from the environment (``default`` where unset). ``KeyError`` for a name
    :data:`SWITCHES` does not declare."""
    if name not in SWITCHES:
        raise KeyError(f"{name} is not a declared specdec switch (specdec.settings.SWITCHES)")
    return os.environ.get(name, default)
