"""Pure-torch reference implementations of the specdec operators.

These functions are the specification: every faster backend (C++, Triton, CUDA) is tested
against them. They favour clarity over speed, but stay vectorised (no Python loops over
tokens or vocabulary) so they are usable as a fallback on any device.
"""
from __future__ import annotations

import torch

# ----------------------------------------------------------------------------------------
# Packed ancestor masks
# ----------------------------------------------------------------------------------------


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """Pack a boolean mask along its last dimension into int32 words (bit j of word w = column 32*w + j).

    mask: ``[..., T] bool`` -> ``[..., ceil(T/32)] int32``
    """
    t = mask.shape[-1]
    words = (t + 31) // 32
    pad = words * 32 - t
    if pad:
        mask = torch.nn.functional.pad(mask, (0, pad))
    bits = mask.reshape(*mask.shape[:-1], words, 32).to(torch.int64)
    weights = torch.ones(32, dtype=torch.int64, device=mask.device) << torch.arange(32, device=mask.device)
    packed = (bits * weights).sum(-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)  # two's-complement wrap into int32
    return packed.to(torch.int32)


def unpack_mask(packed: torch.Tensor, t: int) -> torch.Tensor:
    """Inverse of :func:`pack_mask`. packed: ``[..., W] int32`` -> ``[..., t] bool``."""
    shifts = torch.arange(32, device=packed.device, dtype=torch.int32)
    bits = (packed.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(*packed.shape[:-1], -1)[..., :t].bool()


# ----------------------------------------------------------------------------------------
# Tree attention
# ----------------------------------------------------------------------------------------


def tree_attention_mask(
    cache_lens: torch.Tensor,
    prefix_len: int,
    tree_mask: torch.Tensor | None,
    t: int,
    tree_positions: torch.Tensor | None = None,
    window: int | None = None,
    n: int | None = None,
) -> torch.Tensor:
    """Dense boolean visibility mask of ``T`` queries over ``[prefix | N pending]`` keys.

    The queries are the last ``T`` of the ``N >= T`` pending nodes (``n``, default ``t``: a square tree).
    cache_lens: ``[B] int`` valid prefix length of each row (<= prefix_len);
    tree_mask: ``[B,T,ceil(N/32)] int32`` packed mask (bit j of row i: query i sees pending node j), or
    None for a causal chain (query i sees pending nodes ``j <= N - T + i``);
    tree_positions: ``[B,N] int`` absolute positions of all pending nodes (needed only with ``window``;
    query i is at ``tree_positions[:, N - T + i]``);
    window: sliding-window size: a query at position p sees keys at positions > p - window.
    Returns ``[B,1,T,prefix_len+N] bool`` (True = visible).
    """
    n = t if n is None else n
    b = cache_lens.shape[0]
    dev = cache_lens.device
    kpos = torch.arange(prefix_len, device=dev)
    prefix_vis = (kpos[None, :] < cache_lens[:, None]).unsqueeze(1).expand(b, t, prefix_len)
    if tree_mask is None:
        tree_vis = torch.ones(t, n, dtype=torch.bool, device=dev).tril(n - t).expand(b, t, n)
    else:
        tree_vis = unpack_mask(tree_mask, n)
    if window is not None:
        if tree_positions is None:
            raise ValueError("tree_positions are required with a sliding window")
        qpos = tree_positions[:, n - t:]  # [B,T]
        prefix_vis = prefix_vis & (kpos[None, None, :] > (qpos[:, :, None] - window))
        tree_vis = tree_vis & (tree_positions[:, None, :] > (qpos[:, :, None] - window))
    return torch.cat([prefix_vis, tree_vis], dim=-1).unsqueeze(1)


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    k_tree: torch.Tensor,
    v_tree: torch.Tensor,
    tree_mask: torch.Tensor | None,
    scale: float | None = None,
    tree_positions: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of tree queries over a cached prefix plus the pending (uncommitted) tree nodes.

    q: ``[B,Hq,T,D]``; k_cache/v_cache: ``[B,Hkv,S,D]`` of which the first ``cache_lens[b]``
    positions are valid; k_tree/v_tree: ``[B,Hkv,N,D]``, ``N >= T`` pending nodes whose last ``T`` are
    the queries (``N == T``: the tree itself); tree_mask: ``[B,T,ceil(N/32)] int32`` packed mask (bit j
    of row i set iff query i sees pending node j: itself and its ancestors) or None for a causal chain
    (query i sees pending nodes ``j <= N - T + i``); tree_positions: ``[B,N]`` positions of the pending
    nodes (only with ``window``). ``Hq`` must be a multiple of ``Hkv`` (GQA). A query sees the valid
    prefix (within its window) plus the pending nodes of its mask row; one that sees no key at all
    gets zeros. Returns ``[B,Hq,T,D]``.
    """
    t, n = q.shape[2], k_tree.shape[2]
    mask = tree_attention_mask(cache_lens, k_cache.shape[2], tree_mask, t, tree_positions, window, n)
    k = torch.cat([k_cache, k_tree], dim=2)
    v = torch.cat([v_cache, v_tree], dim=2)
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


# ----------------------------------------------------------------------------------------
# N-gram context matching
# ----------------------------------------------------------------------------------------


def ngram_match(
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    n_min: int,
    n_max: int,
    k: int,
    w: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Propose up to ``k`` continuations of length ``<= w`` from earlier occurrences of the context suffix.

    For each row, the longest ``n`` in ``[n_min, n_max]`` whose suffix n-gram ``tokens[L-n:L]``
    occurs earlier (at a start ``p`` with ``p + n < L``) wins. The continuations
    ``tokens[p+n : min(p+n+w, L)]`` of all its occurrences are grouped by exact content and ranked
    by count (descending), ties by recency (latest occurrence first).

    tokens: ``[B,L] int64`` (row b valid up to ``lengths[b]``); lengths: ``[B] int``.
    Returns drafts ``[B,k,w] int64`` (-1 padded), draft lengths ``[B,k] int32``, counts
    ``[B,k] int32`` (0 for empty slots) and the matched n-gram size ``[B] int32`` (0: no match).
    """
    if n_min < 1 or n_max < n_min:
        raise ValueError(f"need 1 <= n_min <= n_max, got {n_min}, {n_max}")
    b, _ = tokens.shape
    dev = tokens.device
    drafts = torch.full((b, k, w), -1, dtype=torch.int64, device=dev)
    dlens = torch.zeros(b, k, dtype=torch.int32, device=dev)
    counts = torch.zeros(b, k, dtype=torch.int32, device=dev)
    match_n = torch.zeros(b, dtype=torch.int32, device=dev)
    ar = torch.arange(w, device=dev)
    for row in range(b):  # rows are independent; the reference keeps them simple
        length = int(lengths[row])
        seq = tokens[row, :length]
        for n in range(min(n_max, length - 1), n_min - 1, -1):
            windows = seq.unfold(0, n, 1)[: length - n]  # starts p in [0, L-n-1]: p + n < L
            hits = (windows == seq[length - n:]).all(-1).nonzero().flatten()
            if hits.numel() == 0:
                continue
            idx = hits[:, None] + n + ar
            conts = torch.where(idx < length, seq[idx.clamp(max=length - 1)], -1)  # [hits, w], -1 past the end
            uniq, inverse, cnt = torch.unique(conts, dim=0, return_inverse=True, return_counts=True)
            latest = torch.full((uniq.shape[0],), -1, dtype=hits.dtype, device=dev).scatter_reduce(
                0, inverse, hits, reduce="amax")
            top = (cnt * (length + 1) + latest).argsort(descending=True)[:k]  # count, then recency
            m = top.numel()
            drafts[row, :m] = uniq[top]
            dlens[row, :m] = (uniq[top] >= 0).sum(-1).to(torch.int32)
            counts[row, :m] = cnt[top].to(torch.int32)
            match_n[row] = n
            break
    return drafts, dlens, counts, match_n


# ----------------------------------------------------------------------------------------
# Fused top-k + entropy
# ----------------------------------------------------------------------------------------


def topk_entropy(
    logits: torch.Tensor, k: int, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k probabilities, their ids, the entropy and the log-partition of ``softmax(logits / T)``.

    logits: ``[N,V]`` float (any float dtype; computed in fp32).
    Returns probs ``[N,k] fp32`` (descending), ids ``[N,k] int64``, entropy ``[N] fp32`` (nats),
    logsumexp ``[N] fp32`` of ``logits / T``.
    """
    if temperature <= 0:
        raise ValueError("temperature must be > 0")
    x = logits.float() / temperature
    lse = torch.logsumexp(x, dim=-1)
    logp = x - lse[:, None]
    p = logp.exp()
    entropy = -(p * logp).nan_to_num(0.0).sum(-1)
    top_logp, ids = logp.topk(k, dim=-1)
    return top_logp.exp(), ids, entropy, lse


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] . weight [N, K]^T + bias [N]`` computed in fp32, rounded once to x's dtype: ``[..., N]``."""
    y = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return y.to(x.dtype)


PANEL = 16  # columns per panel of a packed linear weight


def panel_columns(dtype: torch.dtype) -> torch.Tensor:
    """``[16]`` int64: the weight column (within its panel) held by each slot of a packed panel step.

    bf16 interleaves the two halves (slot ``s`` holds column ``s // 2 + 8 * (s % 2)``), so the CPU
    kernel widens 16 values with one shift and one mask; fp32 and fp16 keep columns in order."""
    s = torch.arange(PANEL)
    return s // 2 + 8 * (s % 2) if dtype == torch.bfloat16 else s


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` -> ``packed [ceil(N / 16), K, 16]``, same dtype and device:
    ``packed[p, k, s] = weight[16 p + panel_columns(dtype)[s], k]``, zero past ``N``."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    w = torch.zeros(panels * PANEL, k, dtype=weight.dtype, device=weight.device)
    w[:n] = weight
    cols = panel_columns(weight.dtype).to(weight.device)
    return w.view(panels, PANEL, k)[:, cols, :].transpose(1, 2).contiguous()


def unpack_linear_weight(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_linear_weight`: ``packed [P, K, 16]`` -> ``weight [n, K]``."""
    panels, k, _ = packed.shape
    slots = torch.argsort(panel_columns(packed.dtype)).to(packed.device)
    return packed[:, :, slots].transpose(1, 2).reshape(panels * PANEL, k)[:n].contiguous()


def packed_linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] . W^T + bias`` with ``W = unpack_linear_weight(packed, n)``, computed in fp32 and rounded
    once to x's dtype: ``[..., n]``."""
    return skinny_linear(x, unpack_linear_weight(packed, n), bias)


# ----------------------------------------------------------------------------------------
# In-place KV-cache compaction
# ----------------------------------------------------------------------------------------


def kv_compact(
    caches: list[torch.Tensor],
    src: torch.Tensor,
    dst_start: torch.Tensor,
    counts: torch.Tensor,
) -> None:
    """Move accepted KV entries into place, in every cache tensor, in place.

    caches: list of ``[B,H,S,D]`` tensors (every layer's keys and values);
    src: ``[B,n] int`` source positions, ascending per row, ``src[b,j] >= dst_start[b] + j``;
    dst_start: ``[B] int``; counts: ``[B] int`` (<= n): row b moves ``src[b,:counts[b]]`` to
    ``dst_start[b] + [0, counts[b])``. Because sources never precede their destination and are
    ascending, a forward element-by-element copy is safe; this reference gathers first.
    """
    if src.numel() == 0:
        return
    b, n = src.shape
    j = torch.arange(n, device=src.device)
    valid = j[None, :] < counts[:, None]
    dst = dst_start[:, None] + j[None, :]
    rows = torch.arange(b, device=src.device)[:, None].expand(b, n)[valid]
    s, d = src[valid].long(), dst[valid].long()
    for cache in caches:
        cache[rows, :, d] = cache[rows, :, s]


# ----------------------------------------------------------------------------------------
# Tree verification
# ----------------------------------------------------------------------------------------


def tree_depth(parents: torch.Tensor) -> torch.Tensor:
    """Depth of every node (root = 0) by pointer jumping. parents: ``[B,T]`` (-1 at the root) -> ``[B,T] int64``."""
    t = parents.shape[1]
    anc = parents.clamp(min=0)
    dist = (parents >= 0).long()
    for _ in range(max(1, (t - 1).bit_length())):
        dist = dist + dist.gather(1, anc)
        anc = anc.gather(1, anc)
    return dist


def ancestor_mask(parents: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Packed ancestor-or-self mask ``[B,T,ceil(T/32)] int32`` from parents ``[B,T]``.

    Computed by transitive closure with boolean matrix squaring (log2 T batched matmuls), so no
    Python loop over nodes. Invalid nodes are visible to nobody but themselves.
    """
    b, t = parents.shape
    dev = parents.device
    eye = torch.eye(t, dtype=torch.bool, device=dev).expand(b, t, t)
    reach = eye.clone()
    has_parent = parents >= 0
    reach[torch.arange(b, device=dev)[:, None].expand(b, t)[has_parent],
          torch.arange(t, device=dev)[None].expand(b, t)[has_parent],
          parents[has_parent]] = True
    for _ in range(max(1, (t - 1).bit_length())):
        reach = reach | (torch.bmm(reach.float(), reach.float()) > 0)
    reach = reach & (valid[:, None, :] | eye)
    return pack_mask(reach)


def subtree(tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor, keep: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The nodes of ``keep [B,T] bool`` (closed under parents; the root is always kept), in their order.

    Returns tokens, parents (remapped; 0 at padding, -1 at the root), valid ``[B,T']`` and ``[B,T']``
    the old index of every new node (0 at padding).
    """
    b, t = tokens.shape
    keep = keep & valid
    keep[:, 0] = True
    new_index = keep.long().cumsum(-1) - 1  # [B,T] position of each kept node
    t_new = int(keep.sum(-1).max())
    dst = torch.where(keep, new_index, t_new)  # dropped nodes go to a spill column, cut below
    old = torch.zeros(b, t_new + 1, dtype=torch.int64, device=tokens.device)
    old.scatter_(1, dst, torch.arange(t, device=tokens.device).expand(b, t))
    old = old[:, :t_new]
    valid_new = torch.arange(t_new, device=keep.device)[None] < keep.sum(-1, keepdim=True)
    parents_new = torch.where(valid_new, new_index.gather(1, parents.gather(1, old).clamp(min=0)), 0)
    parents_new[:, 0] = -1
    return tokens.gather(1, old), parents_new, valid_new, old


def shared_prefixes(drafts: torch.Tensor) -> torch.Tensor:
    """drafts: ``[B,k,w]`` (-1 padded; a draft ends at its first padding) -> ``[B,k,k,w] bool``: drafts ``i``
    and ``j`` of a row both reach depth ``d`` and agree on every token up to it."""
    live = (drafts >= 0).cumprod(-1).bool()
    same = (drafts[:, :, None, :] == drafts[:, None, :, :]).cumprod(-1).bool()
    return same & live[:, :, None, :] & live[:, None, :, :]


def cap_by_parents(p: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """``[B,T]`` estimates ``p`` with the root's set to 1 and every node's capped by its parent's (a child is
    never reached more often than its parent). parents: ``[B,T]`` (-1 at the root); depth: ``[B,T]``."""
    p = p.clone()
    p[:, 0] = 1.0
    up = parents.clamp(min=0)
    for _ in range(int(depth.max())):
        p = torch.minimum(p, p.gather(1, up))
    return p


def draft_tree(
    root: torch.Tensor, drafts: torch.Tensor, merge: bool = True, accept: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Reference of :func:`specdec.kernels.draft_tree` (vectorised: no loop over rows or nodes)."""
    b, k, w = drafts.shape
    dev = drafts.device
    chain_ok = (drafts >= 0).cumprod(-1).bool()  # [B,k,w]: a chain ends at its first padding
    ar_k = torch.arange(k, device=dev)
    if merge:
        same = shared_prefixes(drafts)
        owner = torch.where(same, ar_k[None, None, :, None], k).amin(2).clamp(max=k - 1)  # first chain with the prefix
    else:
        owner = ar_k[None, :, None].expand(b, k, w)
    exists = chain_ok & (owner == ar_k[None, :, None])  # one node per distinct (prefix, depth)
    flat_exists = exists.reshape(b, k * w)
    index = flat_exists.long().cumsum(-1).reshape(b, k, w)  # node index (root = 0) where exists
    t = int(index[:, -1, -1].max()) + 1 if k * w else 1
    # parent of (i, d) is the node of (owner[i, d-1], d-1); at d = 0 the root.
    flat_parent = owner[:, :, :-1] * w + torch.arange(w - 1, device=dev)
    parent_idx = index.reshape(b, k * w).gather(1, flat_parent.reshape(b, -1)).reshape(b, k, w - 1)
    parents_kw = torch.cat([torch.zeros(b, k, 1, dtype=torch.int64, device=dev), parent_idx], dim=-1)
    dst = torch.where(exists, index, 0).reshape(b, k * w)

    def place(values: torch.Tensor, fill: int) -> torch.Tensor:  # [B,k*w] per (chain, depth) -> [B,T] per node
        out = torch.full((b, t), fill, dtype=values.dtype, device=dev)
        return out.scatter_(1, dst, torch.where(flat_exists, values, fill))  # slot 0 got the misses: reset below

    tokens = place(drafts.reshape(b, -1), 0)
    parents = place(parents_kw.reshape(b, -1), 0)
    chain = place(ar_k[None, :, None].expand(b, k, w).reshape(b, -1), -1)
    slot = place(torch.arange(k * w, device=dev).expand(b, k * w), -1)
    valid = place(flat_exists, False)
    tokens[:, 0], parents[:, 0], chain[:, 0], slot[:, 0], valid[:, 0] = root, -1, -1, -1, True
    reach = torch.zeros(b, t, device=dev)
    if accept is not None:
        depth = tree_depth(parents)
        # A node's reach is its owner's cell, capped by its parent's (a child is never likelier).
        reach = cap_by_parents(torch.where(valid, accept.reshape(b, k * w).float().gather(1, slot.clamp(min=0)), 0.0),
                               parents, depth)
    if keep is not None:
        key = torch.where(valid, reach - depth * 1e-6, -3.0)  # padding last
        key[:, 0] = 2.0  # the root first
        order = torch.sort(key, dim=-1, descending=True, stable=True).indices
        keep_sorted = torch.arange(t, device=dev)[None] <= keep.to(dev)[:, None]
        kept = torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)
        tokens, parents, valid, old = subtree(tokens, parents, valid, kept)
        chain, slot, reach = chain.gather(1, old), slot.gather(1, old), reach.gather(1, old)
    tokens, chain, slot = torch.where(valid, tokens, 0), torch.where(valid, chain, -1), torch.where(valid, slot, -1)
    reach = torch.where(valid, reach, 0.0)
    return tokens, parents, valid, tree_depth(parents), ancestor_mask(parents, valid), chain, slot, reach


def _path_to(last: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Root-to-``last`` node path ``[B,T] int64`` (-1 padded) and its length ``[B] int32``."""
    b, t = parents.shape
    length = depth.gather(1, last[:, None]).squeeze(1) + 1
    path = torch.full((b, t), -1, dtype=torch.int64, device=parents.device)
    node = last.clone()
    for i in range(int(length.max())):
        alive = i < length
        pos = (length - 1 - i).clamp(min=0)[:, None]
        path.scatter_(1, pos, torch.where(alive, node, path.gather(1, pos).squeeze(1))[:, None])
        node = torch.where(alive, parents.gather(1, node[:, None]).squeeze(1).clamp(min=0), node)
    return path, length.to(torch.int32)


def tree_verify_greedy(
    tokens: torch.Tensor, parents: torch.Tensor, target_logits: torch.Tensor, valid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy acceptance over a draft tree.

    tokens: ``[B,T] int64`` (node 0 = root = last committed token); parents: ``[B,T] int64``
    (``parents[:,0] = -1``, every parent precedes its children); target_logits: ``[B,T,V]``;
    valid: ``[B,T] bool`` (padding nodes False). A node is accepted iff its parent is accepted and
    its token equals the target's argmax at the parent. Returns the accepted path ``[B,T] int64``
    (node indices from the root, -1 padded), its length ``[B] int32`` (root included) and the next
    token ``[B] int64`` (target argmax at the path's last node).
    """
    b, t = tokens.shape
    pred = target_logits.argmax(-1)
    ok = torch.ones(b, t, dtype=torch.bool, device=tokens.device)
    ok[:, 1:] = tokens[:, 1:] == pred.gather(1, parents[:, 1:].clamp(min=0))
    if valid is not None:
        ok &= valid
    # accepted[i] = ok[i] and accepted[parent[i]], by pointer jumping over the ancestors.
    anc = parents.clamp(min=0)
    acc = ok.clone()
    for _ in range(max(1, (t - 1).bit_length())):
        acc = acc & acc.gather(1, anc)
        anc = anc.gather(1, anc)
    depth = tree_depth(parents)
    score = torch.where(acc, depth * t + (t - 1 - torch.arange(t, device=tokens.device)), -1)
    last = score.argmax(-1)  # deepest accepted node; ties -> lowest index
    path, length = _path_to(last, parents, depth)
    return path, length, pred.gather(1, last[:, None]).squeeze(1)


def tree_verify_sampling(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor,
    valid: torch.Tensor | None = None,
    draft_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lossless acceptance over a draft tree by recursive rejection sampling.

    Children of the current node are tried in index order. Child ``c`` (token ``x``, proposed from
    ``q = draft_probs[:,c]``, or one-hot at ``x`` when ``draft_probs`` is None or its row is all
    zero) is accepted with probability ``min(1, p(x)/q(x))``; on acceptance the walk moves to ``c``
    and ``p`` becomes the target distribution at ``c``, on rejection ``p <- norm(max(p - q, 0))``.
    When no child is left, the next token is sampled from ``p``. With one child per node this is
    Leviathan et al.'s chain rule; with siblings drawn i.i.d. from one ``q`` (or deterministic,
    distinct tokens) it is SpecInfer's multi-draft rule. Either way the output follows the target.

    tokens, parents: ``[B,T] int64`` as in :func:`tree_verify_greedy`; target_probs: ``[B,T,V]``
    float (the target's processed next-token distribution at every node); draft_probs:
    ``[B,T,K]`` float over the ids ``draft_ids [B,T,K] int64`` (distinct per node, -1 at unused
    entries, whose probability must be 0), or over the whole vocabulary (``K = V``) when
    ``draft_ids`` is None, or None; uniforms: ``[B,T+1]`` in [0,1) (one per node, the last for the final
    sample); valid: ``[B,T] bool``. Returns path ``[B,T] int64``, length ``[B] int32``, next token
    ``[B] int64``.
    """
    b, t = tokens.shape
    dev = tokens.device
    rows = torch.arange(b, device=dev)
    current = torch.zeros(b, dtype=torch.int64, device=dev)
    p = target_probs[:, 0].float().clone()
    path = torch.full((b, t), -1, dtype=torch.int64, device=dev)
    path[:, 0] = 0
    length = torch.ones(b, dtype=torch.int64, device=dev)
    for i in range(1, t):
        consider = parents[:, i] == current
        if valid is not None:
            consider &= valid[:, i]
        x = tokens[:, i]
        onehot = torch.nn.functional.one_hot(x.clamp(min=0), p.shape[-1]).float()
        if draft_probs is None:
            q = onehot
        else:
            q = draft_probs[:, i].float()
            if draft_ids is not None:
                ids = draft_ids[:, i]
                q = torch.zeros_like(p).scatter_add_(1, ids.clamp(min=0), q.masked_fill(ids < 0, 0.0))
            q = torch.where((q.sum(-1) > 0)[:, None], q, onehot)
        px, qx = p[rows, x], q[rows, x]
        accept = consider & (uniforms[:, i] * qx < px)
        reject = consider & ~accept
        residual = (p - q).clamp(min=0)
        total = residual.sum(-1, keepdim=True)
        # A rejection has probability zero when the residual is empty; keep p then (numerical guard).
        residual = torch.where(total > 0, residual / total.clamp(min=1e-30), p)
        p = torch.where(reject[:, None], residual, p)
        p = torch.where(accept[:, None], target_probs[:, i].float(), p)
        path.scatter_(1, length[:, None], torch.where(accept, i, path.gather(1, length[:, None]).squeeze(1))[:, None])
        length = length + accept.long()
        current = torch.where(accept, i, current)
    next_token = sample_from_probs(p, uniforms[:, t])
    return path, length.to(torch.int32), next_token


def sample_from_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample. probs: ``[B,V]`` (need not be normalised), u: ``[B]`` in [0,1) -> ``[B] int64``."""
    cdf = probs.float().cumsum(-1)
    target = (u.float() * cdf[:, -1])[:, None]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # Rounding at the top end can overshoot; fall back to the last token with mass (no host sync).
    positive = probs > 0
    last_nonzero = probs.shape[-1] - 1 - positive.flip(-1).int().argmax(-1)
    return torch.minimum(idx, last_nonzero)
