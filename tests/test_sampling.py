"""Sampling is lossless: output follows the target's processed distribution (temperature, top-k, top-p).

Chi-square goodness-of-fit tests against exactly computed distributions. Every random draw comes
from a seeded generator, so each test is deterministic: a correct sampler passes with p > PASS
on these seeds, and the planted bugs (wrong verifiers written here) get p < POWER on the same
tests, which shows that the tests can tell.

Kernel level: :func:`specdec.kernels.tree_verify_sampling` over big batches of one tree shape,
with random target tables where the target's distribution at a node depends on the draft prefix
(``P1[t1]``, ``P2[t1, t2]``). Whatever one verification emits is completed from the same tables,
as the next steps would, so the first three tokens must follow ``P0 x P1 x P2`` exactly.

End to end: ``SpecDecoder.generate_ids`` on a tiny 12-token model, the same prompt repeated per
row, against the distribution enumerated over every continuation.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy import stats

from specdec import kernels, methods
from specdec.api import SpecDecoder
from specdec.tree import DraftTree, SparseProbs
from specdec.verify import SamplingConfig, Verifier, processed_probs
from tests.conftest import runnable, schedule_variants, tiny_model
from tests.test_greedy_lossless import perturbed

PASS = 1e-4  # a correct sampler must reach p > PASS
POWER = 1e-8  # a planted bug must fall to p < POWER


# ----------------------------------------------------------------------------------------
# Chi-square
# ----------------------------------------------------------------------------------------


def chi2_pvalue(counts, probs, min_expected: float = 5.0) -> float:
    """Goodness of fit of ``counts`` to ``probs`` (same shape). Cells expected below ``min_expected``
    are pooled into one bin; any count in a probability-zero cell gives p = 0."""
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    assert counts.shape == probs.shape and abs(probs.sum() - 1) < 1e-5, probs.sum()
    n = counts.sum()
    if counts[probs == 0].sum() > 0:
        return 0.0
    exp = probs / probs.sum() * n
    big = exp >= min_expected
    obs_b, exp_b = list(counts[big]), list(exp[big])
    rest_obs, rest_exp = counts[~big].sum(), exp[~big].sum()
    if rest_exp > 0:
        if rest_exp < min_expected and exp_b:  # pool the tail with the smallest big cell
            j = int(np.argmin(exp_b))
            obs_b[j] += rest_obs
            exp_b[j] += rest_exp
        else:
            obs_b.append(rest_obs)
            exp_b.append(rest_exp)
    if len(exp_b) < 2:
        return 1.0
    return float(stats.chisquare(obs_b, exp_b).pvalue)


def joint_counts(seqs: torch.Tensor, v: int) -> np.ndarray:
    """Counts ``[v]*n`` of the rows of ``seqs [N,n]``."""
    n = seqs.shape[1]
    flat = torch.zeros(seqs.shape[0], dtype=torch.int64)
    for j in range(n):
        flat = flat * v + seqs[:, j]
    return torch.bincount(flat, minlength=v ** n).reshape([v] * n).numpy()


def fit_pvalues(counts: np.ndarray, exact: np.ndarray) -> dict[str, float]:
    """p-values of the joint, of every single-token marginal and of every consecutive pair."""
    n = counts.ndim
    out = {"joint": chi2_pvalue(counts, exact)}
    for j in range(n):
        axes = tuple(a for a in range(n) if a != j)
        out[f"t{j + 1}"] = chi2_pvalue(counts.sum(axes), exact.sum(axes))
    for j in range(n - 1):
        axes = tuple(a for a in range(n) if a not in (j, j + 1))
        if axes:
            out[f"t{j + 1}t{j + 2}"] = chi2_pvalue(counts.sum(axes), exact.sum(axes))
    return out


# ----------------------------------------------------------------------------------------
# Kernel level
# ----------------------------------------------------------------------------------------

V = 8
B = 50_000


def random_dists(g: torch.Generator, shape: tuple[int, ...], sharpness: float = 1.5, zero_frac: float = 0.25):
    """Random distributions ``[*shape, V]`` (fp32), neither flat nor one-hot, some entries exactly 0."""
    x = torch.randn(*shape, V, generator=g, dtype=torch.float64) * sharpness
    zero = torch.rand(*shape, V, generator=g, dtype=torch.float64) < zero_frac
    zero[..., 0] = False  # keep at least one token
    p = x.softmax(-1).masked_fill(zero, 0.0)
    return (p / p.sum(-1, keepdim=True)).float()


class Tables:
    """Target tables ``P0 [V]``, ``P1 [V,V]``, ``P2 [V,V,V]`` (the next-token distribution after the
    prefix ``()``, ``(t1)``, ``(t1,t2)``) and draft tables ``Q1 [V]``, ``Q2 [V,V]``."""

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.P0, self.P1, self.P2 = random_dists(g, ()), random_dists(g, (V,)), random_dists(g, (V, V))
        # The draft: a different, sometimes flatter, distribution with its own zeros.
        self.Q1, self.Q2 = random_dists(g, (), 1.0, 0.3), random_dists(g, (V,), 1.0, 0.3)

    def exact(self) -> np.ndarray:
        """``[V,V,V]`` the target's distribution of the first three tokens."""
        p0, p1, p2 = (t.double().numpy() for t in (self.P0, self.P1, self.P2))
        return p0[:, None, None] * p1[:, :, None] * p2

    def target_at(self, prefix: list[torch.Tensor]) -> torch.Tensor:
        """``[N,V]`` the target's distribution after a per-row prefix of 0, 1 or 2 tokens."""
        if len(prefix) == 0:
            return self.P0.expand(B, V)
        if len(prefix) == 1:
            return self.P1[prefix[0]]
        return self.P2[prefix[0], prefix[1]]


def sample(p: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    return torch.multinomial(p, 1, generator=g).squeeze(1)


def depth_prefixes(tokens: torch.Tensor, parents: torch.Tensor) -> list[list[torch.Tensor]]:
    """Per node: the draft tokens on its root path (root excluded), each ``[B]``."""
    out: list[list[torch.Tensor]] = []
    rows = torch.arange(tokens.shape[0])
    for i in range(tokens.shape[1]):
        par = parents[:, i]
        if i == 0:
            out.append([])
            continue
        # All rows share one tree shape, so the parent index is the same in every row.
        p = int(par[0])
        assert bool((par == p).all())
        out.append(out[p] + [tokens[rows, i]])
    return out


def emit_and_complete(tables: Tables, tokens, path, length, nxt, g) -> torch.Tensor:
    """The first three tokens per row: accepted drafts, the next token, then samples from the
    target tables for whatever one verification did not emit (as later steps would)."""
    rows = torch.arange(tokens.shape[0])
    out = torch.full((tokens.shape[0], 3), -1, dtype=torch.int64)
    length = length.long()
    for j in range(1, 3):  # accepted drafts: path[1], path[2]
        has = length > j
        out[:, j - 1] = torch.where(has, tokens[rows, path[:, j].clamp(min=0)], out[:, j - 1])
    out[rows, length - 1] = nxt  # after the length-1 accepted drafts (the trees here are 2 deep)
    for j in range(3):
        missing = out[:, j] < 0
        if bool(missing.any()):
            p = tables.target_at([out[:, k] for k in range(j)])
            out[:, j] = torch.where(missing, sample(p, g), out[:, j])
    assert bool((out >= 0).all())
    return out


def full_vocab(q: torch.Tensor) -> SparseProbs:
    """Proposals ``q [B,T,V]`` over the whole vocabulary as :class:`SparseProbs` (K = V)."""
    return SparseProbs(torch.arange(q.shape[-1]).expand(q.shape), q)


def run_tree(verify, tables: Tables, tokens, parents, draft_probs, valid, seed: int):
    """Verify with target probs from the tables at every node: (first 3 tokens ``[B,3]``, length ``[B]``)."""
    g = torch.Generator().manual_seed(seed)
    prefixes = depth_prefixes(tokens, parents)
    target_probs = torch.stack([tables.target_at(pre) for pre in prefixes], dim=1)
    uniforms = torch.rand(B, tokens.shape[1] + 1, generator=g)
    if isinstance(draft_probs, SparseProbs):
        path, length, nxt = verify(tokens, parents, target_probs, draft_probs.probs, uniforms, valid, draft_probs.ids)
    else:
        path, length, nxt = verify(tokens, parents, target_probs, draft_probs, uniforms, valid)
    return emit_and_complete(tables, tokens, path, length, nxt, g), length


def chain_case(seed: int):
    """Chains root -> x1 ~ Q1 -> x2 ~ Q2[x1]; a third of the rows stop after x1 (padding)."""
    t = Tables(seed)
    g = torch.Generator().manual_seed(seed + 1)
    x1 = sample(t.Q1.expand(B, V), g)
    x2 = sample(t.Q2[x1], g)
    short = torch.rand(B, generator=g) < 1 / 3
    drafts = torch.stack([x1, torch.where(short, -1, x2)], dim=1)
    q = torch.stack([t.Q1.expand(B, V), t.Q2[x1]], dim=1)
    tree = DraftTree.chain(torch.zeros(B, dtype=torch.int64), drafts, full_vocab(q))
    return t, tree.tokens, tree.parents, tree.draft_probs, tree.valid


def sparse_chain_case(seed: int, k: int = 3):
    """Chains as in :func:`chain_case`, each token drawn from the draft's top-``k`` renormalised, whose
    ``k`` probabilities travel as :class:`SparseProbs` through the tree (ids in the draft's order)."""
    t = Tables(seed)
    g = torch.Generator().manual_seed(seed + 1)
    q1 = SparseProbs.top_k(t.Q1.log().expand(B, 1, V), k)
    x1 = q1.sample(g)[:, 0]
    q2 = SparseProbs.top_k(t.Q2[x1].log()[:, None], k)
    x2 = q2.sample(g)[:, 0]
    short = torch.rand(B, generator=g) < 1 / 3
    drafts = torch.stack([x1, torch.where(short, -1, x2)], dim=1)
    tree = DraftTree.chain(torch.zeros(B, dtype=torch.int64), drafts, SparseProbs.cat([q1, q2]))
    return t, tree.tokens, tree.parents, tree.draft_probs, tree.valid


def distinct_tokens(weights: torch.Tensor, n: int, g: torch.Generator) -> torch.Tensor:
    """``[B,n]`` distinct tokens per row, drawn without replacement from ``weights [B,V]`` (a draft's
    top choices, in its order of preference: skewed, so a wrong verifier shows)."""
    return torch.multinomial(weights + 0.02, n, replacement=False, generator=g)


# root children a (node 1), b (node 3), c (node 5); a's children nodes 2, 6; b's child node 4.
# Interleaved indices: verification must follow parents, not index order alone.
TREE_PARENTS = [-1, 0, 1, 0, 3, 0, 1]


def deterministic_tree_case(seed: int, zero_probs: bool):
    """Deterministic drafts: distinct tokens among siblings (one-hot proposals)."""
    t = Tables(seed)
    g = torch.Generator().manual_seed(seed + 1)
    top = distinct_tokens(t.Q1.expand(B, V), 3, g)
    under_a = distinct_tokens(t.Q2[top[:, 0]], 2, g)
    under_b = distinct_tokens(t.Q2[top[:, 1]], 1, g)
    tokens = torch.stack([torch.zeros(B, dtype=torch.int64), top[:, 0], under_a[:, 0], top[:, 1], under_b[:, 0],
                          top[:, 2], under_a[:, 1]], dim=1)
    parents = torch.tensor(TREE_PARENTS).expand(B, -1).clone()
    draft_probs = torch.zeros(B, len(TREE_PARENTS), V) if zero_probs else None  # all-zero rows mean one-hot
    return t, tokens, parents, draft_probs, None


def iid_siblings_case(seed: int):
    """SpecInfer multi-draft: siblings drawn i.i.d. from one q (repeats allowed)."""
    t = Tables(seed)
    g = torch.Generator().manual_seed(seed + 1)
    top = torch.multinomial(t.Q1, 3 * B, replacement=True, generator=g).view(B, 3)
    under_a = torch.multinomial(t.Q2[top[:, 0]], 2, replacement=True, generator=g)
    under_b = sample(t.Q2[top[:, 1]], g)
    tokens = torch.stack([torch.zeros(B, dtype=torch.int64), top[:, 0], under_a[:, 0], top[:, 1], under_b,
                          top[:, 2], under_a[:, 1]], dim=1)
    parents = torch.tensor(TREE_PARENTS).expand(B, -1).clone()
    q1 = t.Q1.expand(B, V)
    draft_probs = torch.stack([torch.zeros(B, V), q1, t.Q2[top[:, 0]], q1, t.Q2[top[:, 1]], q1, t.Q2[top[:, 0]]], dim=1)
    return t, tokens, parents, draft_probs, None


CASES = {
    "chain": lambda s: chain_case(s),
    "sparse-chain": lambda s: sparse_chain_case(s),
    "deterministic-tree": lambda s: deterministic_tree_case(s, zero_probs=False),
    "deterministic-tree-zero-q": lambda s: deterministic_tree_case(s, zero_probs=True),
    "iid-siblings": lambda s: iid_siblings_case(s),
}


def case_pvalues(verify, case: str, seed: int = 0) -> tuple[dict[str, float], torch.Tensor]:
    tables, tokens, parents, draft_probs, valid = CASES[case](seed)
    first3, length = run_tree(verify, tables, tokens, parents, draft_probs, valid, seed + 2)
    return fit_pvalues(joint_counts(first3, V), tables.exact()), length


def planted(bug: str):
    """A recursive rejection sampler with one deliberate mistake (``bug``), same signature as the kernel;
    ``bug="none"`` is the correct rule (a control: the harness passes it)."""

    def verify(tokens, parents, target_probs, draft_probs, uniforms, valid=None, draft_ids=None):
        b, t = tokens.shape
        if draft_ids is not None:
            draft_probs = SparseProbs(draft_ids, draft_probs).dense(target_probs.shape[-1])
        rows = torch.arange(b)
        current = torch.zeros(b, dtype=torch.int64)
        p = target_probs[:, 0].clone()
        p_node = p.clone()  # the target's distribution at the current node, before any rejection
        path = torch.full((b, t), -1, dtype=torch.int64)
        path[:, 0] = 0
        length = torch.ones(b, dtype=torch.int64)
        for i in range(1, t):
            consider = parents[:, i] == current
            if valid is not None:
                consider &= valid[:, i]
            x = tokens[:, i]
            onehot = torch.nn.functional.one_hot(x, p.shape[-1]).float()
            q = onehot if draft_probs is None else torch.where(draft_probs[:, i].sum(-1, keepdim=True) > 0,
                                                                draft_probs[:, i], onehot)
            accept = consider & (uniforms[:, i] * q[rows, x] < p[rows, x])
            reject = consider & ~accept
            if bug == "none":  # norm(max(p - q, 0))
                residual = (p - q).clamp(min=0)
                residual = residual / residual.sum(-1, keepdim=True).clamp(min=1e-30)
            elif bug == "resample_from_p":  # on rejection keep sampling from p itself
                residual = p
            elif bug == "onehot_residual":  # subtract the drafted token only, as if it were deterministic
                residual = (p - onehot).clamp(min=0)
                residual = residual / residual.sum(-1, keepdim=True).clamp(min=1e-30)
            elif bug == "no_renorm":  # max(p - q, 0) without normalising
                residual = (p - q).clamp(min=0)
            elif bug == "forget_earlier_rejections":  # max(p_node - q, 0): right for the first sibling only
                residual = (p_node - q).clamp(min=0)
                residual = residual / residual.sum(-1, keepdim=True).clamp(min=1e-30)
            else:
                raise ValueError(bug)
            p = torch.where(reject[:, None], residual, p)
            p = torch.where(accept[:, None], target_probs[:, i], p)
            p_node = torch.where(accept[:, None], target_probs[:, i], p_node)
            path[rows[accept], length[accept]] = i
            length = length + accept.long()
            current = torch.where(accept, i, current)
        return path, length.to(torch.int32), kernels.sample_from_probs(p, uniforms[:, t])

    return verify


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_sampling_is_lossless(case):
    """The first three tokens follow the target exactly: joint, marginals and consecutive pairs."""
    pvals, length = case_pvalues(kernels.tree_verify_sampling, case)
    assert min(pvals.values()) > PASS, pvals
    # The walk both accepts and rejects, at both depths.
    counts = torch.bincount(length.long(), minlength=4)
    assert (counts[1:4] > 1000).all(), counts


@pytest.mark.parametrize("case", list(CASES))
def test_planted_harness_without_bug_passes(case):
    """Control for the planted bugs: the same sampler without its bug passes, so the bug is what fails."""
    pvals, _ = case_pvalues(planted("none"), case)
    assert min(pvals.values()) > PASS, pvals


@pytest.mark.parametrize("bug,case", [
    ("resample_from_p", "chain"),
    ("onehot_residual", "chain"),
    ("onehot_residual", "sparse-chain"),
    ("no_renorm", "iid-siblings"),
    ("forget_earlier_rejections", "deterministic-tree"),
])
def test_planted_bug_is_detected(bug, case):
    """The same test rejects a wrong verifier: these chi-square tests have power."""
    pvals, _ = case_pvalues(planted(bug), case)
    assert pvals["t1"] < POWER and pvals["joint"] < POWER, pvals


# ----------------------------------------------------------------------------------------
# End to end
# ----------------------------------------------------------------------------------------

E2E_VOCAB = 12
E2E_STD = 0.2  # processed distributions of mean entropy ~1.4 nats (max log 12 = 2.5)
E2E_NEW = 4  # max_new_tokens: the first token is a plain sample, drafting starts with the second
# Repeated n-grams the model tends to continue: prompt lookup drafts after the likely first tokens, and
# about 40% of its first drafts are accepted (chosen by a search over random repetitive prompts).
E2E_PROMPT = [2, 3, 4, 2, 3, 4, 4, 4, 2, 3]
E2E_ROWS = 6000
E2E_CHUNK = 500  # rows per generate_ids call, each call with its own seed (prefill costs O(rows^2))
E2E_CONFIGS = {
    "temp0.8": dict(temperature=0.8),
    "topk6-topp0.85": dict(temperature=1.1, top_k=6, top_p=0.85),
}
EOS = 1  # the tiny models' EOS id; the target gives it 3-5% at most steps


@torch.inference_mode()
def exact_continuations(model, prompt: list[int], n: int, cfg: SamplingConfig, eos: int | None = None) -> np.ndarray:
    """``[V]*n`` the target's processed distribution of the next ``n`` tokens, from one forward over the
    prompt followed by every ``(n-1)``-token continuation. With ``eos``, a sequence stops at its first
    ``eos`` and is counted padded with ``eos`` to length ``n`` (see :func:`padded`)."""
    v = E2E_VOCAB
    heads = torch.tensor(list(itertools.product(range(v), repeat=n - 1)), dtype=torch.int64).view(-1, n - 1)
    ids = torch.cat([torch.tensor(prompt).expand(heads.shape[0], -1), heads], dim=1)
    probs = processed_probs(model(ids).logits[:, len(prompt) - 1:], cfg).double().numpy()  # [v^(n-1), n, v]
    probs = probs.reshape([v] * (n - 1) + [n, v])
    is_eos = np.arange(v) == eos
    exact, ended = np.ones([]), np.zeros([], dtype=bool)
    for j in range(n):
        # P(t_{j+1} | t_1..t_j), read in any row whose head starts with t_1..t_j (here: head t_{j+1..n-1} = 0).
        cond = probs[(slice(None),) * j + (0,) * (n - 1 - j) + (j,)]  # [v]*(j+1)
        cond = np.where(ended[..., None], is_eos.astype(np.float64), cond)  # after EOS: padding, probability 1
        exact = exact[..., None] * cond
        ended = ended[..., None] | is_eos
    return exact


def padded(tokens: list[list[int]], n: int) -> torch.Tensor:
    """Outputs ``[N,n]``, a row cut short by EOS padded with EOS."""
    assert all(len(t) == n or (0 < len(t) < n and t[-1] == EOS) for t in tokens)
    return torch.tensor([t + [EOS] * (n - len(t)) for t in tokens])


@pytest.fixture(scope="module")
def e2e_decoder():
    target = tiny_model("llama", vocab=E2E_VOCAB, std=E2E_STD)
    dec = SpecDecoder(target, draft=perturbed(target, 0.6))
    # At E2E_CHUNK rows a wider step costs the tiny model real time, and the cost planners rightly draft less,
    # too little for these tests' power (and by how much depends on the machine's load). Their batch step cost
    # is pinned to nearly free verification, as on a GPU: every draft node is kept, through the batch planner.
    from specdec.policies import StepCost

    dec.step_cost().batches[E2E_CHUNK] = StepCost({1: 1.0, 16: 1.0 + 1e-3})
    return dec


def e2e_pvalues(dec: SpecDecoder, method: str, config: str, eos: bool, rows: int = E2E_ROWS, governor=None):
    dec.eos = {EOS} if eos else set()
    # pld on the static schedule: the cost schedule sizes drafts from timings, and on a busy CPU it drafts
    # too little for the "speculation happened" check (2,000 of the 3,000 drafts wanted, seen twice).
    method, own = methods.parse_label(method)  # "name" or a label "name:key=value"
    opts = {"sd": {"draft_length": 2}, "ngrammys": {"k": 3, "w": 2}, "hybrid": {"k": 3, "w": 2}, "pld": {"schedule": "static"},
            "gsd": {"k": 2, "max_depth": 2}, "ouroboros": {"gamma": 3}, "pearl": {"gamma": 2}}.get(method, {})
    # The governor off: on this tiny model a plain step is often the faster one, and the check above needs drafts
    # (steps of both kinds are tested in test_governed_sampling_is_lossless).
    if issubclass(methods.get(method).options, methods.GovernedOptions):
        opts.setdefault("govern", 0)
    opts = runnable(dec, {**opts, **own})
    out, drafted, accepted = [], 0, 0
    for chunk in range(rows // E2E_CHUNK):
        cfg = SamplingConfig(seed=1000 * chunk + 17, **E2E_CONFIGS[config])
        res = dec.generate_ids([E2E_PROMPT] * E2E_CHUNK, method, E2E_NEW, cfg, governor=governor, **opts)
        out += res.tokens
        drafted += res.stats.drafted_tokens
        accepted += res.stats.accepted_tokens
    if not eos:
        assert all(len(t) == E2E_NEW for t in out)
    exact = exact_continuations(dec.model, E2E_PROMPT, E2E_NEW, SamplingConfig(**E2E_CONFIGS[config]),
                                EOS if eos else None)
    return fit_pvalues(joint_counts(padded(out, E2E_NEW), E2E_VOCAB), exact), drafted, accepted, out


E2E_CASES = [
    *[(m, c, False) for m in ("ar", "pld", "sd") for c in E2E_CONFIGS],
    ("pld", "temp0.8", True),
    ("sd", "temp0.8", True),
    ("ngrammys", "topk6-topp0.85", False),
    ("ngrammys", "temp0.8", True),
]
# Every registered method is covered: one added to the registry gets a case without a test of its own.
E2E_CASES += [(m, "temp0.8", False) for m in methods.names() if m not in {c[0] for c in E2E_CASES}]
# So is every stop rule sd can draft with (the oracle is greedy only and refuses sampling; pld's and
# ngrammys' schedules only size drafts from timings, which the greedy identity test covers).
E2E_CASES += [(f"sd:schedule={o['schedule']}", "temp0.8", False) for o in schedule_variants("sd")
              if o["schedule"] not in ("static", "oracle")]
E2E_CASES += [("sd:schedule=disco:disco_mode=cost", "temp0.8", False), ("sd:confidence=0.3", "temp0.8", False)]
# GSD's two sibling variants; tau=0 merges often on this prompt, so copies (verified one-hot) are tried too.
# (tau=0 on the static schedule: the cost schedule sizes graphs from timings, and on a busy CPU it drafted too
# little for the "speculation happened" check once, 1,986 of the 3,000 drafts wanted; the plain gsd case above
# covers the cost schedule.)
E2E_CASES += [("gsd:siblings=sample", "temp0.8", False), ("gsd:siblings=sample:tau=0", "topk6-topp0.85", False),
              ("gsd:tau=0:schedule=static", "temp0.8", True)]
# Ouroboros: every part on (the draft's walk into pool phrases included), phrases after the last chain token
# only or after every one; and with EOS.
E2E_CASES += [("ouroboros:lookahead=1:attach=last", "topk6-topp0.85", False), ("ouroboros:lookahead=1", "temp0.8", True)]
# PEARL: the worker process (the registry case above), and inline each ablation, a fixed window, and EOS.
E2E_CASES += [("pearl:backend=inline:window=fixed:gamma=2", "topk6-topp0.85", False),
              ("pearl:backend=inline:pre_verify=0", "temp0.8", True),
              ("pearl:backend=inline:post_verify=0:window=fixed", "temp0.8", False)]


@pytest.mark.parametrize("method,config,eos", E2E_CASES)
def test_generate_sampling_is_lossless(e2e_decoder, method, config, eos):
    """The first four new tokens of ``generate_ids`` follow the target's processed distribution."""
    pvals, drafted, accepted, out = e2e_pvalues(e2e_decoder, method, config, eos)
    if method != "ar":  # speculation happened: drafts were proposed, many accepted, many rejected
        assert drafted > E2E_ROWS // 2 and 0.1 * drafted < accepted < 0.9 * drafted, (drafted, accepted)
    if eos:  # some rows stopped early, some of them inside a step
        assert sum(len(t) < E2E_NEW for t in out) > E2E_ROWS // 20
    assert min(pvals.values()) > PASS, pvals


@pytest.mark.parametrize("method", ["pld", "sd", "pearl:backend=inline"])
def test_governed_sampling_is_lossless(e2e_decoder, method):
    """Drafting and plain steps mixed in one generation (a governor's decisions) keep the target's distribution."""
    from tests.test_governor import Scripted

    pvals, drafted, accepted, _ = e2e_pvalues(e2e_decoder, method, "temp0.8", False, governor=Scripted("dp"))
    assert drafted > E2E_ROWS // 4 and accepted > 0
    assert min(pvals.values()) > PASS, pvals


def test_generate_planted_bug_is_detected(e2e_decoder, monkeypatch):
    """End to end power: a verifier that treats sampled drafts as deterministic (ignores ``q`` in the
    residual) fails the same test on sd."""
    monkeypatch.setattr(kernels, "tree_verify_sampling", planted("onehot_residual"))
    pvals, *_ = e2e_pvalues(e2e_decoder, "sd", "topk6-topp0.85", False, rows=3000)
    assert pvals["joint"] < POWER, pvals


@pytest.mark.parametrize("method,bug", [
    # pld's drafts are deterministic: a verifier that, on a rejection, keeps sampling from p (as if a rejected
    # deterministic draft told it nothing) over-emits the rejected token.
    ("pld", "resample_from_p"),
    # ngrammys verifies sibling drafts (k = 3 candidates a step): checking each sibling against the node's p
    # instead of the residual left by the siblings rejected before it over-emits the later siblings.
    ("ngrammys", "forget_earlier_rejections"),
    # sd with DISCO's stop rule drafts sampled tokens of varying count: a verifier treating them as deterministic
    # (ignoring q in the residual) fails there as it does for plain sd.
    ("sd:schedule=disco:disco_mode=cost", "onehot_residual"),
])
def test_retrieval_and_disco_planted_bugs_are_detected(e2e_decoder, monkeypatch, method, bug):
    """End to end power for the methods whose drafts are deterministic (pld, ngrammys) and for sd's DISCO
    schedule: a plausible verification bug on each one's path fails the same test its correct run passes."""
    monkeypatch.setattr(kernels, "tree_verify_sampling", planted(bug))
    pvals, drafted, accepted, _ = e2e_pvalues(e2e_decoder, method, "temp0.8", False, rows=3000)
    assert drafted > 1500 and accepted > 0, (drafted, accepted)  # the bug's path ran
    assert min(pvals.values()) < POWER, pvals


def test_pearl_planted_bug_is_detected(e2e_decoder, monkeypatch):
    """PEARL's pending drafts are verified a round after they were drawn: carrying the proposal of the wrong
    window position with them (an off-by-one) fails the test."""
    from specdec import pearl

    right = pearl._window_tail

    def off_by_one(win, r, start, depth):
        tokens, q = right(win, r, start, depth)
        if q is not None and start > 0:
            _, q = right(win, r, start - 1, depth - 1)
        return tokens, q

    monkeypatch.setattr(pearl, "_window_tail", off_by_one)
    pvals, *_ = e2e_pvalues(e2e_decoder, "pearl:backend=inline:window=fixed:gamma=2", "topk6-topp0.85", False,
                            rows=3000)
    assert pvals["joint"] < POWER, pvals


def test_gsd_planted_bug_is_detected(e2e_decoder, monkeypatch):
    """GSD's sampled siblings: verifying every draw against the undivided ``q`` (as if drawn with replacement)
    instead of ``q`` without the siblings drawn before it fails the same test."""
    from specdec.drafters import graph_draft

    monkeypatch.setattr(graph_draft, "sibling_proposals",
                        lambda probs, order: probs.unsqueeze(-2).expand(*order.shape, probs.shape[-1]))
    pvals, *_ = e2e_pvalues(e2e_decoder, "gsd:siblings=sample:k=3", "topk6-topp0.85", False)
    assert min(pvals.values()) < POWER, pvals  # the pass criterion reads the smallest p-value too



def test_ouroboros_walk_happens_and_a_planted_walk_bug_is_detected(e2e_decoder, monkeypatch):
    """The draft's walk into pool phrases happens on this prompt (so the cases above test it), and a walk that
    moves into a phrase without the draft's draw matching it (the phrase token then carries a ``q`` it was
    not drawn from) fails the test."""
    from specdec.drafters import ouroboros

    e2e_decoder.reset_learned()
    for seed in (3, 4):  # ungoverned: the walk needs drafting steps, which a governor's timings do not promise
        res = e2e_decoder.generate_ids([E2E_PROMPT] * 200, "ouroboros", E2E_NEW,
                                       SamplingConfig(temperature=0.8, seed=seed), gamma=3, lookahead=1, govern=0)
    assert res.stats.drafter["ouroboros"]["walk_tokens"] > 50, res.stats.drafter

    def forced_walk(trie, picks, room, start=0):
        node, tokens, nodes = start, [], []
        while True:
            heads = [c for (p, _), c in trie.child.items() if p == node]
            tok = trie.tokens[heads[0]] if heads else picks[node - start]
            tokens.append(tok)
            nodes.append(node)
            if len(tokens) >= room or not heads:
                return tokens, nodes
            node = heads[0]

    monkeypatch.setattr(ouroboros, "walk", forced_walk)
    e2e_decoder.reset_learned()
    pvals, *_ = e2e_pvalues(e2e_decoder, "ouroboros:lookahead=1", "temp0.8", False)
    assert min(pvals.values()) < POWER, pvals


# ----------------------------------------------------------------------------------------
# bonus=False (PEARL's post-verify), through Verifier.verify
# ----------------------------------------------------------------------------------------


def target_after(tables: Tables, seq: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """``[B,V]`` the target's distribution after each row's first ``n[b]`` tokens of ``seq [B,>=2]``
    (``n`` in 0..2; rows with ``n > 2`` get ``P0``, a stand-in for rows whose value is never used)."""
    t1, t2 = seq[:, 0].clamp(min=0), seq[:, 1].clamp(min=0)
    n = n[:, None]
    return torch.where(n == 0, tables.P0.expand(B, V),
                       torch.where(n == 1, tables.P1[t1], torch.where(n == 2, tables.P2[t1, t2], tables.P0.expand(B, V))))


def verify_no_bonus(verifier: Verifier, tree: DraftTree, logits: torch.Tensor):
    """(emitted tokens ``[B,T]`` -1 padded, their count ``[B]``) of one ``bonus=False`` verification."""
    res = verifier.verify(tree, logits, bonus=False)
    return res.emitted(tree), res.num_emitted


def accept_leaf_untested(verifier: Verifier, tree: DraftTree, logits: torch.Tensor):
    """A wrong ``bonus=False`` (a planted bug): node ``T-1`` has no logits row, so it is taken whenever
    its parent ends the path, without the ``min(1, p/q)`` test against the parent's distribution."""
    t = tree.size
    drafts = torch.where(tree.valid, tree.tokens, -1)[:, 1:-1]
    q = tree.draft_probs
    trunc = DraftTree.chain(tree.tokens[:, 0], drafts, SparseProbs(q.ids[:, 1:-1], q.probs[:, 1:-1]))
    res = verifier.verify(trunc, logits)  # the chain without its last node, with the bonus token
    out = torch.cat([res.emitted(trunc), torch.full_like(res.path[:, :1], -1)], dim=1)
    take = (res.path_len == t - 1) & tree.valid[:, t - 1]
    out[take, t - 2] = tree.tokens[take, t - 1]  # the leaf instead of the bonus token: same count
    return out, res.num_emitted


def run_no_bonus(verify, seed: int):
    """The first three tokens when every verification runs with ``bonus=False``.

    Call 1 verifies chains root -> x1 ~ Q1 -> x2 ~ Q2[x1] (a third stop after x1) with the target's
    logits at the root and x1 only. Call 2 is a fresh verification at the next position: a chain
    y1 ~ Q1 -> y2 ~ Q2[y1] rooted at the last emitted token (y2 only where two tokens are missing),
    logits again without the last node's. Whatever is still missing is sampled from the tables, as
    later steps would. Returns (counts ``[V]*3``, exact ``P0 x P1 x P2``, tokens from call 1 ``[B]``,
    whether call 1 accepted every draft of a row ``[B]``)."""
    tables = Tables(seed)
    g = torch.Generator().manual_seed(seed + 1)
    verifier = Verifier(SamplingConfig(temperature=1.0, seed=seed + 2), torch.device("cpu"))
    x1 = sample(tables.Q1.expand(B, V), g)
    x2 = sample(tables.Q2[x1], g)
    full = torch.rand(B, generator=g) >= 1 / 3
    drafts = torch.stack([x1, torch.where(full, x2, -1)], dim=1)
    tree = DraftTree.chain(torch.zeros(B, dtype=torch.int64), drafts, full_vocab(torch.stack([tables.Q1.expand(B, V), tables.Q2[x1]], 1)))
    # logits: log of the target's distributions (softmax at temperature 1 gives them back, zeros at -inf).
    out1, n1 = verify(verifier, tree, torch.stack([tables.P0.expand(B, V), tables.P1[x1]], dim=1).log())
    seq = torch.full((B, 3), -1, dtype=torch.int64)
    seq[:, :2] = out1[:, :2]
    n = n1.clone()
    assert bool((n >= 1).all()) and bool((n <= 2).all())
    all_accepted = (out1[:, 0] == x1) & ((out1[:, 1] == x2) | ~full) & (n1 == 1 + full.long())

    y1 = sample(tables.Q1.expand(B, V), g)
    y2 = sample(tables.Q2[y1], g)
    drafts2 = torch.stack([y1, torch.where(n == 1, y2, -1)], dim=1)
    root2 = seq.gather(1, (n - 1)[:, None]).squeeze(1)
    tree2 = DraftTree.chain(root2, drafts2, full_vocab(torch.stack([tables.Q1.expand(B, V), tables.Q2[y1]], dim=1)))
    after_y1 = torch.where((n == 1)[:, None], torch.stack([seq[:, 0], y1], dim=1), seq[:, :2])
    logits2 = torch.stack([target_after(tables, seq, n), target_after(tables, after_y1, n + 1)], dim=1).log()
    out2, n2 = verify(verifier, tree2, logits2)
    for j in range(2):  # call 2's tokens go after each row's first n
        put = (n < 3) & (n2 > j)
        seq[put, n[put]] = out2[put, j]
        n = n + put.long()
    for j in range(3):
        missing = n == j
        seq[:, j] = torch.where(missing, sample(target_after(tables, seq, n.clamp(max=2)), g), seq[:, j])
        n = n + missing.long()
    assert bool((seq >= 0).all())
    return joint_counts(seq, V), tables.exact(), n1, all_accepted & full, all_accepted & ~full


@pytest.mark.parametrize("seed", [0, 10])
def test_no_bonus_sampling_is_lossless(seed):
    """With ``bonus=False`` the emitted tokens, continued by a fresh verification at the next position,
    follow the target exactly (joint, marginals, consecutive pairs of the first three)."""
    counts, exact, n1, full_accepted, short_accepted = run_no_bonus(verify_no_bonus, seed)
    pvals = fit_pvalues(counts, exact)
    assert min(pvals.values()) > PASS, pvals
    # Every case happened often: both drafts accepted (no next token), a short chain's only draft
    # accepted (no next token), a rejection with its correction token (call 1 emitted 1 or 2 tokens).
    assert int(full_accepted.sum()) > 1000 and int(short_accepted.sum()) > 1000, (full_accepted.sum(), short_accepted.sum())
    assert int((~full_accepted & ~short_accepted).sum()) > 1000
    assert int((n1 == 1).sum()) > 1000 and int((n1 == 2).sum()) > 1000


def test_no_bonus_planted_bug_is_detected():
    """Power: taking the logit-less last draft untested fails the same test."""
    counts, exact, *_ = run_no_bonus(accept_leaf_untested, 0)
    pvals = fit_pvalues(counts, exact)
    assert pvals["joint"] < POWER and pvals["t2"] < POWER, pvals
