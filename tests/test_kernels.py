"""The kernel operators (public API and torch references) against naive, loop-based implementations."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import specdec.kernels as K
from specdec.kernels import reference
from specdec.tree import SparseProbs
from tests.naive import ancestors_or_self, naive_pack, one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

OPS = {"public": K, "reference": reference}


# ----------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------


def depth_of(parents: list[int], i: int) -> int:
    d, j = 0, parents[i]
    while j >= 0:
        d, j = d + 1, parents[j]
    return d


def random_parents(draw, t: int) -> list[int]:
    kind = draw(st.sampled_from(["random", "chain", "bushy"]))
    if kind == "chain":
        return list(range(-1, t - 1))
    if kind == "bushy":
        return [-1] + [0] * (t - 1)
    return [-1] + [draw(st.integers(0, i - 1)) for i in range(1, t)]


# ----------------------------------------------------------------------------------------
# tree_attention
# ----------------------------------------------------------------------------------------


def naive_tree_attention(q, k_cache, v_cache, cache_lens, k_tree, v_tree, vis, positions=None, window=None, scale=None):
    """Loop over (row, query): softmax over the keys that query sees, in float64.

    vis: ``vis[b][i][j]`` (python bools) tree visibility; positions: ``[B][T]`` absolute tree positions.
    """
    b, hq, t, d = q.shape
    hkv = k_cache.shape[1]
    ratio = hq // hkv
    scale = d ** -0.5 if scale is None else scale
    q, k_cache, v_cache, k_tree, v_tree = (x.double() for x in (q, k_cache, v_cache, k_tree, v_tree))
    out = torch.zeros(b, hq, t, d, dtype=torch.float64)
    for r in range(b):
        for i in range(t):
            keys, vals = [], []
            for j in range(int(cache_lens[r])):
                if window is None or j > positions[r][i] - window:
                    keys.append(k_cache[r, :, j])
                    vals.append(v_cache[r, :, j])
            for j in range(t):
                if vis[r][i][j] and (window is None or positions[r][j] > positions[r][i] - window):
                    keys.append(k_tree[r, :, j])
                    vals.append(v_tree[r, :, j])
            group = torch.tensor([h // ratio for h in range(hq)])  # query head h reads kv head h // (Hq / Hkv)
            kk = torch.stack(keys, dim=1)[group]  # [Hq, n, D]
            vv = torch.stack(vals, dim=1)[group]
            scores = (kk @ q[r, :, i, :, None]).squeeze(-1) * scale  # [Hq, n]
            out[r, :, i] = (torch.softmax(scores, dim=-1)[:, None, :] @ vv).squeeze(1)
    return out


TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=3e-3, rtol=3e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@st.composite
def attention_cases(draw, head_dims=(4, 8, 16), max_t=40):
    b = draw(st.integers(1, 3))
    hkv = draw(st.integers(1, 2))
    ratio = draw(st.sampled_from([1, 4, 8]))
    d = draw(st.sampled_from(head_dims))
    t = draw(st.integers(1, max_t))
    s = draw(st.integers(0, 24))
    cache_lens = [draw(st.integers(0, s)) for _ in range(b)]
    use_mask = draw(st.booleans())
    parents = [random_parents(draw, t) if use_mask else list(range(-1, t - 1)) for _ in range(b)]
    window = draw(st.one_of(st.none(), st.integers(1, s + t + 1)))
    dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.float16, torch.bfloat16]))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([None, 0.3]))
    return b, hkv, ratio, d, t, s, cache_lens, use_mask, parents, window, dtype, seed, scale


def build_attention(b, hkv, ratio, d, t, s, cache_lens, parents, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hkv * ratio, t, d, generator=g).to(dtype)
    k_cache = torch.randn(b, hkv, s, d, generator=g).to(dtype)
    v_cache = torch.randn(b, hkv, s, d, generator=g).to(dtype)
    k_tree = torch.randn(b, hkv, t, d, generator=g).to(dtype)
    v_tree = torch.randn(b, hkv, t, d, generator=g).to(dtype)
    # Garbage past cache_lens must be ignored: make it large so leaking into the softmax shows.
    for r in range(b):
        k_cache[r, :, cache_lens[r]:] = 30
        v_cache[r, :, cache_lens[r]:] = 1000
    vis = [[[j in ancestors_or_self(ps, i) for j in range(t)] for i in range(t)] for ps in parents]
    mask = torch.tensor([naive_pack(v) for v in vis], dtype=torch.int32).reshape(b, t, (t + 31) // 32)
    lens = torch.tensor(cache_lens, dtype=torch.int64)
    positions = [[cache_lens[r] + depth_of(parents[r], i) for i in range(t)] for r in range(b)]
    return q, k_cache, v_cache, lens, k_tree, v_tree, vis, mask, positions


@pytest.mark.parametrize("which", list(OPS))
@settings(max_examples=30, deadline=None)
@given(case=attention_cases())
def test_tree_attention_matches_naive(which, case):
    b, hkv, ratio, d, t, s, cache_lens, use_mask, parents, window, dtype, seed, scale = case
    q, k_cache, v_cache, lens, k_tree, v_tree, vis, mask, positions = build_attention(
        b, hkv, ratio, d, t, s, cache_lens, parents, dtype, seed)
    pos_t = torch.tensor(positions, dtype=torch.int64).reshape(b, t)
    got = OPS[which].tree_attention(q, k_cache, v_cache, lens, k_tree, v_tree, mask if use_mask else None,
                                    scale=scale, tree_positions=pos_t if window is not None else None, window=window)
    assert got.dtype == dtype and got.shape == q.shape
    want = naive_tree_attention(q, k_cache, v_cache, lens, k_tree, v_tree, vis, positions, window, scale)
    torch.testing.assert_close(got.double(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("ratio", [1, 4, 8])
def test_tree_attention_head_dims_and_gqa(dtype, d, ratio):
    b, hkv, t, s = 2, 2, 35, 20
    cache_lens = [20, 7]
    parents = [[-1] + [(i * 7) % i for i in range(1, t)], list(range(-1, t - 1))]
    q, k_cache, v_cache, lens, k_tree, v_tree, vis, mask, positions = build_attention(
        b, hkv, ratio, d, t, s, cache_lens, parents, dtype, d + ratio)
    got = K.tree_attention(q, k_cache, v_cache, lens.int(), k_tree, v_tree, mask)
    want = naive_tree_attention(q, k_cache, v_cache, lens, k_tree, v_tree, vis)
    torch.testing.assert_close(got.double(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [24, 64])
@pytest.mark.parametrize("t", [1, 3, 8])
@pytest.mark.parametrize("window", [None, 300])
def test_tree_attention_long_prefix(dtype, d, t, window):
    """Prefixes of several key chunks (the CPU kernel packs 256 keys at a time), a ragged last chunk,
    row blocks of more than six heads x queries (GQA 3, up to 24 rows), head dims that are not a
    multiple of the 16-wide panels, and a window that starts inside a chunk."""
    b, hkv, ratio, s = 2, 2, 3, 640
    cache_lens = [600, 257]
    parents = [[-1] + [(i - 1) // 2 for i in range(1, t)], list(range(-1, t - 1))]
    q, k_cache, v_cache, lens, k_tree, v_tree, vis, mask, positions = build_attention(
        b, hkv, ratio, d, t, s, cache_lens, parents, dtype, 7 * d + t)
    pos_t = torch.tensor(positions, dtype=torch.int64)
    got = K.tree_attention(q, k_cache, v_cache, lens, k_tree, v_tree, mask,
                           tree_positions=pos_t if window else None, window=window)
    want = naive_tree_attention(q, k_cache, v_cache, lens, k_tree, v_tree, vis, positions, window)
    torch.testing.assert_close(got.double(), want, **TOL[dtype])


native_tree_attention = pytest.mark.skipif(not K.has_native("tree_attention", "cpu"),
                                           reason="the C++ extension is not built")


@native_tree_attention
@pytest.mark.parametrize("split_keys", ["256", "300", "512"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 3, 13])
@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize("joined", [False, True])
def test_tree_attention_key_splits(monkeypatch, split_keys, dtype, t, window, joined):
    """The C++ kernel's keys cut every ``split_keys`` rows (300: rounded up to 512; set, in every call, 9 (row, kv head)
    pairs here) and merged afterwards: ragged
    rows, one with an empty prefix, splits wholly below a query's window, a short last query block (13 queries),
    a tree operand in its own buffer or following the prefix in the cache's."""
    b, hkv, ratio, d, s = 3, 3, 3, 64, 640
    cache_lens = [600, 0, 257]
    parents = [[-1] + [(i - 1) // 2 for i in range(1, t)], list(range(-1, t - 1)), list(range(-1, t - 1))]
    q, k_cache, v_cache, lens, k_tree, v_tree, vis, mask, positions = build_attention(
        b, hkv, ratio, d, t, s, cache_lens, parents, dtype, 11 * len(split_keys) + t)
    pos_t = torch.tensor(positions, dtype=torch.int64)
    want = naive_tree_attention(q, k_cache, v_cache, lens, k_tree, v_tree, vis, positions, window)
    if joined:  # one row's tree right after its prefix in one buffer: the runtime's layout when rows are even
        q, lens, mask, pos_t, want = q[:1], lens[:1], mask[:1], pos_t[:1], want[:1]
        kc = torch.cat([k_cache[:1, :, :600], k_tree[:1]], dim=2)
        vc = torch.cat([v_cache[:1, :, :600], v_tree[:1]], dim=2)
        k_cache, v_cache, k_tree, v_tree = kc, vc, kc[:, :, 600:], vc[:, :, 600:]
    native = K.native_ops().tree_attention

    def attend(keys: str) -> torch.Tensor:
        monkeypatch.setenv("SPECDEC_ATTENTION_SPLIT_KEYS", keys)
        return native(q, k_cache, v_cache, lens, k_tree, v_tree, mask, None,
                      pos_t if window else None, window)

    got, whole = attend(split_keys), attend("0")
    torch.testing.assert_close(got.double(), want, **TOL[dtype])
    torch.testing.assert_close(got, whole, **TOL[dtype])
    if dtype == torch.float32 and window is None:  # the split path ran: its sums round differently from one pass
        assert not torch.equal(got[0], whole[0])


@native_tree_attention
@pytest.mark.parametrize("prefix", [200, 700, 1030])
def test_a_one_token_step_rounds_as_the_same_query_in_a_verified_chain(prefix):
    """fp32, one row, the chain after the prefix in the cache's buffer (the runtime's layout): query i of a 5-token
    chain equals, bit for bit, a one-token step over the prefix and the chain's first i tokens, on one thread and
    on two (the kernel cuts its keys at fixed rows, whatever the thread count and the number of queries)."""
    g = torch.Generator().manual_seed(prefix)
    t, n = 5, prefix + 5
    q = torch.randn(1, 9, t, 64, generator=g)
    k, v = torch.randn(1, 3, n, 64, generator=g), torch.randn(1, 3, n, 64, generator=g)
    native, threads = K.native_ops().tree_attention, torch.get_num_threads()

    def attend(queries: torch.Tensor, length: int, chain: int) -> torch.Tensor:
        return native(queries, k[:, :, :length + chain], v[:, :, :length + chain], torch.tensor([length]),
                      k[:, :, length:length + chain], v[:, :, length:length + chain], None, None, None, None)

    try:
        for width in (1, 2):
            torch.set_num_threads(width)
            chain = attend(q, prefix, t)
            for i in range(t):
                assert torch.equal(chain[:, :, i], attend(q[:, :, i:i + 1], prefix + i, 1)[:, :, 0]), (width, i)
            if width == 1:
                alone = chain
            else:
                assert torch.equal(chain, alone)
    finally:
        torch.set_num_threads(threads)


def test_tree_attention_none_mask_is_causal_chain():
    b, hkv, ratio, d, t, s = 3, 2, 4, 16, 9, 12
    cache_lens = [0, 5, 12]
    chain = [list(range(-1, t - 1))] * b
    q, k_cache, v_cache, lens, k_tree, v_tree, vis, mask, _ = build_attention(
        b, hkv, ratio, d, t, s, cache_lens, chain, torch.float32, 0)
    got = K.tree_attention(q, k_cache, v_cache, lens, k_tree, v_tree, None)
    want = naive_tree_attention(q, k_cache, v_cache, lens, k_tree, v_tree, vis)
    torch.testing.assert_close(got.double(), want, **TOL[torch.float32])
    torch.testing.assert_close(K.tree_attention(q, k_cache, v_cache, lens, k_tree, v_tree, mask), got)


def test_tree_attention_single_token_empty_cache():
    # T = 1 with an empty prefix: the query sees only itself, so the output is its own value.
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 1, 8, generator=g) for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    empty = torch.zeros(2, 2, 0, 8)
    mask = torch.ones(2, 1, 1, dtype=torch.int32)
    got = K.tree_attention(q, empty, empty, torch.zeros(2, dtype=torch.int64), k, v, mask)
    torch.testing.assert_close(got, v.repeat_interleave(2, dim=1))


def test_tree_attention_sliding_window_explicit():
    # Prefix of 10, chain of 3 at positions 10, 11, 12, window 4: query at 12 sees positions 9..12.
    b, hkv, ratio, d, t, s = 1, 1, 1, 8, 3, 10
    q, k_cache, v_cache, lens, k_tree, v_tree, vis, mask, positions = build_attention(
        b, hkv, ratio, d, t, s, [10], [[-1, 0, 1]], torch.float32, 3)
    pos = torch.tensor(positions)
    got = K.tree_attention(q, k_cache, v_cache, lens, k_tree, v_tree, None, tree_positions=pos, window=4)
    want = naive_tree_attention(q, k_cache, v_cache, lens, k_tree, v_tree, vis, positions, 4)
    torch.testing.assert_close(got.double(), want, **TOL[torch.float32])
    # Last query by hand: keys = prefix position 9 plus the three tree tokens.
    keys = torch.cat([k_cache[0, 0, 9:10], k_tree[0, 0]]).double()
    vals = torch.cat([v_cache[0, 0, 9:10], v_tree[0, 0]]).double()
    w = torch.softmax(keys @ q[0, 0, 2].double() * d ** -0.5, 0)
    torch.testing.assert_close(got[0, 0, 2].double(), w @ vals, atol=1e-5, rtol=1e-5)
    # window = 1: every query sees only itself.
    got1 = K.tree_attention(q, k_cache, v_cache, lens, k_tree, v_tree, None, tree_positions=pos, window=1)
    torch.testing.assert_close(got1, v_tree)
    with pytest.raises(ValueError, match="tree_positions"):
        K.tree_attention(q, k_cache, v_cache, lens, k_tree, v_tree, None, window=4)


def test_tree_attention_with_draft_tree_padding():
    # A DraftTree from chains of different sizes: padding nodes must not leak into valid queries.
    from specdec.tree import DraftTree

    tree = DraftTree.from_chains(torch.tensor([1, 2]), [[[5, 6, 7], [5, 6, 8], [9]], [[4, 4]]])
    b, t, hkv, ratio, d, s = 2, tree.size, 2, 4, 16, 10
    cache_lens = torch.tensor([10, 3])
    g = torch.Generator().manual_seed(5)
    q = torch.randn(b, hkv * ratio, t, d, generator=g)
    k_cache, v_cache = torch.randn(b, hkv, s, d, generator=g), torch.randn(b, hkv, s, d, generator=g)
    k_tree, v_tree = torch.randn(b, hkv, t, d, generator=g), torch.randn(b, hkv, t, d, generator=g)
    parents, valid = tree.parents.tolist(), tree.valid.tolist()
    vis = [[[valid[r][j] and j in ancestors_or_self(parents[r], i) for j in range(t)] for i in range(t)] for r in range(b)]
    positions = tree.positions(cache_lens)
    for window in (None, 3, 11):
        got = K.tree_attention(q, k_cache, v_cache, cache_lens, k_tree, v_tree, tree.mask,
                               tree_positions=positions if window else None, window=window)
        want = naive_tree_attention(q, k_cache, v_cache, cache_lens, k_tree, v_tree, vis, positions.tolist(), window)
        for r in range(b):
            n = sum(valid[r])
            torch.testing.assert_close(got[r, :, :n].double(), want[r, :, :n], atol=1e-5, rtol=1e-5)
        # Garbage keys/values at padding nodes change nothing for valid queries.
        k2, v2 = k_tree.clone(), v_tree.clone()
        k2[1, :, 3:], v2[1, :, 3:] = 50.0, -1e4
        got2 = K.tree_attention(q, k_cache, v_cache, cache_lens, k2, v2, tree.mask,
                                tree_positions=positions if window else None, window=window)
        torch.testing.assert_close(got2[1, :, :3], got[1, :, :3])
        torch.testing.assert_close(got2[0], got[0])


def test_tree_attention_rejects_bad_gqa():
    q = torch.zeros(1, 3, 2, 8)
    kv = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="multiple"):
        K.tree_attention(q, kv, kv, torch.tensor([4]), torch.zeros(1, 2, 2, 8), torch.zeros(1, 2, 2, 8), None)


# ----------------------------------------------------------------------------------------
# ngram_match
# ----------------------------------------------------------------------------------------


def naive_ngram(seq: list[int], n_min: int, n_max: int, k: int, w: int) -> tuple[list[tuple[tuple[int, ...], int]], int]:
    """([(continuation, count)] best first, matched n), by brute force over every n and start p."""
    length = len(seq)
    for n in range(n_max, n_min - 1, -1):
        if n > length:
            continue
        suffix = seq[length - n:]
        counts: dict[tuple[int, ...], int] = {}
        latest: dict[tuple[int, ...], int] = {}
        for p in range(length):
            if p + n < length and seq[p:p + n] == suffix:
                cont = tuple(seq[p + n:min(p + n + w, length)])
                counts[cont] = counts.get(cont, 0) + 1
                latest[cont] = max(latest.get(cont, -1), p)
        if counts:
            order = sorted(counts, key=lambda c: (counts[c], latest[c]), reverse=True)
            return [(c, counts[c]) for c in order[:k]], n
    return [], 0


def check_ngram(op, rows: list[list[int]], lengths: list[int], n_min, n_max, k, w, pad_len: int):
    b = len(rows)
    tokens = torch.tensor(rows, dtype=torch.int64).reshape(b, pad_len)
    drafts, dlens, counts, match_n = op.ngram_match(tokens, torch.tensor(lengths), n_min, n_max, k, w)
    assert drafts.shape == (b, k, w) and drafts.dtype == torch.int64
    assert match_n.shape == (b,) and match_n.dtype == torch.int32
    assert dlens.shape == (b, k) and dlens.dtype == torch.int32
    assert counts.shape == (b, k) and counts.dtype == torch.int32
    for r in range(b):
        want, n = naive_ngram(rows[r][:lengths[r]], n_min, n_max, k, w)
        assert match_n[r].item() == n, r
        for slot in range(k):
            if slot < len(want):
                cont, cnt = want[slot]
                assert drafts[r, slot].tolist() == list(cont) + [-1] * (w - len(cont)), (r, slot)
                assert dlens[r, slot].item() == len(cont) and counts[r, slot].item() == cnt, (r, slot)
            else:
                assert drafts[r, slot].tolist() == [-1] * w, (r, slot)
                assert dlens[r, slot].item() == 0 and counts[r, slot].item() == 0, (r, slot)


@st.composite
def ngram_cases(draw):
    b = draw(st.integers(1, 3))
    pad_len = draw(st.integers(0, 32))
    vocab = draw(st.integers(1, 4))
    rows, lengths = [], []
    for _ in range(b):
        # Mostly long rows (more and longer matches), sometimes short or empty ones.
        length = draw(st.one_of(st.integers(max(0, pad_len - 6), pad_len), st.integers(0, pad_len)))
        valid = draw(st.lists(st.integers(0, vocab - 1), min_size=length, max_size=length))
        # Padding that would create (longer, more frequent) matches if it were read.
        pad_kind = draw(st.sampled_from(["repeat", "const", "random"]))
        pad_n = pad_len - length
        if pad_kind == "repeat" and valid:
            pad = (valid[-3:] * pad_n)[:pad_n]
        elif pad_kind == "const":
            pad = [valid[-1] if valid else 0] * pad_n
        else:
            pad = draw(st.lists(st.integers(0, vocab - 1), min_size=pad_n, max_size=pad_n))
        rows.append(valid + pad)
        lengths.append(length)
    n_min = draw(st.integers(1, 3))
    n_max = draw(st.integers(n_min, n_min + 3))
    k = draw(st.integers(1, 5))
    w = draw(st.integers(1, 5))
    return rows, lengths, n_min, n_max, k, w, pad_len


@pytest.mark.parametrize("which", list(OPS))
@settings(max_examples=80, deadline=None)
@given(case=ngram_cases())
def test_ngram_match_matches_brute_force(which, case):
    rows, lengths, n_min, n_max, k, w, pad_len = case
    check_ngram(OPS[which], rows, lengths, n_min, n_max, k, w, pad_len)


def test_ngram_match_hand_example():
    #        0  1  2  3  4  5  6  7  8  9 10 11
    seq = [1, 2, 3, 1, 2, 4, 1, 2, 3, 9, 1, 2]
    drafts, dlens, counts, _ = K.ngram_match(torch.tensor([seq]), torch.tensor([12]), 1, 3, 3, 2)
    # n = 3 ("9 1 2") never occurs earlier; n = 2 ("1 2") occurs at 0, 3, 6: continuations
    # (3, 1) at 0, (4, 1) at 3, (3, 9) at 6 -> three groups of one, most recent first.
    assert drafts[0].tolist() == [[3, 9], [4, 1], [3, 1]]
    assert dlens[0].tolist() == [2, 2, 2] and counts[0].tolist() == [1, 1, 1]
    # w = 1: (3) occurs twice and beats (4).
    drafts, dlens, counts, _ = K.ngram_match(torch.tensor([seq]), torch.tensor([12]), 1, 3, 3, 1)
    assert drafts[0].tolist() == [[3], [4], [-1]]
    assert counts[0].tolist() == [2, 1, 0] and dlens[0].tolist() == [1, 1, 0]


@pytest.mark.parametrize("which", list(OPS))
def test_ngram_match_edge_cases(which):
    op = OPS[which]
    # Shorter than n, empty rows, no match, all-same tokens, k > #continuations, padding with matches.
    rows = [
        [7, 8, 7, 8, 7, 8, 7, 8],  # length 1: too short for any match (padding would match)
        [1, 2, 3, 4, 5, 6, 7, 8],  # no repeated token
        [5, 5, 5, 5, 5, 5, 5, 5],  # every start matches
        [3, 3, 3, 3, 3, 3, 3, 3],  # length 0
        [1, 2, 1, 2, 9, 9, 9, 9],  # length 3: "1" at 0 -> continuation (2, 1)
    ]
    lengths = [1, 8, 8, 0, 3]
    for n_min, n_max in [(1, 1), (1, 4), (2, 3), (4, 7)]:
        for k, w in [(1, 1), (4, 3), (6, 8)]:
            check_ngram(op, rows, lengths, n_min, n_max, k, w, 8)
    drafts, dlens, counts, _ = op.ngram_match(torch.tensor(rows), torch.tensor(lengths), 1, 3, 4, 3)
    assert counts[0].tolist() == [0] * 4 and counts[1].tolist() == [0] * 4 and counts[3].tolist() == [0] * 4
    # All-5 row, n = 3: starts 0..4 (p + 3 < 8); continuations (5,5,5) x3 at 0..2, (5,5) at 3, (5,) at 4;
    # the two singletons tie on count, so the more recent (5,) comes first.
    assert drafts[2].tolist() == [[5, 5, 5], [5, -1, -1], [5, 5, -1], [-1, -1, -1]]
    assert counts[2].tolist() == [3, 1, 1, 0] and dlens[2].tolist() == [3, 1, 2, 0]
    assert drafts[4, 0].tolist() == [2, 1, -1] and counts[4].tolist() == [1, 0, 0, 0]


def test_ngram_match_rejects_bad_sizes():
    tokens, lengths = torch.zeros(1, 4, dtype=torch.int64), torch.tensor([4])
    with pytest.raises(ValueError):
        K.ngram_match(tokens, lengths, 0, 2, 1, 1)
    with pytest.raises(ValueError):
        K.ngram_match(tokens, lengths, 3, 2, 1, 1)
    with pytest.raises(ValueError):
        K.ngram_match(tokens, lengths, 1, 2, 0, 1)
    with pytest.raises(ValueError):
        K.ngram_match(tokens, lengths, 1, 2, 1, 0)


# ----------------------------------------------------------------------------------------
# topk_entropy
# ----------------------------------------------------------------------------------------


def check_topk_entropy(op, logits, k, temperature):
    probs, ids, entropy, lse = op.topk_entropy(logits, k, temperature)
    x = logits.double() / temperature
    p = torch.softmax(x, dim=-1)
    want_lse = torch.logsumexp(x, dim=-1)
    want_entropy = torch.tensor([-sum(pi * math.log(pi) for pi in row if pi > 0) for row in p.tolist()], dtype=torch.float64)
    want_probs = p.topk(k, dim=-1).values
    assert probs.dtype == torch.float32 and entropy.dtype == torch.float32 and lse.dtype == torch.float32
    assert ids.dtype == torch.int64 and probs.shape == ids.shape == (logits.shape[0], k)
    torch.testing.assert_close(probs.double(), want_probs, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(entropy.double(), want_entropy, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
    # ids: distinct, and the probabilities at them are the returned ones (ties may order either way).
    for r in range(logits.shape[0]):
        assert len(set(ids[r].tolist())) == k
    torch.testing.assert_close(p.gather(1, ids), probs.double(), atol=1e-6, rtol=1e-5)
    assert bool((probs[:, :-1] >= probs[:, 1:]).all())


@pytest.mark.parametrize("which", list(OPS))
@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(1, 300), st.data(), st.sampled_from([0.5, 1.0, 2.0]),
       st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), st.floats(0.1, 20.0), st.integers(0, 2**31 - 1))
def test_topk_entropy_matches_torch(which, n, v, data, temperature, dtype, spread, seed):
    k = data.draw(st.integers(1, v))
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=g) * spread).to(dtype)
    check_topk_entropy(OPS[which], logits, k, temperature)


def test_topk_entropy_masked_and_peaked():
    logits = torch.tensor([[0.0, float("-inf"), 1.0, float("-inf")], [100.0, 0.0, 0.0, 0.0], [3.0] * 4])
    check_topk_entropy(K, logits, 4, 1.0)
    probs, ids, entropy, _ = K.topk_entropy(logits, 2, 1.0)
    assert torch.isfinite(entropy).all()
    torch.testing.assert_close(entropy[2], torch.tensor(math.log(4)))
    assert ids[0].tolist() == [2, 0] and ids[1, 0].item() == 0
    # Exact ids without ties, against torch.topk directly.
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=g)
    _, ids, _, _ = K.topk_entropy(logits, 10, 0.5)
    assert torch.equal(ids, torch.softmax(logits / 0.5, -1).topk(10).indices)


@pytest.mark.parametrize("which", list(OPS))
def test_topk_entropy_rejects_bad_args(which):
    logits = torch.randn(2, 5)
    for t in (0.0, -1.0):
        with pytest.raises(ValueError):
            OPS[which].topk_entropy(logits, 2, t)
    if which == "public":
        for k in (0, 6):
            with pytest.raises(ValueError):
                K.topk_entropy(logits, k, 1.0)
    else:
        with pytest.raises((ValueError, RuntimeError)):
            reference.topk_entropy(logits, 6, 1.0)


# ----------------------------------------------------------------------------------------
# tree_verify_greedy / tree_verify_sampling
# ----------------------------------------------------------------------------------------


def naive_verify_greedy(tokens, parents, logits, valid):
    """Per row: accept nodes in index order, pick the deepest accepted (lowest index on ties)."""
    out = []
    for r in range(len(tokens)):
        t = len(tokens[r])
        argmax = [max(range(len(logits[r][i])), key=lambda x: logits[r][i][x]) for i in range(t)]
        accepted = [True] + [False] * (t - 1)
        for i in range(1, t):
            p = parents[r][i]
            accepted[i] = valid[r][i] and accepted[p] and tokens[r][i] == argmax[p]
        best = max((i for i in range(t) if accepted[i]), key=lambda i: (depth_of(parents[r], i), -i))
        path, j = [], best
        while j >= 0:
            path.append(j)
            j = parents[r][j]
        out.append((path[::-1], argmax[best]))
    return out


@st.composite
def verify_cases(draw, distinct_siblings: bool = False):
    """Trees whose tokens often follow the target's argmax, so that some branches are accepted."""
    b = draw(st.integers(1, 4))
    t = draw(st.integers(1, 24))
    v = draw(st.integers(max(6, t), max(12, t + 4)) if distinct_siblings else st.integers(6, 12))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, v, generator=g)  # continuous: no ties in argmax
    argmax = logits.argmax(-1).tolist()
    tokens, parents, valid = [], [], []
    for r in range(b):
        ps = random_parents(draw, t)
        toks = [draw(st.integers(0, v - 1))]
        for i in range(1, t):
            used = {toks[j] for j in range(1, i) if ps[j] == ps[i]} if distinct_siblings else set()
            match = argmax[r][ps[i]]
            if draw(st.integers(0, 2)) > 0 and match not in used:
                toks.append(match)
            else:
                toks.append(draw(st.sampled_from([x for x in range(v) if x not in used])))
        n_valid = draw(st.integers(1, t))
        vs = [i < n_valid or draw(st.booleans()) for i in range(t)] if draw(st.booleans()) else [True] * t
        vs[0] = True
        tokens.append(toks)
        parents.append(ps)
        valid.append(vs)
    return (torch.tensor(tokens, dtype=torch.int64).reshape(b, t), torch.tensor(parents, dtype=torch.int64).reshape(b, t),
            logits, torch.tensor(valid).reshape(b, t))


def check_greedy_result(result, want, t):
    path, length, next_token = result
    assert path.dtype == torch.int64 and path.shape[1] == t
    assert length.dtype == torch.int32 and next_token.dtype == torch.int64
    for r, (wpath, wnext) in enumerate(want):
        assert path[r].tolist() == wpath + [-1] * (t - len(wpath)), r
        assert length[r].item() == len(wpath), r
        assert next_token[r].item() == wnext, r


@pytest.mark.parametrize("which", list(OPS))
@settings(max_examples=60, deadline=None)
@given(case=verify_cases(), use_valid=st.booleans())
def test_tree_verify_greedy_matches_naive(which, case, use_valid):
    tokens, parents, logits, valid = case
    if not use_valid:
        valid = torch.ones_like(valid)
    want = naive_verify_greedy(tokens.tolist(), parents.tolist(), logits.tolist(), valid.tolist())
    result = OPS[which].tree_verify_greedy(tokens, parents, logits, valid if use_valid else None)
    check_greedy_result(result, want, tokens.shape[1])


def test_tree_verify_greedy_hand_example():
    # Root 0; children 1 (tok 4), 2 (tok 5); 1 -> 3 (tok 6), 2 -> 4 (tok 7) -> 5 (tok 8).
    tokens = torch.tensor([[9, 4, 5, 6, 7, 8]])
    parents = torch.tensor([[-1, 0, 0, 1, 2, 4]])
    logits = torch.full((1, 6, 10), -1.0)
    for node, tok in [(0, 5), (1, 6), (2, 7), (4, 3), (5, 1)]:  # argmax at node
        logits[0, node, tok] = 1.0
    path, length, nxt = K.tree_verify_greedy(tokens, parents, logits)
    assert path.tolist() == [[0, 2, 4, -1, -1, -1]] and length.tolist() == [3] and nxt.tolist() == [3]
    # Node 4 marked invalid: the path stops at node 2.
    valid = torch.tensor([[True, True, True, True, False, True]])
    path, length, nxt = K.tree_verify_greedy(tokens, parents, logits, valid)
    assert path.tolist() == [[0, 2, -1, -1, -1, -1]] and length.tolist() == [2] and nxt.tolist() == [7]
    # Equal depths: both 1 and 2 accepted (argmax at root ties are impossible, so use duplicated tokens).
    tokens2 = torch.tensor([[9, 5, 5]])
    path, length, nxt = K.tree_verify_greedy(tokens2, torch.tensor([[-1, 0, 0]]), logits[:, :3])
    assert path.tolist() == [[0, 1, -1]] and nxt.tolist() == [6]  # lowest index wins


def test_tree_verify_greedy_root_only():
    logits = torch.randn(3, 1, 7)
    path, length, nxt = K.tree_verify_greedy(torch.tensor([[1], [2], [3]]), torch.full((3, 1), -1), logits)
    assert path.tolist() == [[0]] * 3 and length.tolist() == [1] * 3
    assert torch.equal(nxt, logits[:, 0].argmax(-1))


@pytest.mark.parametrize("which", list(OPS))
@settings(max_examples=60, deadline=None)
@given(case=verify_cases(distinct_siblings=True), use_valid=st.booleans(), with_draft=st.booleans(),
       useed=st.integers(0, 2**31 - 1), ukind=st.sampled_from(["random", "zero", "near_one"]))
def test_tree_verify_sampling_one_hot_equals_greedy(which, case, use_valid, with_draft, useed, ukind):
    tokens, parents, logits, valid = case
    b, t, v = logits.shape
    g = torch.Generator().manual_seed(useed)
    target = torch.nn.functional.one_hot(logits.argmax(-1), v).float()
    draft = torch.softmax(torch.randn(b, t, v, generator=g) * 2, -1) if with_draft else None
    # Extreme uniforms included: u = 0 must not accept a token the target gives probability 0.
    uniforms = {"random": torch.rand(b, t + 1, generator=g), "zero": torch.zeros(b, t + 1),
                "near_one": torch.full((b, t + 1), 1 - 1e-7)}[ukind]
    if ukind == "random":
        uniforms[:, -1] = torch.tensor([0.0, 1 - 1e-7, 0.5, 0.999])[:b]
    vmask = valid if use_valid else None
    greedy = OPS[which].tree_verify_greedy(tokens, parents, logits, vmask)
    sampled = OPS[which].tree_verify_sampling(tokens, parents, target, draft, uniforms, vmask)
    for got, want in zip(sampled, greedy):
        assert torch.equal(got, want)
    want = naive_verify_greedy(tokens.tolist(), parents.tolist(), logits.tolist(),
                               (valid if use_valid else torch.ones_like(valid)).tolist())
    check_greedy_result(sampled, want, t)


@pytest.mark.parametrize("which", list(OPS))
@settings(max_examples=40, deadline=None)
@given(case=verify_cases(), k=st.integers(1, 8), useed=st.integers(0, 2**31 - 1))
def test_tree_verify_sampling_sparse_equals_dense(which, case, k, useed):
    """Proposals as (ids, probs) give exactly the decisions of the same proposals written out over the
    whole vocabulary, -1 entries and all-zero (one-hot) rows included."""
    tokens, parents, logits, valid = case
    b, t, v = logits.shape
    g = torch.Generator().manual_seed(useed)
    target = torch.softmax(logits * 2, -1)
    ids = torch.rand(b, t, v, generator=g).argsort(-1)[..., :min(k, v)]
    probs = torch.softmax(torch.randn(b, t, ids.shape[2], generator=g), -1)
    unused = torch.rand(ids.shape, generator=g) < 0.25
    ids, probs = ids.masked_fill(unused, -1), probs.masked_fill(unused, 0.0)
    probs[:, 1::3] = 0.0
    uniforms = torch.rand(b, t + 1, generator=g)
    sparse = OPS[which].tree_verify_sampling(tokens, parents, target, probs, uniforms, valid, ids)
    dense = OPS[which].tree_verify_sampling(tokens, parents, target, SparseProbs(ids, probs).dense(v), uniforms, valid)
    for got, want in zip(sparse, dense):
        assert torch.equal(got, want)


def test_tree_verify_sampling_rejects_mismatched_proposals():
    tokens, parents = torch.tensor([[1, 2]]), torch.tensor([[-1, 0]])
    target, u = torch.full((1, 2, 5), 0.2), torch.rand(1, 3)
    with pytest.raises(ValueError, match="whole vocabulary"):
        K.tree_verify_sampling(tokens, parents, target, torch.rand(1, 2, 3), u)
    with pytest.raises(ValueError, match="draft_ids must match"):
        K.tree_verify_sampling(tokens, parents, target, torch.rand(1, 2, 3), u, None, torch.zeros(1, 2, 2, dtype=torch.int64))


# ----------------------------------------------------------------------------------------
# sample_from_probs
# ----------------------------------------------------------------------------------------


def naive_sample(probs: list[float], u: float) -> int:
    """Smallest i with cdf[i] > u * total, in exact (float64) arithmetic."""
    total = sum(probs)
    acc = 0.0
    for i, p in enumerate(probs):
        acc += p
        if acc > u * total:
            return i
    return max(i for i, p in enumerate(probs) if p > 0)


NEAR_ONE = [1 - 1e-7, 1 - 2**-24, 1 - 1e-9, 0.9999999999]


@pytest.mark.parametrize("u", NEAR_ONE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_sample_from_probs_never_trailing_zero(u, dtype):
    probs = torch.tensor([
        [0.3, 0.7, 0.0, 0.0, 0.0],
        [0.1, 0.2, 0.3, 0.4, 0.0],
        [1e-3, 0.0, 0.999, 0.0, 0.0],
        [0.0, 0.0, 0.0, 0.0, 5.0],
        [1.0 / 3, 1.0 / 3, 1.0 / 3, 0.0, 0.0],
        [1e-8, 1.0, 1e-8, 0.0, 0.0],
    ]).to(dtype)
    idx = K.sample_from_probs(probs, torch.full((probs.shape[0],), u, dtype=torch.float64).to(torch.float32))
    assert idx.dtype == torch.int64
    assert bool((probs.gather(1, idx[:, None]) > 0).all()), idx.tolist()
    assert idx.tolist()[:5] == [1, 3, 2, 4, 2]


def test_sample_from_probs_zero_in_the_middle_and_edges():
    probs = torch.tensor([[0.5, 0.0, 0.5, 0.0], [0.0, 0.0, 1.0, 0.0], [0.25, 0.0, 0.0, 0.75]])
    assert K.sample_from_probs(probs, torch.tensor([0.5, 0.0, 0.25])).tolist() == [2, 2, 3]
    assert K.sample_from_probs(probs, torch.tensor([0.0, 0.3, 0.0])).tolist() == [0, 2, 0]
    assert K.sample_from_probs(probs, torch.tensor([0.49, 0.99, 0.2499])).tolist() == [0, 2, 0]
    # Unnormalised.
    assert K.sample_from_probs(probs * 40, torch.tensor([0.5, 0.0, 0.25])).tolist() == [2, 2, 3]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.just(0.0), st.floats(1e-6, 1.0)), min_size=1, max_size=40).filter(lambda p: sum(p) > 0),
       st.one_of(st.sampled_from([0.0] + NEAR_ONE), st.floats(0.0, 1.0, exclude_max=True)),
       st.sampled_from([torch.float32, torch.float64]))
def test_sample_from_probs_random(probs, u, dtype):
    p = torch.tensor([probs], dtype=dtype)
    idx = K.sample_from_probs(p, torch.tensor([u])).item()
    assert probs[idx] > 0
    # Away from cdf boundaries, the inverse CDF is exact.
    total = sum(probs)
    cdf = [sum(probs[: i + 1]) for i in range(len(probs))]
    if all(abs(c - u * total) > 1e-4 * total for c in cdf):
        assert idx == naive_sample(probs, u)


def test_triton_runs_on_the_gpu_where_there_is_one():
    """tests/conftest.py picks Triton's interpreter only without a GPU: on a GPU machine a plain ``pytest tests/``
    runs the GPU tests (tests/test_gpu.py skips under the interpreter)."""
    import os

    from tests import conftest

    if not conftest.TRITON_INTERPRET_CHOSEN:
        assert os.environ["TRITON_INTERPRET"] == ("0" if torch.cuda.is_available() else "1")
