"""Tree verification on device: greedy (argmax) and lossless sampling (recursive rejection sampling).

Greedy is two launches: one program per node takes the argmax of its ``V`` logits (per-lane
running maxima, first index on ties, like ``torch.argmax``), then one program per row walks the
nodes in index order (parents precede children), accepting a node iff its parent is accepted and
its token is the parent's argmax, and traces the deepest accepted node back to the root. The walk
keeps the per-node state of a row in registers (``T`` is small), so nothing goes back to the host.

Sampling is one program per row that walks the tree like the reference: the current
distribution ``p`` is either the target row of the last accepted node (read in place) or a
residual ``norm(max(p - q, 0))`` kept in an fp32 scratch row ``[V]``; each tried child costs one
or two passes over ``V``, the final sample two more.

Specification: :func:`specdec.kernels.reference.tree_verify_greedy` and
:func:`specdec.kernels.reference.tree_verify_sampling`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _argmax_kernel(LOGITS, s_b, s_t, s_v, N, T, V, PRED, ROWS: tl.constexpr, BLOCK_V: tl.constexpr):
    node = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # b * T + t; 64-bit: B * T * V > 2^31
    node_ok = node < N
    base = LOGITS + (node // T) * s_b + (node % T) * s_t
    lanes = tl.arange(0, BLOCK_V)
    best = tl.full([ROWS, BLOCK_V], float("-inf"), tl.float32)
    best_i = tl.full([ROWS, BLOCK_V], 2**31 - 1, tl.int32)
    for start in range(0, V, BLOCK_V):
        offs = start + lanes
        ok = node_ok[:, None] & (offs < V)[None, :]
        x = tl.load(base[:, None] + offs[None, :] * s_v, mask=ok, other=float("-inf")).to(tl.float32)
        # Strictly greater: a lane keeps its first maximum. NaN (x != x) counts as the largest, as in torch.argmax.
        take = ((x > best) | ((x != x) & (best == best))) & ok
        best = tl.where(take, x, best)
        best_i = tl.where(take, offs[None, :], best_i)
    best_i = tl.where(best_i == 2**31 - 1, 0, best_i)  # an all -inf row: index 0
    has_nan = tl.max((best != best).to(tl.int32), 1) > 0
    top = tl.max(tl.where(best != best, float("-inf"), best), 1)
    hit = tl.where(has_nan[:, None], best != best, best == top[:, None])
    tl.store(PRED + node, tl.min(tl.where(hit, best_i, 2**31 - 1), 1).to(tl.int64), mask=node_ok)


@triton.jit
def _trace_path(PATH, LEN, b, parents, depth, last, lanes, T, BLOCK_T: tl.constexpr):
    """Write the root-to-``last`` path ``[T]`` (-1 padded) and its length, from register vectors.

    Registers cannot be indexed: ``vec[i]`` is read as ``sum(where(lanes == i, vec, 0))``.
    """
    length = tl.sum(tl.where(lanes == last, depth, 0), 0) + 1
    path = tl.full([BLOCK_T], -1, tl.int64)
    node = last
    for step in range(0, T):
        alive = step < length
        path = tl.where((lanes == length - 1 - step) & alive, node, path)
        node = tl.where(alive, tl.maximum(tl.sum(tl.where(lanes == node, parents, 0), 0), 0), node)
    tl.store(PATH + b * T + lanes, path, mask=lanes < T)
    tl.store(LEN + b, length.to(tl.int32))


@triton.jit
def _greedy_walk_kernel(TOKENS, PARENTS, VALID, PRED, PATH, LEN, NEXT, s_tok_b, s_tok_t, s_par_b, s_par_t,
                        s_val_b, s_val_t, T, HAS_VALID: tl.constexpr, BLOCK_T: tl.constexpr):
    b = tl.program_id(0)
    lanes = tl.arange(0, BLOCK_T)
    in_row = lanes < T
    parents = tl.load(PARENTS + b * s_par_b + lanes * s_par_t, mask=in_row, other=-1).to(tl.int64)
    if HAS_VALID:
        root_ok = tl.load(VALID + b * s_val_b) != 0
    else:
        root_ok = True
    accepted = tl.where((lanes == 0) & root_ok, 1, 0)
    depth = tl.zeros([BLOCK_T], tl.int64)
    for i in range(1, T):
        par = tl.load(PARENTS + b * s_par_b + i * s_par_t).to(tl.int64)
        anc = tl.maximum(par, 0)
        ok = tl.load(TOKENS + b * s_tok_b + i * s_tok_t) == tl.load(PRED + b * T + anc)
        if HAS_VALID:
            ok = ok & (tl.load(VALID + b * s_val_b + i * s_val_t) != 0)
        # accepted[anc] and depth[anc] live in registers: a masked sum reads one lane.
        acc_i = ok & (tl.sum(tl.where(lanes == anc, accepted, 0), 0) != 0)
        d_i = tl.where(par >= 0, tl.sum(tl.where(lanes == anc, depth, 0), 0) + 1, 0)
        accepted = tl.where(lanes == i, acc_i.to(tl.int32), accepted)
        depth = tl.where(lanes == i, d_i, depth)
    # Deepest accepted node, lowest index among equals; node 0 when nothing (not even the root) is.
    score = tl.where(accepted != 0, depth * T + (T - 1 - lanes), -1)
    score = tl.where(in_row, score, -2)
    last = tl.argmax(score, 0, tie_break_left=True).to(tl.int64)
    _trace_path(PATH, LEN, b, parents, depth, last, lanes, T, BLOCK_T)
    tl.store(NEXT + b, tl.load(PRED + b * T + last))


def _argmax(target_logits: torch.Tensor) -> torch.Tensor:
    b, t, v = target_logits.shape
    pred = torch.empty(b, t, dtype=torch.int64, device=target_logits.device)
    if b * t:
        block_v = min(2048, triton.next_power_of_2(v))
        rows = max(1, min(16, 2048 // block_v))  # small vocabularies: several nodes per program
        _argmax_kernel[(triton.cdiv(b * t, rows),)](target_logits, *target_logits.stride(), b * t, t, v, pred,
                                                    ROWS=rows, BLOCK_V=block_v, num_warps=8)
    return pred


def tree_verify_greedy(
    tokens: torch.Tensor, parents: torch.Tensor, target_logits: torch.Tensor, valid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy acceptance over a draft tree (Triton).

    Args:
        tokens: ``[B, T]`` int64, node 0 the root; parents: ``[B, T]`` int64, ``-1`` at the root,
            every parent before its child.
        target_logits: ``[B, T, V]`` float (any strides).
        valid: ``[B, T]`` bool or None.
    Returns:
        path ``[B, T]`` int64 (accepted node indices from the root, -1 padded), length ``[B]``
        int32 (root included), next token ``[B]`` int64 (the target's argmax at the last node).
    """
    b, t = tokens.shape
    dev = tokens.device
    path = torch.empty(b, t, dtype=torch.int64, device=dev)
    length = torch.empty(b, dtype=torch.int32, device=dev)
    nxt = torch.empty(b, dtype=torch.int64, device=dev)
    if b == 0 or t == 0:
        return path, length, nxt
    pred = _argmax(target_logits)
    val = valid.to(torch.uint8) if valid is not None else tokens
    _greedy_walk_kernel[(b,)](
        tokens, parents, val, pred, path, length, nxt, *tokens.stride(), *parents.stride(), *val.stride(), t,
        HAS_VALID=valid is not None, BLOCK_T=max(2, triton.next_power_of_2(t)), num_warps=1,
    )
    return path, length, nxt


# ----------------------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------------------


@triton.jit
def _load_p(SCRATCH, p_row, in_scratch, offs, ok):
    """The current distribution at ``offs``: the scratch residual or a target row (fp32)."""
    if in_scratch != 0:
        p = tl.load(SCRATCH + offs, mask=ok, other=0.0)
    else:
        p = tl.load(p_row + offs, mask=ok, other=0.0).to(tl.float32)
    return p


@triton.jit
def _load_q(q_row, s_q, onehot, xh, offs, ok):
    """The draft distribution at ``offs``: one-hot at the drafted token ``xh`` or a dense ``q`` row (fp32)."""
    if onehot:
        q = tl.where(offs == xh, 1.0, 0.0)
    else:
        q = tl.load(q_row + offs * s_q, mask=ok, other=0.0).to(tl.float32)
    return q


@triton.jit
def _sampling_walk_kernel(
    TOKENS, PARENTS, VALID, TARGET, DRAFT, IDS, U, SCRATCH, QSCRATCH, PATH, LEN, NEXT,
    s_tok_b, s_tok_t, s_par_b, s_par_t, s_val_b, s_val_t,
    s_tg_b, s_tg_t, s_tg_v, s_dr_b, s_dr_t, s_dr_v, s_id_b, s_id_t, s_id_k, s_u_b, s_u_t,
    T, V, KD,
    HAS_VALID: tl.constexpr, HAS_DRAFT: tl.constexpr, HAS_IDS: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    lanes_t = tl.arange(0, BLOCK_T)
    lanes = tl.arange(0, BLOCK_V)
    scratch = SCRATCH + b * V
    # A sparse proposal is expanded into this row when a rejection needs it whole (O(V), as the residual).
    qscratch = QSCRATCH + b * V
    # p_row addresses a target row with unit stride along V (the launcher makes that dim contiguous).
    current = 0
    p_row = TARGET + b * s_tg_b
    in_scratch = 0  # whether p lives in the scratch row (else in the target row p_row)
    length = 1
    path = tl.where(lanes_t == 0, 0, tl.full([BLOCK_T], -1, tl.int64))
    for i in range(1, T):
        consider = tl.load(PARENTS + b * s_par_b + i * s_par_t) == current
        if HAS_VALID:
            consider = consider & (tl.load(VALID + b * s_val_b + i * s_val_t) != 0)
        if consider:
            x = tl.load(TOKENS + b * s_tok_b + i * s_tok_t)
            xg = tl.where(x < 0, x + V, x)  # torch indexing semantics for p[x], q[x]
            xh = tl.maximum(x, 0)  # the one-hot proposal sits at x.clamp(min=0)
            q_row = DRAFT + b * s_dr_b + i * s_dr_t
            id_row = IDS + b * s_id_b + i * s_id_t
            onehot = True
            if HAS_DRAFT:
                q_mass = 0.0
                for start in range(0, KD, BLOCK_V):
                    offs = start + lanes
                    q_mass += tl.sum(tl.load(q_row + offs * s_dr_v, mask=offs < KD, other=0.0).to(tl.float32), 0)
                onehot = q_mass <= 0  # an all-zero draft row means a deterministic proposal
            if onehot:
                qx = tl.where(xg == xh, 1.0, 0.0)
            elif HAS_IDS:
                qx = 0.0
                for start in range(0, KD, BLOCK_V):
                    offs = start + lanes
                    ok = offs < KD
                    ids = tl.load(id_row + offs * s_id_k, mask=ok, other=-1)
                    qv = tl.load(q_row + offs * s_dr_v, mask=ok, other=0.0).to(tl.float32)
                    qx += tl.sum(tl.where(ok & (ids == xg), qv, 0.0), 0)
            else:
                qx = tl.load(q_row + xg * s_dr_v).to(tl.float32)
            if in_scratch != 0:
                px = tl.load(scratch + xg)
            else:
                px = tl.load(p_row + xg).to(tl.float32)
            u = tl.load(U + b * s_u_b + i * s_u_t)
            if u * qx < px:
                path = tl.where(lanes_t == length, i, path)
                length += 1
                current = i
                p_row = TARGET + b * s_tg_b + i * s_tg_t
                in_scratch = 0
            else:
                if HAS_IDS:
                    if not onehot:
                        for start in range(0, V, BLOCK_V):
                            offs = start + lanes
                            tl.store(qscratch + offs, tl.zeros([BLOCK_V], tl.float32), mask=offs < V)
                        tl.debug_barrier()
                        for start in range(0, KD, BLOCK_V):
                            offs = start + lanes
                            ok = offs < KD
                            ids = tl.load(id_row + offs * s_id_k, mask=ok, other=-1)
                            qv = tl.load(q_row + offs * s_dr_v, mask=ok, other=0.0).to(tl.float32)
                            tl.store(qscratch + ids, qv, mask=ok & (ids >= 0))
                        tl.debug_barrier()
                    q_dense = qscratch
                    s_q = 1
                else:
                    q_dense = q_row
                    s_q = s_dr_v
                # Residual max(p - q, 0), normalised; an empty residual keeps p (reference guard).
                total = 0.0
                for start in range(0, V, BLOCK_V):
                    offs = start + lanes
                    ok = offs < V
                    p = _load_p(scratch, p_row, in_scratch, offs, ok)
                    q = _load_q(q_dense, s_q, onehot, xh, offs, ok)
                    total += tl.sum(tl.maximum(p - q, 0.0), 0)
                if total > 0:
                    for start in range(0, V, BLOCK_V):
                        offs = start + lanes
                        ok = offs < V
                        p = _load_p(scratch, p_row, in_scratch, offs, ok)
                        q = _load_q(q_dense, s_q, onehot, xh, offs, ok)
                        tl.store(scratch + offs, tl.math.div_rn(tl.maximum(p - q, 0.0), total), mask=ok)
                    tl.debug_barrier()  # the scalar reads of later nodes see the whole row
                    in_scratch = 1
    tl.store(PATH + b * T + lanes_t, path, mask=lanes_t < T)
    tl.store(LEN + b, length.to(tl.int32))

    # Inverse-CDF sample of p with the last uniform (as reference.sample_from_probs).
    total = 0.0
    last_pos = -1
    for start in range(0, V, BLOCK_V):
        offs = start + lanes
        ok = offs < V
        p = _load_p(scratch, p_row, in_scratch, offs, ok)
        total += tl.sum(p, 0)
        last_pos = tl.maximum(last_pos, tl.max(tl.where(ok & (p > 0), offs, -1), 0))
    last_pos = tl.where(last_pos < 0, V - 1, last_pos)
    goal = tl.load(U + b * s_u_b + T * s_u_t).to(tl.float32) * total
    below = 0
    running = 0.0
    for start in range(0, V, BLOCK_V):
        offs = start + lanes
        ok = offs < V
        p = _load_p(scratch, p_row, in_scratch, offs, ok)
        cdf = running + tl.cumsum(p, 0)
        below += tl.sum((ok & (cdf <= goal)).to(tl.int32), 0)
        running += tl.sum(p, 0)
    tl.store(NEXT + b, tl.minimum(below, last_pos).to(tl.int64))


def tree_verify_sampling(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor,
    valid: torch.Tensor | None = None,
    draft_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lossless recursive rejection sampling over a draft tree (Triton).

    Args:
        tokens, parents, valid: as in :func:`tree_verify_greedy`.
        target_probs: ``[B, T, V]`` float, the target's distribution at every node.
        draft_probs: ``[B, T, K]`` float proposal of every node over ``draft_ids [B, T, K]`` int64
            (distinct per node, -1 at unused entries), or ``[B, T, V]`` over the whole vocabulary when
            ``draft_ids`` is None, or None (one-hot proposals; an all-zero row is one-hot too).
        uniforms: ``[B, T + 1]`` float in [0, 1) (node ``i`` uses ``uniforms[:, i]``, the final
            sample ``uniforms[:, T]``).
    Returns:
        path ``[B, T]`` int64, length ``[B]`` int32, next token ``[B]`` int64. Identical to the
        reference for the same uniforms, except where a uniform falls within rounding of a
        decision boundary (sums are accumulated in a different order).
    """
    b, t = tokens.shape
    v = target_probs.shape[2]
    dev = tokens.device
    path = torch.empty(b, t, dtype=torch.int64, device=dev)
    length = torch.empty(b, dtype=torch.int32, device=dev)
    nxt = torch.empty(b, dtype=torch.int64, device=dev)
    if b == 0 or t == 0:
        return path, length, nxt
    if target_probs.stride(2) != 1:
        target_probs = target_probs.contiguous()
    scratch = torch.empty(b, v, dtype=torch.float32, device=dev)
    val = valid.to(torch.uint8) if valid is not None else tokens
    draft = draft_probs if draft_probs is not None else target_probs
    sparse = draft_probs is not None and draft_ids is not None
    ids = draft_ids if sparse else tokens[:, :, None]
    qscratch = torch.empty(b, v, dtype=torch.float32, device=dev) if sparse else scratch
    _sampling_walk_kernel[(b,)](
        tokens, parents, val, target_probs, draft, ids, uniforms, scratch, qscratch, path, length, nxt,
        *tokens.stride(), *parents.stride(), *val.stride(), *target_probs.stride(), *draft.stride(), *ids.stride(),
        *uniforms.stride(), t, v, draft.shape[2],
        HAS_VALID=valid is not None, HAS_DRAFT=draft_probs is not None, HAS_IDS=sparse,
        BLOCK_T=max(2, triton.next_power_of_2(t)), BLOCK_V=min(2048, triton.next_power_of_2(v)), num_warps=8,
    )
    return path, length, nxt
