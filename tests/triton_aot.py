"""Compile every Triton kernel of ``specdec.triton_kernels`` ahead of time for a CUDA target.

No GPU is needed: Triton lowers to PTX and runs ptxas for e.g. ``sm_90``. This catches what the
interpreter forgives (type mismatches in loops and branches, dot shapes, pointer casts). Run in a
process without ``TRITON_INTERPRET=1``: ``python -m tests.triton_aot [capability] [--full]``.
"""
from __future__ import annotations

import os
import sys
import time

if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("run with TRITON_INTERPRET unset or 0: interpreted kernels cannot be compiled")

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from specdec.triton_kernels import kv_compact, topk_entropy, tree_attention, tree_verify

FLOAT_SCALARS = {"qk_scale", "temperature"}
SIZE_SCALARS = {"B", "HQ", "T", "S", "D", "N", "V", "KD"}  # upper-case, but not pointers


def signature(fn, pointers: dict[str, str], constexprs: dict) -> dict[str, str]:
    """Pointer arguments are the UPPERCASE ones but sizes (default ``*fp32``), other scalars ``i32``."""
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.isupper() and name not in SIZE_SCALARS:
            sig[name] = pointers.get(name, "*fp32")
        else:
            sig[name] = "fp32" if name in FLOAT_SCALARS else "i32"
    return sig


def variants(full: bool):
    """(kernel, pointer types, constexprs) triples: every kernel and code path once with small tiles,
    or (``full``) the launchers' real configurations (minutes of compilation)."""
    attn = [("fp16", False, 64, 3, True), ("fp32", True, 64, 1, False)]
    if full:
        attn = [(dt, dt == "fp32", hd, sp, sp > 1) for dt in ("fp16", "bf16", "fp32") for hd, sp in ((64, 1), (128, 3))]
    for dtype, f32_dot, head_d, splits, window in attn:
        ptrs = {p: f"*{dtype}" for p in ("Q", "KC", "VC", "KT", "VT", "O")}
        ptrs.update(LENS="*i64", MASK="*i32", POS="*i64")
        block = (64 if head_d == 64 else 32) if full else 16
        yield tree_attention._tree_attention_kernel, ptrs, dict(
            RATIO=4, HEAD_D=head_d, BLOCK_M=64 if full else 16, BLOCK_N=block, HAS_MASK=True, HAS_WINDOW=window,
            NUM_SPLITS=splits, F32_DOT=f32_dot)
    yield tree_attention._merge_splits_kernel, {"O": "*bf16"}, dict(NUM_SPLITS=3, HEAD_D=128, BLOCK_R=16)
    block_v = 2048 if full else 128
    for k_pad, splits in ((8, 1), (64, 2), (128, 1)) if full else ((16, 2),):
        ptrs = {"LOGITS": "*bf16", "KEY_PART": "*i64", "IDS": "*i64"}
        yield topk_entropy._topk_entropy_kernel, ptrs, dict(K_PAD=k_pad, BLOCK_V=max(block_v, k_pad),
                                                           NUM_SPLITS=splits, EXTRACT_MAX=8)
    yield topk_entropy._merge_kernel, {"KEY_PART": "*i64", "IDS": "*i64"}, dict(K_PAD=16, NUM_SPLITS=3, SPLITS_PAD=4)
    for elem in (tl.int16, tl.int64) if full else (tl.int16,):
        yield kv_compact._kv_compact_kernel, {p: "*i64" for p in ("PTRS", "META", "SRC", "DST", "CNT")}, dict(
            ELEM=elem, BLOCK_J=16, BLOCK_D=128)
    yield tree_verify._argmax_kernel, {"LOGITS": "*bf16", "PRED": "*i64"}, dict(ROWS=2, BLOCK_V=block_v)
    ints = {p: "*i64" for p in ("TOKENS", "PARENTS", "PRED", "PATH", "NEXT")}
    yield tree_verify._greedy_walk_kernel, {**ints, "VALID": "*u8", "LEN": "*i32"}, dict(HAS_VALID=True, BLOCK_T=64)
    for has_draft, has_ids, u in ((True, False, "*fp64"), (True, True, "*fp32"), (False, False, "*fp32")):
        yield tree_verify._sampling_walk_kernel, {**ints, "VALID": "*u8", "LEN": "*i32", "TARGET": "*bf16",
                                                  "DRAFT": "*fp16", "IDS": "*i64", "U": u}, dict(
            HAS_VALID=True, HAS_DRAFT=has_draft, HAS_IDS=has_ids, BLOCK_T=16, BLOCK_V=block_v)


def main(capability: int = 90, full: bool = False) -> None:
    target = GPUTarget("cuda", capability, 32)
    for fn, ptrs, constexprs in variants(full):
        start = time.perf_counter()
        src = ASTSource(fn=fn, signature=signature(fn, ptrs, constexprs), constexprs=constexprs)
        triton.compile(src, target=target)
        print(f"{fn.__name__} {constexprs}: {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 90, full="--full" in sys.argv)
