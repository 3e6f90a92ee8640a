"""In-place KV-cache compaction of accepted entries, every layer's caches in one launch.

The caches are separate tensors, so the kernel receives a device table of their base addresses
(plus their head counts, head dims and strides) and casts each address to a typed pointer. Bytes
are moved, not values: caches are grouped by element size and each group is one launch with an
integer pointer type of that size (in practice one launch: all caches share a dtype).

Program ``(c, b, h)`` owns head ``h`` of row ``b`` of cache ``c`` and walks its ``counts[b]``
moves in tiles of ``BLOCK_J`` positions: the whole tile is loaded, the CTA synchronises, then the
tile is stored. That is safe in place because sources are ascending and ``src[j] >= dst_start +
j``: a store to ``dst_start + j'`` can only clobber the source of an earlier ``j < j'`` (which the
barrier orders before it, in this tile or an earlier one), never of a later one.

Specification: :func:`specdec.kernels.reference.kv_compact`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_INT_OF_SIZE = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}
_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # address/metadata tables per cache list
_MAX_TABLES = 32


@triton.jit
def _kv_compact_kernel(
    PTRS, META, SRC, DST, CNT, s_src_b, s_src_j, n, S,
    ELEM: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr,
):
    c = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    heads = tl.load(META + c * 6 + 0)
    dim = tl.load(META + c * 6 + 1)
    st_b = tl.load(META + c * 6 + 2)
    st_h = tl.load(META + c * 6 + 3)
    st_s = tl.load(META + c * 6 + 4)
    st_d = tl.load(META + c * 6 + 5)
    base = tl.load(PTRS + c).to(tl.pointer_type(ELEM)) + b * st_b + h * st_h
    count = tl.minimum(tl.load(CNT + b).to(tl.int64), n)
    count = tl.where(h < heads, count, 0)  # programs past this cache's H idle
    d0 = tl.load(DST + b).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < dim
    for j0 in range(0, count, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        src = tl.load(SRC + b * s_src_b + j * s_src_j, mask=j < count, other=0).to(tl.int64)
        dst = d0 + j
        # Rows already in place are skipped; out-of-range positions are dropped, not written.
        move = (j < count) & (src != dst) & (src >= 0) & (src < S) & (dst >= 0) & (dst < S)
        m = move[:, None] & col_ok[None, :]
        rows = tl.load(base + src[:, None] * st_s + cols[None, :] * st_d, mask=m)
        tl.debug_barrier()  # every load of the tile before any store of it
        tl.store(base + dst[:, None] * st_s + cols[None, :] * st_d, rows, mask=m)


def _tables(caches: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Device tables of base addresses ``[C] int64`` and metadata ``[C, 6] int64`` (H, D, the four
    strides), cached per list of caches so a decode loop uploads them once."""
    key = tuple((c.data_ptr(), tuple(c.shape), c.stride()) for c in caches) + (str(device),)
    hit = _TABLES.get(key)
    if hit is None:
        ptrs = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64)
        meta = torch.tensor([[c.shape[1], c.shape[3], *c.stride()] for c in caches], dtype=torch.int64)
        if len(_TABLES) >= _MAX_TABLES:
            _TABLES.clear()
        hit = _TABLES[key] = (ptrs.to(device), meta.to(device))
    return hit


def kv_compact(caches: list[torch.Tensor], src: torch.Tensor, dst_start: torch.Tensor, counts: torch.Tensor) -> None:
    """Move ``cache[b, :, src[b, j]]`` to ``cache[b, :, dst_start[b] + j]`` for ``j < counts[b]``, in place (Triton).

    Args:
        caches: list of ``[B, H, S, D]`` tensors on one device (every layer's keys and values;
            ``H``, ``D`` and dtype may differ between caches, ``B`` and ``S`` may not).
        src: ``[B, n]`` int source positions, ascending per row, ``src[b, j] >= dst_start[b] + j``.
        dst_start: ``[B]`` int; counts: ``[B]`` int in ``[0, n]``.

    The contract is not checked on the host (that would need a device sync); moves whose source or
    destination falls outside ``[0, S)`` are skipped.
    """
    if not caches or src.numel() == 0:
        return
    b, n = src.shape
    s = caches[0].shape[2]
    for c in caches:
        if c.dim() != 4 or c.shape[0] != b or c.shape[2] != s or c.device != src.device:
            raise ValueError(f"every cache must be [B={b}, H, S={s}, D] on {src.device}, got {tuple(c.shape)} on {c.device}")
    groups: dict[int, list[torch.Tensor]] = {}
    for c in caches:
        if c.element_size() not in _INT_OF_SIZE:
            raise ValueError(f"unsupported cache dtype {c.dtype}")
        groups.setdefault(c.element_size(), []).append(c)
    block_j = min(16, triton.next_power_of_2(n))
    for size, group in groups.items():
        ptrs, meta = _tables(group, src.device)
        h_max = max(c.shape[1] for c in group)
        if h_max == 0:
            continue
        block_d = triton.next_power_of_2(max(c.shape[3] for c in group))
        _kv_compact_kernel[(len(group), b, h_max)](
            ptrs, meta, src, dst_start, counts, src.stride(0), src.stride(1), n, s,
            ELEM=_INT_OF_SIZE[size], BLOCK_J=block_j, BLOCK_D=block_d,
        )
