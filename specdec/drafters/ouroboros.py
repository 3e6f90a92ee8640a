"""Ouroboros: the draft model drafts phrase by phrase, and pool phrases lengthen the draft it hands the target.

A step, per row (all rows batched in every forward):

1. **Drafting phrase by phrase** (``lookahead``). The draft catches up on the committed tokens (one
   forward, which also gives the first draft token). Each further draft forward runs one tree on the draft:
   the chain's last token as root, the pool's phrases after it (a trie), and a lookahead
   :class:`~specdec.drafters.lookahead.JacobiWindow`. The draft then walks the trie: it picks its token at
   the root; if a phrase child carries that token it moves there and picks again from the child's
   logits, and so on; the first token with no such child ends the walk. One forward can thus add several
   chain tokens. The window's predictions fill the pool with n-grams. Without ``lookahead`` the chain
   is drafted one token per forward, as ``sd`` does.
2. **Lengthening** (``lengthen``). After the chain ``d_1 .. d_gamma``, the ``K`` newest pool phrases after
   ``d_gamma`` (or, with ``attach=all``, after every chain token) hang under it as alternative
   continuations; the target verifies chain and phrases as one tree.
3. **Phrases from verification** (``verification``). With the target's output at every node
   (``VerifyResult.target_argmax``, or the most likely token when sampling): for each rejected chain
   token, the run of target tokens after it that the chain went on to confirm; and for every phrase the
   target tried, the target's own continuation of it (which replaces the phrase).
4. **History** (``history``). The pool lives in the decoder across generations (bounded, FIFO with
   refresh per key); without it every generation starts with an empty pool. A pool file loads and saves
   it (``PhrasePool.save``/``load``).

Exactness. Greedy verification matches the target's argmax, so any tree is exact. Sampling: the chain is
drawn from the draft's distribution ``q`` and every chain token carries the ``q`` it was drawn from. The
walk in step 1 keeps that: the draft draws a token at every node of the tree independently; the walk uses
the draw at the root, and moves into a phrase node only when the draw there equals its token, so the next
draw comes from ``q`` after exactly the tokens drawn so far (a phrase only saves the forward that would
have computed that distribution). Where the walk stops and how long the chain is depend on positions,
never on a token's own value. Phrase tokens (step 2) are verified one-hot: recursive rejection sampling
accepts a deterministic candidate with the residual's probability and is exact whatever picks it, as long
as the choice does not read the verification's random numbers; phrases come from the pool and the chain,
and a chain node always precedes the phrase siblings beside it (node order is the order siblings are
tried). The planner (``schedule=cost``) would cut chain nodes by estimates read off their own drawn
values, so sampling runs with ``schedule=static``. ``tests/test_sampling.py`` checks this with chi-square
tests and catches a planted bug (the walk moving into a phrase without the draw matching it).
"""
from __future__ import annotations

import numpy as np
import torch

from specdec.drafters.base import Budget, DecodeState, Drafter
from specdec.drafters.draft_model import CATCH_UP_ALL_LOGITS, DraftModelDrafter
from specdec.drafters.lookahead import JacobiWindow, check_window, window_size
from specdec.drafters.phrase_pool import PhrasePool
from specdec.tree import DraftTree, SparseProbs
from specdec.verify import SamplingConfig

ATTACH = ("last", "all")
PHRASE_PRIOR = (0.3, 10.0)  # acceptance of a phrase token before any is observed: rate, weight in observations
# Where a pool phrase came from (the pool's source tag; a refresh keeps the highest): acceptance is learned per source.
WINDOW, VERIFICATION, CORRECTION, CONTEXT = 0, 1, 2, 3
SOURCES = ("window", "verification", "correction", "context")
SEEN_BINS = 3  # acceptance is learned per source, per times the phrase was inserted (1, 2, 3 or more) and position
ORDERS = ("recent", "frequent")


class PhraseRates:
    """How often the target accepts an appended phrase's token given it reached the token's parent, per phrase
    source (:data:`SOURCES`), times the phrase was inserted (``1 .. SEEN_BINS``) and position:
    ``counts [S, SEEN_BINS, P, 2]`` (tried, accepted), learned across generations."""

    def __init__(self, phrase_len: int, prior: tuple[float, float] = PHRASE_PRIOR):
        self.counts = np.zeros((len(SOURCES), SEEN_BINS, phrase_len, 2))
        self.prior = prior

    def estimate(self, source: int, seen: int, pos: int) -> float:
        tried, accepted = self.counts[source, seen, pos]
        p, weight = self.prior
        return float((accepted + p * weight) / (tried + weight))

    def observe(self, source: int, seen: int, pos: int, accepted: bool) -> None:
        cell = self.counts[source, seen, pos]
        cell[0] += 1
        cell[1] += accepted

    def summary(self) -> dict:
        """Per source: phrase tokens tried and accepted so far."""
        return self.summarize(self.counts)

    @staticmethod
    def summarize(counts: np.ndarray) -> dict:
        """Per source: the tried and accepted phrase tokens of ``counts [S, SEEN_BINS, P, 2]``."""
        return {name: {"tried": int(counts[i, ..., 0].sum()), "accepted": int(counts[i, ..., 1].sum())}
                for i, name in enumerate(SOURCES)}


class _Trie:
    """One row's tree on the host: tokens, parents, and children by (parent, token)."""

    def __init__(self, root: int):
        self.tokens, self.parents, self.kind = [root], [-1], [0]  # kind: 0 root/chain, 1 phrase, 2 window
        self.child: dict[tuple[int, int], int] = {}
        self.tried: dict[int, list[list[int]]] = {}  # chain node -> the phrases appended under it
        self.rank: list[tuple] = [()]  # phrase nodes: (source, times inserted bin, position in the phrase)

    def add(self, parent: int, token: int, kind: int, rank=(), merge: bool = True) -> int:
        if merge and (parent, token) in self.child:
            return self.child[(parent, token)]
        self.tokens.append(token)
        self.parents.append(parent)
        self.kind.append(kind)
        self.rank.append(rank)
        node = len(self.tokens) - 1
        if merge:
            self.child[(parent, token)] = node
        return node

    def __len__(self) -> int:
        return len(self.tokens)


def walk(trie: _Trie, picks: list[int], room: int, start: int = 0) -> tuple[list[int], list[int]]:
    """The draft's walk down one row's tree: ``picks[n - start]`` is its draw (or argmax) at node ``n``. From ``start``
    (the chain's last token), each node's draw is a chain token; the walk moves on into the phrase child
    carrying that token, if there is one and ``room`` allows more tokens. Returns the tokens added and the
    nodes whose draws they are (``start``, then the phrase nodes walked into, whose KV the draft keeps)."""
    node, tokens, nodes = start, [], []
    while True:
        tok = picks[node - start]
        tokens.append(tok)
        nodes.append(node)
        child = trie.child.get((node, tok))
        if len(tokens) >= room or child is None:
            return tokens, nodes
        node = child


def _as_tree(tries: list[_Trie], dev) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[B,T]`` tokens, parents and validity of the rows' tries, padded."""
    t = max(len(x) for x in tries)
    b = len(tries)
    tokens = torch.zeros(b, t, dtype=torch.int64)
    parents = torch.zeros(b, t, dtype=torch.int64)
    valid = torch.zeros(b, t, dtype=torch.bool)
    for r, x in enumerate(tries):
        n = len(x)
        tokens[r, :n] = torch.tensor(x.tokens)
        parents[r, :n] = torch.tensor(x.parents)
        valid[r, :n] = True
    return tokens.to(dev), parents.to(dev), valid.to(dev)


class OuroborosDrafter(Drafter):
    """Ouroboros over a plain draft model's chain drafter (``base``) and a :class:`PhrasePool`.

    gamma: chain tokens per step; k: phrases appended per attachment point; window, level: the lookahead
    window's ``W`` and ``N``; n_verify: pool phrases the draft checks per forward; lookahead, lengthen,
    verification, history: the four parts (module docstring); attach: ``last`` (the paper) or ``all``; order: which pool phrases a lookup returns first,
    ``recent`` (the paper) or ``frequent``;
    calibration: maps the draft's probability of a chain token to an acceptance estimate (greedy; None: no
    estimates, no planning); rates: the phrase acceptance learned so far (:class:`PhraseRates`);
    pool_file: where :meth:`finish` saves the pool; seed: the window's first guesses.
    """

    def __init__(self, base: DraftModelDrafter, sampling: SamplingConfig, pool: PhrasePool, gamma: int = 3, k: int = 3,
                 window: int = 4, level: int = 3, n_verify: int = 4, lookahead: bool = True, lengthen: bool = True,
                 verification: bool = True, history: bool = True, context: bool = False, attach: str = "last",
                 order: str = "recent", calibration=None,
                 rates: PhraseRates | None = None, pool_file: str | None = None, seed: int = 0):
        if base.needs_hidden:
            raise ValueError("ouroboros drafts with a plain draft model; a feature-conditioned draft (EAGLE) "
                             "needs the target's hidden state for every window node")
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {gamma}")
        if k < 0:
            raise ValueError(f"K must be >= 0, got {k}")
        if n_verify < 0:
            raise ValueError(f"n_verify must be >= 0, got {n_verify}")
        if attach not in ATTACH:
            raise ValueError(f"attach must be one of {ATTACH}, got {attach!r}")
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        check_window(window, level)
        if calibration is not None and not sampling.greedy:
            raise ValueError("ouroboros' cost planning reads each chain token's own draft probability, which "
                             "would bias sampled drafts: sample with schedule=static")
        self.base, self.sampling, self.pool = base, sampling, pool
        self.gamma, self.k, self.window, self.level, self.n_verify = gamma, k, window, level, n_verify
        self.lookahead, self.lengthen, self.verification, self.history = lookahead, lengthen, verification, history
        self.context = context
        self.attach, self.order, self.calibration, self.seed = attach, order, calibration, seed
        self.phrase_len = pool.phrase_len
        draft_tree = 1 + (n_verify * self.phrase_len + window_size(window, level) if lookahead else 0)
        # The first forward of a step also feeds the tokens accepted last step (at most gamma + P + 1).
        base.reserve(draft_tree + gamma + self.phrase_len)
        self.keeps_rows = base.keeps_rows  # per row: the base draft's cache and the lookahead windows
        self._windows: list[JacobiWindow | None] = []
        self._chains: list[list[int]] = []
        self._tops: list[list[float]] = []
        self._tries: list[_Trie | None] = []
        self._verdict = None
        self.rates = rates or PhraseRates(self.phrase_len)
        self._start = (self.pool.stats(), self.rates.counts.copy())
        self.pool_file = pool_file
        self._stats = self._fresh_stats()

    @staticmethod
    def _fresh_stats() -> dict:
        return {"steps": 0, "rows": 0, "draft_forwards": 0, "chain_tokens": 0, "walk_tokens": 0,
                "full_accepts": 0, "lookups": 0, "lookup_hits": 0, "phrase_nodes": 0, "phrase_tokens_accepted": 0,
                "from_window": 0, "from_verification": 0, "corrections": 0, "from_context": 0}

    # ---- Drafter interface ----------------------------------------------------------------------

    @property
    def per_node(self) -> bool:
        """Whether the step just proposed learns from the target's output at every node (part 3): not one that drafted
        for no row (a governed plain step), which the decode loop then verifies as `ar`'s step."""
        return any(t is not None for t in self._tries)

    @property
    def draft_nodes(self) -> int:
        return self.base.draft_nodes

    def max_tree_size(self, depth: int) -> int:
        points = (self.gamma + 1 if self.attach == "all" else 1) if self.lengthen else 0
        return 1 + self.gamma + points * self.k * self.phrase_len

    def begin(self, state: DecodeState) -> None:
        super().begin(state)
        self.base.begin(state)
        if not self.history:
            self.pool.clear()
        self._stats = self._fresh_stats()
        self._start = (self.pool.stats(), self.rates.counts.copy())  # summary() reports this generation's share
        rows = state.seq.tolist()
        b = len(rows)
        if self.context:
            for r in range(b):
                self._feed_context(rows[r], 0, state.seq_lens_host[r])
        self._windows = [None] * b
        if self.lookahead:
            rng = np.random.default_rng(self.seed)
            self._windows = [JacobiWindow(self.window, self.level, rows[r][: state.seq_lens_host[r]], rng)
                             for r in range(b)]

    def keep_rows(self, rows: list[int]) -> None:
        self.base.keep_rows(rows)
        self._windows = [self._windows[r] for r in rows]
        self._tries, self._chains, self._tops = [], [], []  # the last step's, already learned from in update()

    def propose(self, state: DecodeState, budget: Budget) -> DraftTree:
        with self.base.forward_mode():
            tree = self._propose(state, budget)
        self.draft_calls = self.base.draft_calls
        return tree

    def observe_verdict(self, tree: DraftTree, verdict) -> None:
        """The verification result of ``tree`` (with per-node target outputs), read in :meth:`update`."""
        self._verdict = (tree, verdict)

    def finish(self) -> None:
        if self.pool_file is not None:
            self.pool.save(self.pool_file)

    def summary(self) -> dict:
        """Counter groups (summed over prompts by the bench): ``ouroboros`` (steps, rows, draft forwards, chain
        tokens drafted and those the walk added beyond one per forward, rows whose whole chain was accepted,
        pool lookups for lengthening and those that found a phrase, phrase nodes verified and accepted, pool
        inserts from the window, from verification, corrections and from the context), ``pool`` (its counters:
        inserts, refreshes, lookups and hits of any kind, and phrases it gained) and ``phrase_rates`` (appended
        phrase tokens tried and accepted per source), all for this generation."""
        pool, counts = self._start
        now = self.pool.stats()
        gained = {k: now[k] - pool[k] for k in now}
        return {"ouroboros": dict(self._stats), "pool": gained,
                "phrase_rates": PhraseRates.summarize(self.rates.counts - counts)}

    # ---- drafting -----------------------------------------------------------------------------------

    def _pick_all(self, logits: torch.Tensor):
        """The draft's pick at every node of ``logits [B,T,V]``: tokens ``[B,T]`` (target ids) and, when
        sampling, the proposals ``[B,T,K]``; plus the draft's probability of each greedy pick (for estimates)."""
        b, t, v = logits.shape
        tok, q = self.base.pick(logits.reshape(b * t, v))
        top = None
        if self.calibration is not None:
            top = logits.reshape(b * t, v).float().softmax(-1).amax(-1).view(b, t)
        if q is not None:
            q = SparseProbs(q.ids.view(b, t, -1), q.probs.view(b, t, -1))
        return tok.view(b, t), q, top

    def _propose(self, state: DecodeState, budget: Budget) -> DraftTree:
        b = state.seq.shape[0]
        dev = state.seq.device
        self._tries, self._verdict, self._chains = [None] * b, None, [[] for _ in range(b)]
        roots = state.roots.tolist()
        limits = [min(d, self.gamma) for d in budget.max_depth]
        # A forward's tree reaches past the chain by a pool phrase or the lookahead window.
        reach = budget.depth + max(self.pool.phrase_len, self.window + self.level)
        if max(limits) < 1 or not self.base.fits(state, reach):
            return DraftTree.chain(state.roots)
        chains: list[list[int]] = [[] for _ in range(b)]
        probs: list[list] = [[] for _ in range(b)]
        tops: list[list[float]] = [[] for _ in range(b)]
        # The first forward feeds the committed tokens the draft has not seen (the root last) and its tree hangs
        # off the root; later ones feed the chain's last token. A long prompt is read before, by the draft's prefill.
        self.base.read_prompt(state)
        seen, ends = self.base.seen, state.seq_lens_host
        lo = min(seen)
        window = state.seq[:, lo: max(ends)].tolist()  # one transfer
        prefixes = [window[r][seen[r] - lo: ends[r] - lo] for r in range(b)]
        self._draft_forward(prefixes, chains, probs, tops, limits, dev)
        while any(len(chains[r]) < limits[r] for r in range(b)):
            prefixes = [[chains[r][-1]] if len(chains[r]) < limits[r] else [] for r in range(b)]
            self._draft_forward(prefixes, chains, probs, tops, limits, dev)
        self._chains, self._tops = chains, tops
        return self._target_tree(roots, chains, probs, tops, budget.max_depth, dev)

    def _draft_forward(self, prefixes, chains, probs, tops, limits, dev) -> None:
        """One draft forward: per row, the uncached tokens ``prefixes[r]`` (a chain), and hanging off the last
        of them the pool's phrases after it and the lookahead window. The prefix's KV is kept; a row still
        drafting then walks its tree (:func:`walk`), adding one or more chain tokens."""
        b = len(chains)
        active = [bool(prefixes[r]) and len(chains[r]) < limits[r] for r in range(b)]
        tries, window_at, anchors = [], [], []
        for r in range(b):
            prefix = prefixes[r] or [0]
            trie = _Trie(prefix[0])
            for t in prefix[1:]:
                trie.add(len(trie) - 1, t, 0, merge=False)
            anchor = len(trie) - 1
            anchors.append(anchor)
            window_at.append(-1)
            if active[r] and self.lookahead:
                for phrase, source, seen in self.pool.lookup_tagged(prefix[-1], self.n_verify, self.order):
                    node = anchor
                    for pos, t in enumerate(phrase):
                        node = trie.add(node, t, 1, (source, min(seen, SEEN_BINS) - 1, pos))
                w = self._windows[r]
                toks, pars = w.layout(len(trie), anchor)
                for t, p in zip(toks, pars):
                    trie.add(p, t, 2, merge=False)
                window_at[r] = len(trie) - w.width  # the last level's first node
            tries.append(trie)
        tokens, parents, valid = _as_tree(tries, dev)
        if all(k == 0 for trie in tries for k in trie.kind):  # prefixes only: chains
            tree = DraftTree.chain(tokens[:, 0], tokens[:, 1:].masked_fill(~valid[:, 1:], -1))
        else:
            tree = DraftTree.from_parents(tokens, parents, valid, check=False)
        # Picks only where the walk may read them: each row's anchor and the phrase nodes after it (not the
        # prefix, which may be a whole prompt, nor the window, whose argmax _window_update reads).
        ends = [window_at[r] if window_at[r] >= 0 else len(tries[r]) for r in range(b)]
        width = max(e - a for e, a in zip(ends, anchors))
        t = tokens.shape[1]
        at = (torch.tensor(anchors, device=dev)[:, None] + torch.arange(width, device=dev)).clamp(max=t - 1)
        col_of = None  # a wide forward (a prompt's catch-up) computes only the columns read: [B, T, V] would not fit
        if t > CATCH_UP_ALL_LOGITS:
            read = {c for a in anchors for c in range(a, min(a + width, t))}
            read |= {c for r in range(b) if window_at[r] >= 0 for c in range(window_at[r], window_at[r] + self.window)}
            cols = sorted(read)
            col_of = torch.zeros(t, dtype=torch.int64, device=dev)
            col_of[torch.tensor(cols, device=dev)] = torch.arange(len(cols), device=dev)
            at = col_of[at]
        logits, _ = self.base.forward_tree(tree, logits_at=None if col_of is None else cols)
        self._stats["draft_forwards"] += 1
        tok, q, top = self._pick_all(logits.gather(1, at[..., None].expand(-1, -1, logits.shape[2])))
        picks = tok.tolist()
        tops_host = top.tolist() if top is not None else None
        paths = []
        for r in range(b):
            path = list(range(len(prefixes[r])))
            if active[r]:
                a = anchors[r]
                added, walked = walk(tries[r], picks[r], limits[r] - len(chains[r]), start=a)
                chains[r] += added
                for node in walked:
                    if q is not None:
                        probs[r].append((q.ids[r, node - a], q.probs[r, node - a]))
                    if tops_host is not None:
                        tops[r].append(tops_host[r][node - a])
                self._stats["walk_tokens"] += len(walked) - 1
                path += walked[1:]
            paths.append(path)
        if self.lookahead:  # the window's predictions: the draft's argmax at its last level
            self._window_update(tries, window_at, logits, [prefixes[r][-1] if active[r] else 0 for r in range(b)],
                                col_of)
        counts = [len(p) for p in paths]
        path_t = torch.full((b, max(counts)), -1, dtype=torch.int64)
        for r, p in enumerate(paths):
            path_t[r, : len(p)] = torch.tensor(p, dtype=torch.int64)
        self.base.commit(path_t.to(dev), torch.tensor(counts, device=dev), counts)

    def _window_update(self, tries, window_at, logits: torch.Tensor, keys: list[int],
                       col_of: torch.Tensor | None = None) -> None:
        rows = [r for r in range(len(tries)) if window_at[r] >= 0]
        if not rows:
            return
        w = self.window
        idx = torch.tensor([[window_at[r] + j for j in range(w)] for r in rows], device=logits.device)
        if col_of is not None:  # logits of the columns read only
            idx = col_of[idx]
        last = logits[torch.tensor(rows, device=logits.device)[:, None], idx]  # [R, W, V]
        new = last.argmax(-1)
        if self.base.vocab_map is not None:
            new = self.base.vocab_map[new]
        for r, n in zip(rows, new.tolist()):
            for key, phrase in self._windows[r].update(keys[r], n):
                self.pool.insert(key, phrase, WINDOW)
                self._stats["from_window"] += 1

    def _target_tree(self, roots, chains, probs, tops, max_depth, dev) -> DraftTree:
        """The chain plus the pool's phrases as one tree per row, with acceptance estimates when planning."""
        b = len(chains)
        tries = []
        for r in range(b):
            trie = _Trie(roots[r])
            node = 0
            chain_nodes = [0]
            for t in chains[r]:
                node = trie.add(node, t, 0)
                chain_nodes.append(node)
            if self.lengthen and self.k > 0 and chains[r]:
                points = range(len(chains[r]) + 1) if self.attach == "all" else [len(chains[r])]
                for i in points:
                    key = chains[r][i - 1] if i > 0 else roots[r]
                    tagged = self.pool.lookup_tagged(key, self.k, self.order)
                    room = max_depth[r] - i
                    trie.tried[chain_nodes[i]] = [p for p, _, _ in tagged]
                    self._stats["lookups"] += 1
                    self._stats["lookup_hits"] += bool(tagged)
                    for phrase, source, seen in tagged:
                        node = chain_nodes[i]
                        for pos, t in enumerate(phrase[:room]):
                            before = len(trie)
                            node = trie.add(node, t, 1, (source, min(seen, SEEN_BINS) - 1, pos))
                            self._stats["phrase_nodes"] += len(trie) > before
            tries.append(trie)
        self._tries = tries
        self._stats["steps"] += 1
        self._stats["rows"] += sum(1 for c in chains if c)
        self._stats["chain_tokens"] += sum(len(c) for c in chains)
        if all(len(x) == len(c) + 1 for x, c in zip(tries, chains)):  # no phrase anywhere: a chain
            width = max(len(c) for c in chains)
            drafts = torch.full((b, width), -1, dtype=torch.int64)
            for r, c in enumerate(chains):
                drafts[r, : len(c)] = torch.tensor(c, dtype=torch.int64)
            tree = DraftTree.chain(torch.tensor(roots, device=dev), drafts.to(dev), self._chain_probs(probs, width, dev))
        else:
            tokens, parents, valid = _as_tree(tries, dev)
            q = None
            if not self.sampling.greedy:
                chain_q = self._chain_probs(probs, max(len(c) for c in chains), dev)  # [B, gamma, K]
                t = tokens.shape[1]
                ids = torch.full((b, t, chain_q.k), -1, dtype=torch.int64, device=dev)
                ps = torch.zeros(b, t, chain_q.k, device=dev)
                for r, c in enumerate(chains):  # trie nodes 1..len(c) are the chain, in order
                    ids[r, 1: len(c) + 1] = chain_q.ids[r, : len(c)]
                    ps[r, 1: len(c) + 1] = chain_q.probs[r, : len(c)]
                q = SparseProbs(ids, ps)
            tree = DraftTree.from_parents(tokens, parents, valid, q, check=False)
        if self.calibration is not None:
            tree.accept = self._estimates(tries, tops, tree.size).to(dev)
        return tree

    def _chain_probs(self, probs, width: int, dev) -> SparseProbs | None:
        """The chain tokens' proposals ``[B, width, K]`` (None when greedy)."""
        if self.base.sampling.greedy:
            return None
        k = max(i.shape[0] for row in probs for i, _ in row)
        ids = torch.full((len(probs), width, k), -1, dtype=torch.int64, device=dev)
        ps = torch.zeros(len(probs), width, k, device=dev)
        for r, row in enumerate(probs):
            for j, (i, p) in enumerate(row[:width]):
                ids[r, j, : i.shape[0]] = i
                ps[r, j, : p.shape[0]] = p
        return SparseProbs(ids, ps)

    def _estimates(self, tries, tops, t: int) -> torch.Tensor:
        """``[B,T]`` the estimated probability that the target reaches each node: chain tokens by their
        calibrated draft probability, phrase tokens by the measured rate at their rank and position."""
        out = torch.zeros(len(tries), t)
        for r, trie in enumerate(tries):
            chain_est = self.calibration.estimate(tops[r]) if tops[r] else []
            reach = [1.0] * len(trie)
            for n in range(1, len(trie)):
                if trie.kind[n] == 0:
                    e = chain_est[n - 1]
                else:
                    e = self.rates.estimate(*trie.rank[n])
                reach[n] = reach[trie.parents[n]] * e
            out[r, : len(trie)] = torch.tensor(reach)
        return out

    # ---- learning -----------------------------------------------------------------------------------

    def _feed_context(self, text: list[int], start: int, end: int) -> None:
        """Insert the phrases of ``text[:end]`` that end at or after position ``start``: each token keys the
        ``P`` tokens after it."""
        p = self.phrase_len
        for i in range(max(0, start - p), end - p):
            self.pool.insert(text[i], text[i + 1: i + 1 + p], CONTEXT)
            self._stats["from_context"] += 1

    def update(self, state: DecodeState, tree: DraftTree, path: torch.Tensor, path_len: list[int],
               drafted: list[int]) -> None:
        # The draft's cache holds the drafted chain; keep only what the committed text agrees with (the target
        # may have taken a phrase branch instead of the chain, so the accepted length alone does not say).
        keep = self.base.valid_prefix(state)
        ends = state.seq_lens_host
        rows = [r for r, n in enumerate(path_len) if n > 0]
        if rows:
            lo = max(0, min(ends[r] - path_len[r] for r in rows) - self.phrase_len)
            text = state.seq[:, lo: max(ends[r] for r in rows)].tolist()  # one transfer
            for r in rows:
                start = ends[r] - path_len[r]  # the first new token's position
                new, chain = text[r][start - lo: ends[r] - lo], self._chains[r]
                same = 0
                while same < min(len(new), len(chain)) and new[same] == chain[same]:
                    same += 1
                keep[r] = min(keep[r], start + same)
                if self.context:
                    self._feed_context(text[r], start - lo, ends[r] - lo)
        self.base.rollback(keep)
        if self._verdict is None or not any(t is not None for t in self._tries):
            return
        verified, verdict = self._verdict
        self._verdict = None
        out = verdict.target_argmax if verdict.target_argmax is not None else verdict.target_topk_ids[..., 0]
        host = torch.cat([verified.tokens, verified.parents, out, verified.valid.long(), path], dim=1).tolist()
        t = verified.size
        for r, n in enumerate(path_len):
            if n == 0 or self._tries[r] is None or not self._chains[r]:
                continue
            row = host[r]
            valid = row[3 * t: 4 * t]
            count = sum(valid)
            self._learn(r, row[:count], row[t: t + count], row[2 * t: 2 * t + count], row[4 * t: 4 * t + n])

    def _learn(self, r: int, toks: list[int], pars: list[int], target: list[int], accepted: list[int]) -> None:
        """Row ``r``'s lessons from its verified tree: ``toks``, ``pars`` and the target's output ``target``
        at its valid nodes, and the accepted nodes ``accepted`` (root first). The verified tree may be a
        pruned copy of the drafted one; nodes are matched to the drafted trie by their token paths."""
        trie = self._tries[r]
        mine = [0] * len(toks)  # drafted trie node of each verified node
        children: dict[tuple[int, int], int] = {}
        for n in range(1, len(toks)):
            mine[n] = trie.child[(mine[pars[n]], toks[n])]
            children[(pars[n], toks[n])] = n
        on_path = set(accepted)
        chain = self._chains[r]
        nodes = [0]  # the verified chain (the planner may have cut it)
        for tok in chain:
            nxt = children.get((nodes[-1], tok))
            if nxt is None or trie.kind[mine[nxt]] != 0:
                break
            nodes.append(nxt)
        a = sum(1 for n in nodes[1:] if n in on_path)  # chain tokens accepted
        self._stats["full_accepts"] += a == len(chain)
        if self.calibration is not None and len(nodes) > 1:  # chain tokens whose parent the target reached
            tried = min(a + 1, len(nodes) - 1)
            self.calibration.observe(self._tops[r][:tried], [i < a for i in range(tried)])
        for n in range(1, len(toks)):  # phrase tokens whose parent the target reached
            if trie.kind[mine[n]] == 1 and pars[n] in on_path:
                self.rates.observe(*trie.rank[mine[n]], n in on_path)
                self._stats["phrase_tokens_accepted"] += n in on_path
        if not self.verification:
            return
        # Each rejected chain token keys the target's tokens after it, as far as the chain went on to confirm them.
        for i in range(a + 1, len(nodes)):
            phrase, j = [target[nodes[i]]], i
            while len(phrase) < self.phrase_len and j + 1 < len(nodes) and chain[j] == phrase[-1]:
                j += 1
                phrase.append(target[nodes[j]])
            if len(phrase) >= 2:
                self.pool.insert(chain[i - 1], phrase, VERIFICATION)
                self._stats["from_verification"] += 1
        # Each phrase tried under a reached chain node is replaced by the target's own continuation there.
        for node, tried in trie.tried.items():
            at = next((n for n in nodes if mine[n] == node), None)
            if at is None or at not in on_path:
                continue
            for phrase in tried:
                cont, n = [target[at]], at
                for tok in phrase:
                    if tok != cont[-1] or len(cont) >= self.phrase_len:
                        break
                    n = children.get((n, tok))
                    if n is None:
                        break
                    cont.append(target[n])
                if len(cont) >= 2 and cont != phrase:
                    self.pool.replace(toks[at], phrase, cont, CORRECTION)
                    self._stats["corrections"] += 1
