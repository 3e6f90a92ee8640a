"""The pending region: tree attention over N >= T pending nodes (the queries the last T), and the runner
growing a draft tree level by level in it (``forward_pending`` / ``commit_pending`` / ``drop_pending``)."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first `import triton`

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import specdec.kernels as K
from specdec.kernels import reference
from specdec.kernels._dispatch import has_triton
from specdec.model import ModelRunner
from specdec.tree import DraftTree
from tests.conftest import tiny_model
from tests.naive import one_thread  # noqa: F401

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    # Triton's interpreter evaluates both sides of masked selects (inf - inf) in numpy.
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=3e-3, rtol=3e-3),
       torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}
needs_native = pytest.mark.skipif(not K.has_native("tree_attention"), reason="specdec._C is not built")
# These tests hand Triton CPU tensors: only its interpreter runs them (on a GPU machine TRITON_INTERPRET is 0).
INTERPRETED = has_triton() and os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not INTERPRETED, reason="triton (interpreted) is not available")


# ----------------------------------------------------------------------------------------
# Kernel inputs: rows whose pending regions differ in size
# ----------------------------------------------------------------------------------------


def pending_case(draw, max_n: int, max_s: int, head_dims, dtypes) -> dict:
    """A pending region per row: valid nodes form a tree (parents precede children); the others are
    padding. The queries are the last T of N nodes; a padding query's mask row is empty (it sees the
    prefix only) or itself only; valid queries see their ancestors and themselves."""
    b = draw(st.integers(1, 3))
    n = draw(st.integers(1, max_n))
    frontier = draw(st.sampled_from(["one", "all", "any"]))
    t = {"one": 1, "all": n, "any": draw(st.integers(1, n))}[frontier]
    shape = draw(st.sampled_from(["random", "bushy", "chain"]))
    s = draw(st.integers(0, max_s))
    rows = []
    for _ in range(b):
        valid = [True] + [draw(st.integers(0, 5)) > 0 for _ in range(n - 1)]  # about one node in six is padding
        parents = [-1]
        for j in range(1, n):
            earlier = [i for i in range(j) if valid[i]]
            parents.append({"bushy": 0, "chain": earlier[-1]}.get(shape, draw(st.sampled_from(earlier))))
        pad_rows = draw(st.sampled_from(["empty", "self"]))
        rows.append((valid, parents, pad_rows, draw(st.integers(0, s))))
    return dict(
        b=b, hkv=draw(st.integers(1, 2)), group=draw(st.sampled_from([1, 2, 3, 4])), d=draw(st.sampled_from(head_dims)),
        n=n, t=t, s=s, rows=rows, layout=draw(st.sampled_from(["separate", "runner"])),
        causal=draw(st.integers(0, 7)) == 0,  # a None mask: the queries continue a chain
        window=draw(st.one_of(st.none(), st.integers(1, s + n + 1))), dtype=draw(st.sampled_from(dtypes)),
        scale=draw(st.sampled_from([None, 0.3])), seed=draw(st.integers(0, 2**31 - 1)))


def visibility(case: dict) -> list[list[list[bool]]]:
    """``vis[b][i][j]``: query i (pending node N - T + i) sees pending node j."""
    n, t = case["n"], case["t"]
    out = []
    for valid, parents, pad_rows, _ in case["rows"]:
        rows = []
        for i in range(t):
            node = n - t + i
            if case["causal"]:
                rows.append([j <= node for j in range(n)])
                continue
            seen = set()
            if valid[node]:
                j = node
                while j >= 0:
                    seen.add(j)
                    j = parents[j]
            elif pad_rows == "self":
                seen.add(node)
            rows.append([j in seen for j in range(n)])
        out.append(rows)
    return out


def positions_of(case: dict) -> torch.Tensor:
    """``[B,N]``: committed length plus depth for valid nodes; padding sits at the committed length."""
    out = []
    for valid, parents, _, length in case["rows"]:
        depth = [0] * case["n"]
        for j in range(1, case["n"]):
            depth[j] = depth[parents[j]] + 1 if valid[j] else 0
        out.append([length + x for x in depth])
    return torch.tensor(out, dtype=torch.int64)


def build(case: dict):
    """q, k_cache, v_cache, cache_lens, k_tree, v_tree, mask, positions. With the "runner" layout the
    cache view runs on into the pending keys (k_tree is a view of k_cache), as the runner hands them over."""
    b, hkv, hq, d, n, t, s = case["b"], case["hkv"], case["hkv"] * case["group"], case["d"], case["n"], case["t"], case["s"]
    g = torch.Generator().manual_seed(case["seed"])
    dtype = case["dtype"]
    q = torch.randn(b, hq, t, d, generator=g).to(dtype)
    k_all = torch.randn(b, hkv, s + n, d, generator=g).to(dtype)
    v_all = torch.randn(b, hkv, s + n, d, generator=g).to(dtype)
    lens = torch.tensor([row[3] for row in case["rows"]], dtype=torch.int64)
    for r, (valid, *_rest) in enumerate(case["rows"]):
        k_all[r, :, lens[r]:s] = 30  # stale cache entries: large, so a leak shows
        v_all[r, :, lens[r]:s] = 1000
        pad = torch.tensor([s + j for j in range(n) if not valid[j]], dtype=torch.int64)
        k_all[r, :, pad] = 20  # padding nodes' keys and values: finite garbage
        v_all[r, :, pad] = -500
    if case["layout"] == "runner":
        k_cache, v_cache = k_all, v_all
    else:
        k_cache, v_cache = k_all[:, :, :s].clone(), v_all[:, :, :s].clone()
    k_tree, v_tree = k_all[:, :, s:], v_all[:, :, s:]
    mask = None if case["causal"] else K.pack_mask(torch.tensor(visibility(case), dtype=torch.bool).reshape(b, t, n))
    return q, k_cache, v_cache, lens, k_tree, v_tree, mask, positions_of(case)


def run(case: dict, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The backend's output and the reference's (fp32 inputs: the kernels accumulate in fp32)."""
    q, k_cache, v_cache, lens, k_tree, v_tree, mask, pos = build(case)
    window = case["window"]
    pos = pos if window is not None else None
    got = K.tree_attention(q, k_cache, v_cache, lens, k_tree, v_tree, mask, case["scale"], pos, window, backend=backend)
    f = lambda x: x.float()  # noqa: E731
    want = reference.tree_attention(f(q), f(k_cache), f(v_cache), lens, f(k_tree), f(v_tree), mask, case["scale"],
                                    pos, window)
    assert got.dtype == case["dtype"] and got.shape == q.shape
    assert not got.isnan().any()
    return got.float(), want


def naive(case: dict) -> torch.Tensor:
    """Loop over (row, query) in float64: softmax over the keys the query sees (zeros if none)."""
    q, k_cache, v_cache, lens, k_tree, v_tree, _, pos = build(case)
    vis, window, t, n = visibility(case), case["window"], case["t"], case["n"]
    b, hq, _, d = q.shape
    ratio = hq // k_cache.shape[1]
    scale = d ** -0.5 if case["scale"] is None else case["scale"]
    q, k_cache, v_cache, k_tree, v_tree = (x.double() for x in (q, k_cache, v_cache, k_tree, v_tree))
    out = torch.zeros(b, hq, t, d, dtype=torch.float64)
    for r in range(b):
        for i in range(t):
            qpos = int(pos[r, n - t + i])
            keys = [(k_cache[r, :, j], v_cache[r, :, j]) for j in range(int(lens[r]))
                    if window is None or j > qpos - window]
            keys += [(k_tree[r, :, j], v_tree[r, :, j]) for j in range(n)
                     if vis[r][i][j] and (window is None or int(pos[r, j]) > qpos - window)]
            if not keys:
                continue
            group = torch.arange(hq) // ratio
            kk = torch.stack([k for k, _ in keys], dim=1)[group]
            vv = torch.stack([v for _, v in keys], dim=1)[group]
            scores = (kk @ q[r, :, i, :, None]).squeeze(-1) * scale
            out[r, :, i] = (torch.softmax(scores, dim=-1)[:, None, :] @ vv).squeeze(1)
    return out


# ----------------------------------------------------------------------------------------
# Kernels against the reference (and the reference against the loop)
# ----------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_reference_matches_naive(data):
    case = pending_case(data.draw, max_n=40, max_s=12, head_dims=(4, 8), dtypes=(torch.float32,))
    got = K.tree_attention(*build(case)[:7], case["scale"],
                           positions_of(case) if case["window"] is not None else None, case["window"], backend="torch")
    torch.testing.assert_close(got.double(), naive(case), atol=1e-5, rtol=1e-5)


@needs_native
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_native_matches_reference(data):
    case = pending_case(data.draw, max_n=80, max_s=40, head_dims=(4, 16, 24, 64),
                        dtypes=(torch.float32, torch.float32, torch.bfloat16, torch.float16))
    got, want = run(case, "cpp")
    torch.testing.assert_close(got, want, **TOL[case["dtype"]])


INTERPRETED = settings(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow],
                       phases=(Phase.explicit, Phase.generate), max_examples=40)


@needs_triton
@INTERPRETED
@given(data=st.data())
def test_triton_matches_reference(data):
    case = pending_case(data.draw, max_n=70, max_s=20, head_dims=(16, 64),
                        dtypes=(torch.float32, torch.float16, torch.bfloat16))
    got, want = run(case, "triton")
    torch.testing.assert_close(got, want, **TOL[case["dtype"]])


def fixed_case(b, hkv, group, d, n, t, s, shape, window=None, dtype=torch.float32, causal=False, pad_rows="empty"):
    """A deterministic case: row r has ``n - 2 r`` valid nodes (ragged regions, padding at the end)."""
    rows = []
    for r in range(b):
        m = max(1, n - 2 * r)
        valid = [j < m for j in range(n)]
        parents = [-1] + [{"bushy": 0, "chain": min(j, m) - 1, "levels": (j - 1) // 3}[shape] for j in range(1, n)]
        rows.append((valid, parents, pad_rows, max(0, s - 3 * r)))
    return dict(b=b, hkv=hkv, group=group, d=d, n=n, t=t, s=s, rows=rows, layout="runner", causal=causal,
                window=window, dtype=dtype, scale=None, seed=n * 31 + t)


EDGE_CASES = [
    (1, 3, 3, 64, 400, 1, 400, "chain", None),  # a one-node frontier under a long prefix
    (2, 2, 2, 64, 40, 24, 30, "bushy", None),  # a bushy frontier over two mask words
    (3, 1, 4, 16, 70, 6, 9, "levels", 5),  # three mask words, a window, ragged rows
    (2, 2, 1, 8, 33, 33, 0, "levels", None),  # the square case past 32 nodes, empty prefixes
    (1, 1, 2, 32, 300, 40, 260, "levels", None),  # pending keys in more than one 256-key chunk
]


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,hkv,group,d,n,t,s,shape,window", EDGE_CASES)
def test_native_edge_cases(dtype, b, hkv, group, d, n, t, s, shape, window):
    for causal in (False, True):
        got, want = run(fixed_case(b, hkv, group, d, n, t, s, shape, window, dtype, causal), "cpp")
        torch.testing.assert_close(got, want, **TOL[dtype])


@needs_triton
@pytest.mark.parametrize("b,hkv,group,d,n,t,s,shape,window", [c for c in EDGE_CASES if c[4] <= 70])
def test_triton_edge_cases(b, hkv, group, d, n, t, s, shape, window):
    got, want = run(fixed_case(b, hkv, group, d, n, t, s, shape, window), "triton")
    torch.testing.assert_close(got, want, **TOL[torch.float32])


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
def test_padding_queries_are_defined(backend):
    """A query whose mask row is empty sees only the committed prefix; with an empty prefix it sees
    nothing and gets zeros; a query that sees only itself gets its own value. Never NaN."""
    if backend == "cpp" and not K.has_native("tree_attention") or backend == "triton" and not INTERPRETED:
        pytest.skip(f"no {backend} kernel for CPU tensors")
    g = torch.Generator().manual_seed(3)
    b, hkv, d, n, t, s = 2, 1, 16, 5, 3, 4
    q, k_tree, v_tree = torch.randn(b, hkv, t, d, generator=g), torch.randn(b, hkv, n, d, generator=g), \
        torch.randn(b, hkv, n, d, generator=g)
    k_cache, v_cache = torch.randn(b, hkv, s, d, generator=g), torch.randn(b, hkv, s, d, generator=g)
    lens = torch.tensor([s, 0])
    vis = torch.zeros(b, t, n, dtype=torch.bool)
    vis[:, 1, n - t + 1] = True  # query 1 sees itself only; queries 0 and 2 see no pending node
    out = K.tree_attention(q, k_cache, v_cache, lens, k_tree, v_tree, K.pack_mask(vis), backend=backend)
    assert not out.isnan().any()
    prefix_only = torch.softmax(q[0, 0] @ k_cache[0, 0].T * d ** -0.5, -1) @ v_cache[0, 0]
    torch.testing.assert_close(out[0, 0, [0, 2]], prefix_only[[0, 2]], atol=1e-5, rtol=1e-5)
    assert torch.equal(out[1, 0, [0, 2]], torch.zeros(2, d))
    torch.testing.assert_close(out[1, 0, 1], v_tree[1, 0, n - t + 1], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
def test_pending_equals_square_rows(backend):
    """Attending as the last T of N pending nodes equals the last T rows of the square N-node call."""
    if backend == "cpp" and not K.has_native("tree_attention") or backend == "triton" and not INTERPRETED:
        pytest.skip(f"no {backend} kernel for CPU tensors")
    case = fixed_case(2, 2, 2, 16, 37, 37, 11, "levels", window=9)
    q, k_cache, v_cache, lens, k_tree, v_tree, mask, pos = build(case)
    square = K.tree_attention(q, k_cache, v_cache, lens, k_tree, v_tree, mask, None, pos, 9, backend=backend)
    for t in (1, 4, 36):
        got = K.tree_attention(q[:, :, -t:], k_cache, v_cache, lens, k_tree, v_tree, mask[:, -t:], None, pos, 9,
                               backend=backend)
        torch.testing.assert_close(got, square[:, :, -t:], atol=1e-6, rtol=1e-6)
        causal_sq = K.tree_attention(q, k_cache, v_cache, lens, k_tree, v_tree, None, backend=backend)
        causal = K.tree_attention(q[:, :, -t:], k_cache, v_cache, lens, k_tree, v_tree, None, backend=backend)
        torch.testing.assert_close(causal, causal_sq[:, :, -t:], atol=1e-6, rtol=1e-6)


@needs_native
def test_native_op_opcheck_and_compile():
    """The fake kernel and the schema hold for N > T (torch.compile traces the runner's pending forwards)."""
    case = fixed_case(2, 2, 3, 16, 37, 5, 12, "levels", window=6)
    q, k_cache, v_cache, lens, k_tree, v_tree, mask, pos = build(case)
    ops = torch.ops.specdec
    torch.library.opcheck(ops.tree_attention.default, (q, k_cache, v_cache, lens, k_tree, v_tree, mask, 0.5, pos, 6))
    torch.library.opcheck(ops.tree_attention.default, (q, k_cache, v_cache, lens, k_tree, v_tree, None))

    def fn(q, k_tree, v_tree):
        return ops.tree_attention(q, k_cache, v_cache, lens, k_tree, v_tree, mask, None, pos, 6) * 2

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(q, k_tree, v_tree), fn(q, k_tree, v_tree))


def test_shape_checks():
    q, kv = torch.zeros(1, 2, 3, 8), torch.zeros(1, 1, 4, 8)
    tree = torch.zeros(1, 1, 40, 8)
    with pytest.raises(ValueError, match="N >= T"):
        K.tree_attention(q, kv, kv, torch.tensor([4]), tree[:, :, :2], tree[:, :, :2], None)
    with pytest.raises(ValueError, match="ceil"):
        K.tree_attention(q, kv, kv, torch.tensor([4]), tree, tree, torch.zeros(1, 3, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\[B, N\]"):
        K.tree_attention(q, kv, kv, torch.tensor([4]), tree, tree, None, tree_positions=torch.zeros(1, 3), window=4)
    if K.has_native("tree_attention"):
        ops = torch.ops.specdec
        with pytest.raises(RuntimeError):
            ops.tree_attention(q, kv, kv, torch.tensor([4]), tree[:, :, :2], tree[:, :, :2], None)
        with pytest.raises(RuntimeError):
            ops.tree_attention(q, kv, kv, torch.tensor([4]), tree, tree, torch.zeros(1, 3, 1, dtype=torch.int32))
        with pytest.raises(RuntimeError):
            ops.tree_attention(q, kv, kv, torch.tensor([4]), tree, tree, None, None, torch.zeros(1, 3).long(), 4)


# ----------------------------------------------------------------------------------------
# The runner: a tree grown level by level equals the tree run in one forward
# ----------------------------------------------------------------------------------------

# Per row: a root, its children, then their children; rows differ (ragged levels are padded).
LEVELS = [
    [[11], [21, 22, 23], [31, 32, 33, 34, 35, 36]],
    [[12], [24, 25], [37, 38, 39]],
]
PARENT_OF = [  # per row, per level, the parent of each node (index within the previous level)
    [[-1], [0, 0, 0], [0, 0, 1, 1, 2, 2]],
    [[-1], [0, 0], [0, 0, 1]],
]
PROMPTS = [list(range(2, 16)), list(range(40, 47))]  # ragged: 14 and 7 tokens


def level_layout(rows: int):
    """The grown tree as one flat pending region: per level ``F`` = the widest row's node count, padded.

    Returns tokens ``[B,N]``, parents ``[B,N]`` (padding hangs off node 0), valid ``[B,N]`` and the
    level widths."""
    widths = [max(len(LEVELS[r][lv]) for r in range(rows)) for lv in range(len(LEVELS[0]))]
    tokens, parents, valid = [], [], []
    for r in range(rows):
        tok, par, ok, start, prev_start = [], [], [], 0, 0
        for lv, width in enumerate(widths):
            nodes = LEVELS[r][lv]
            for i in range(width):
                real = i < len(nodes)
                tok.append(nodes[i] if real else 0)
                par.append((prev_start + PARENT_OF[r][lv][i] if lv else -1) if real else 0)
                ok.append(real)
            prev_start, start = start, start + width
        par[0] = -1
        tokens.append(tok)
        parents.append(par)
        valid.append(ok)
    return torch.tensor(tokens), torch.tensor(parents), torch.tensor(valid), widths


def prefilled(model, rows: int, attention: str, compile: bool = False) -> ModelRunner:
    runner = ModelRunner(model, attention=attention, compile=compile)
    runner.reset(rows, 64)
    prompts = PROMPTS[:rows]
    width = max(len(p) for p in prompts)
    runner.prefill(torch.tensor([p + [0] * (width - len(p)) for p in prompts]), torch.tensor([len(p) for p in prompts]))
    return runner


def grow(runner: ModelRunner, rows: int, first_as_tree: bool = False) -> torch.Tensor:
    """Run the tree level by level through the pending region; logits ``[B,N,V]`` in region order."""
    tokens, parents, valid, widths = level_layout(rows)
    tree = DraftTree.from_parents(tokens, parents, valid)
    full_mask = tree.dense_mask()  # [B,N,N]
    positions = tree.positions(runner.lengths)
    out, start = [], 0
    for lv, width in enumerate(widths):
        end = start + width
        if lv == 0 and first_as_tree:
            logits, _ = runner.forward_tree(DraftTree.chain(tokens[:, 0]))
        else:
            mask = K.pack_mask(full_mask[:, start:end, :end])
            logits, _ = runner.forward_pending(tokens[:, start:end], positions[:, start:end], mask)
        assert runner.pending == end
        out.append(logits)
        start = end
    return torch.cat(out, dim=1)


def one_tree(runner: ModelRunner, rows: int) -> torch.Tensor:
    tokens, parents, valid, _ = level_layout(rows)
    logits, _ = runner.forward_tree(DraftTree.from_parents(tokens, parents, valid))
    return logits


@pytest.mark.parametrize("attention", ["kernel", "sdpa"])
@pytest.mark.parametrize("arch,rows", [("llama", 1), ("llama", 2), ("gemma3", 2)])  # gemma3: sliding window
def test_levels_equal_one_tree(arch, rows, attention):
    if attention == "kernel" and not K.has_native("tree_attention"):
        pytest.skip("specdec._C is not built")
    model = tiny_model(arch)
    want = one_tree(prefilled(model, rows, attention), rows)
    _, _, valid, _ = level_layout(rows)
    for first_as_tree in (False, True):
        got = grow(prefilled(model, rows, attention), rows, first_as_tree)
        assert not got.isnan().any()
        torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=1e-5)


def paths(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An accepted root-to-leaf path per row, in region indices: row 0 root -> child 1 -> its second
    child; row 1 root -> child 0."""
    _, parents, _, widths = level_layout(rows)
    leaf0 = widths[0] + widths[1] + 3  # level 2's node 3: the second child of child 1
    p0 = [0, int(parents[0, leaf0]), leaf0]
    assert p0[1] == widths[0] + 1
    path = torch.full((rows, 3), -1, dtype=torch.int64)
    path[0] = torch.tensor(p0)
    lens = [3]
    if rows > 1:
        path[1, :2] = torch.tensor([0, widths[0]])
        lens.append(2)
    return path, torch.tensor(lens)


@pytest.mark.parametrize("attention", ["kernel", "sdpa"])
@pytest.mark.parametrize("arch,rows", [("llama", 1), ("llama", 2), ("gemma3", 2)])
def test_commit_pending_equals_commit(arch, rows, attention):
    """After commit_pending(path) the cache is the one a runner that verified the whole tree in one
    forward and committed the same path has: same lengths, same KV, same next logits."""
    if attention == "kernel" and not K.has_native("tree_attention"):
        pytest.skip("specdec._C is not built")
    model = tiny_model(arch)
    path, path_len = paths(rows)
    a = prefilled(model, rows, attention)
    grow(a, rows)
    a.commit_pending(path, path_len)
    b = prefilled(model, rows, attention)
    one_tree(b, rows)
    b.commit(path, path_len, False, path_len.tolist())
    assert a.pending == b.pending == 0
    assert a.lengths_host == b.lengths_host and torch.equal(a.lengths, b.lengths)
    assert a.cache.write_pos == b.cache.write_pos == max(a.lengths_host)
    for x, y in zip(a.cache.buffers(), b.cache.buffers()):
        for r, n in enumerate(a.lengths_host):
            torch.testing.assert_close(x[r, :, :n], y[r, :, :n], atol=1e-5, rtol=1e-5)
    nxt = DraftTree.from_chains(torch.tensor([5] * rows), [[[6, 7], [8]]] * rows)
    torch.testing.assert_close(a.forward_tree(nxt)[0], b.forward_tree(nxt)[0], atol=1e-5, rtol=1e-5)


def test_drop_pending_and_forward_tree_start_fresh():
    """drop_pending forgets the region (the committed prefix stays); forward_tree starts a new one."""
    model = tiny_model("llama")
    fresh = prefilled(model, 2, "sdpa")
    want = one_tree(fresh, 2)
    runner = prefilled(model, 2, "sdpa")
    lengths = list(runner.lengths_host)
    grow(runner, 2)
    runner.drop_pending()
    assert runner.pending == 0 and runner.lengths_host == lengths
    torch.testing.assert_close(one_tree(runner, 2), want, atol=1e-6, rtol=1e-6)
    assert runner.pending == 10  # the tree is a fresh pending region ...
    runner.drop_pending()
    grow(runner, 2)
    torch.testing.assert_close(one_tree(runner, 2), want, atol=1e-6, rtol=1e-6)  # drops the grown region
    assert runner.pending == 10
    with pytest.raises(ValueError, match="ceil"):
        runner.forward_pending(torch.zeros(2, 1, dtype=torch.int64), torch.zeros(2, 1, dtype=torch.int64),
                               torch.zeros(2, 1, 2, dtype=torch.int32))
    runner.rollback(lengths)
    assert runner.pending == 0
    with pytest.raises(ValueError, match="nothing is pending"):
        runner.commit_pending(torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, dtype=torch.int64))


def test_causal_pending_is_a_chain():
    """A None mask continues a chain: growing a chain one node at a time equals the chain in one forward."""
    model = tiny_model("llama")
    chain = torch.tensor([[5, 9, 3, 7]])
    want, _ = prefilled(model, 1, "sdpa").forward_tree(DraftTree.chain(chain[:, 0], chain[:, 1:]))
    runner = prefilled(model, 1, "sdpa")
    base = runner.lengths
    got = [runner.forward_pending(chain[:, :2], base[:, None] + torch.arange(2), None)[0]]
    got += [runner.forward_pending(chain[:, i:i + 1], base[:, None] + i, None)[0] for i in (2, 3)]
    torch.testing.assert_close(torch.cat(got, 1), want, atol=1e-5, rtol=1e-5)


def test_compiled_runner_grows_the_same_tree():
    """compile=True: the pending forwards compile once per kind and give the eager logits."""
    if not K.has_native("tree_attention"):
        pytest.skip("specdec._C is not built")
    torch._dynamo.reset()
    try:
        model = tiny_model("llama")
        want = grow(prefilled(model, 2, "kernel"), 2)
        got = grow(prefilled(model, 2, "kernel", compile=True), 2)
        # Compiled graphs order fp32 reductions their own way (on an AVX-512 Xeon of this machine kind one logit
        # differed by 1.2e-5): close, not equal.
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("attention", ["kernel", "sdpa"])
@pytest.mark.parametrize("keep", [[0, 1], [1, 3], [0, 2, 3], [2]])
def test_keep_rows_equals_the_rows_alone(keep, attention):
    """Rows that leave the batch (``keep_rows``, trailing rows only or rows that move down): the kept rows'
    lengths, and their next logits over a chain, are those of a runner that held only them from the start."""
    if attention == "kernel" and not K.has_native("tree_attention"):
        pytest.skip("specdec._C is not built")
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 96, (n,), generator=g) for n in (7, 3, 11, 5)]

    def runner_of(rows: list[int]) -> ModelRunner:
        runner = ModelRunner(model, attention=attention)
        lens = [len(prompts[r]) for r in rows]
        ids = torch.zeros(len(rows), max(lens), dtype=torch.int64)
        for i, r in enumerate(rows):
            ids[i, : lens[i]] = prompts[r]
        runner.reset(len(rows), max(lens) + 8)
        runner.prefill(ids, torch.tensor(lens))
        return runner

    a, b = runner_of([0, 1, 2, 3]), runner_of(keep)
    a.keep_rows(keep)
    assert a.batch_size == len(keep) and a.lengths_host == b.lengths_host and torch.equal(a.lengths, b.lengths)
    assert a.cache.write_pos == max(a.lengths_host)
    chain = torch.randint(1, 96, (len(keep), 3), generator=g)
    want, _ = b.forward_tree(DraftTree.chain(chain[:, 0], chain[:, 1:]))
    got, _ = a.forward_tree(DraftTree.chain(chain[:, 0], chain[:, 1:]))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="pending"):
        a.keep_rows([0])
    a.drop_pending()
    with pytest.raises(ValueError, match="ascending"):
        a.keep_rows([1, 0])
