"""PEARL: the draft drafts while the target verifies (pre-verify, post-verify), with an adaptive window.

Every round, for every row, two things run at once (:mod:`specdec.draft_worker`):

- the **target** runs over the row's root (its last committed token) and its *pending* drafts (drafted
  earlier, not verified yet);
- the **draft** drafts a window of ``gamma`` tokens that continues those pending drafts, as if they will be
  accepted.

The round then verifies the chain ``[root, pending..., window[0]]``: the target's logits at the last pending
token check the window's first token, and no bonus token is drawn (``Verifier.verify(bonus=False)``).

- **Pre-verify** (no pending drafts): the target runs over the root alone while the draft drafts the window,
  and its logits check ``window[0]``. Rejected: its correction is emitted and the window is dropped, one round
  (``max(gamma draft forwards, one target forward)``) spent instead of a verification; accepted: ``window[1:]``
  becomes the pending drafts.
- **Post-verify** (pending drafts): while the target verifies them, the draft drafts the next window. All
  accepted, ``window[0]`` included: ``window[0]`` is the next root and ``window[1:]`` the next pending drafts,
  drafted while this round verified. A rejection: the correction is emitted and the pending drafts and window
  are dropped.

The two ablations of the paper: without pre-verify, a row without pending drafts only drafts that round (the
target skips it); without post-verify, a row with pending drafts verifies them alone, the draft idle, and the
target's last logits draw a bonus token.

**Window length.** ``gamma`` fixed, or adaptive: the paper's analysis sets it to the target/draft speed ratio
``c``, with a verification whose cost does not grow with its length. Here it does (``StepCost``), and the draft
is right less often, so every round picks the ``gamma`` with the most expected tokens per second of a
two-state model (rows alternate between pre- and post-verify rounds) fed with what was measured: the target's
cost per chain length on one thread, the draft's seconds per forward while the target runs beside it, and
the per-token acceptance rate. With a flat verification cost and acceptance near 1 its choice is ``c``.

**Lossless.** Each round is one :meth:`specdec.verify.Verifier.verify` of a chain whose draft tokens carry the
proposals they were drawn from, each conditioned on exactly the tokens before it in that chain (the window
continues the pending drafts it is verified after). Greedy output is therefore the target's argmax chain.
Sampling is exact by the rejection-sampling argument of ``Verifier.verify``, including the deferred bonus of
``bonus=False``: after an all-accepted chain the next draw is made at the next round against the same target
distribution, with fresh randomness. A row whose chain is cut to its remaining token budget, or that verifies
without the draft (no post-verify), draws its bonus as usual (a per-row ``bonus``). A plain round with nothing
pending verifies each row's root alone: the next token is drawn as `ar` draws it (``Verifier.first_token``).

**Fallback.** The second core may be worth more to the target than a concurrent draft is (on two cores, 0.74x
`ar` in issue 50). A :class:`~specdec.policies.DraftGovernor` times whole rounds against plain rounds: the draft
idle, the target on every core (:class:`Cores`) verifying what is pending and drawing the next token, as `ar`.
While plain rounds emit more tokens per second, rounds are plain, and the governor probes again later.
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from specdec.decoding import DecodeResult, DecodeStats, leave_batch, one_token_path, start_generation, timed
from specdec.draft_worker import ConcurrentDraft
from specdec.model import ModelRunner
from specdec.policies import DraftGovernor
from specdec.policies.planner import best_window
from specdec.tree import DraftTree, SparseProbs
from specdec.verify import SamplingConfig


@dataclass
class WindowLength:
    """The draft window ``gamma`` per round: fixed, or adaptive from measured costs and acceptance.

    gamma: the fixed length, and the adaptive rule's first choice; max_gamma: the adaptive rule's upper bound;
    cost: the target's measured seconds per chain length (``StepCost``, on the thread count it runs at);
    draft_seconds: a first estimate of one draft forward, refined by what each window took.
    """

    gamma: int
    adaptive: bool = False
    max_gamma: int = 8
    cost: object = None
    draft_seconds: float | None = None
    accepted: float = 1.0  # prior: one accepted of two tested
    tested: float = 2.0
    history: list = field(default_factory=list)

    def __post_init__(self):
        if self.gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {self.gamma}")
        if self.adaptive and (self.cost is None or self.draft_seconds is None):
            raise ValueError("an adaptive window needs the target's step cost and the draft's step time")

    @property
    def largest(self) -> int:
        return self.max_gamma if self.adaptive else self.gamma

    def choose(self) -> int:
        """This round's ``gamma``."""
        if not self.adaptive:
            return self.gamma
        g = best_window(self.accepted / self.tested, self.draft_seconds, self.cost.costs(self.max_gamma))
        self.history.append(g)
        return g

    def observe(self, tested: int, accepted: int, window_seconds: float | None, forwards: int,
                target_seconds: float | None, target_nodes: int) -> None:
        """One round: draft tokens tested (accepted, or the first rejected) and accepted over all rows, the
        draft window's seconds and forwards,
        and the target forward's seconds over ``target_nodes`` chain tokens (None if it did not run; the step
        cost is a one-row table, so batched rounds pass None)."""
        decay = 0.98  # acceptance drifts with the text: weigh the last ~50 rounds
        self.tested = decay * self.tested + tested
        self.accepted = decay * self.accepted + accepted
        if window_seconds is not None and forwards and self.draft_seconds is not None:
            self.draft_seconds += 0.2 * (window_seconds / forwards - self.draft_seconds)
        if target_seconds is not None and self.cost is not None:
            self.cost.observe(target_nodes, target_seconds)


@dataclass
class _Rounds:
    """Round counters of one generation (the drafter summary)."""

    pre_accept: int = 0
    pre_reject: int = 0
    post_all: int = 0
    post_reject: int = 0
    bonus: int = 0
    draft_only: int = 0
    target_s: float = 0.0
    window_s: float = 0.0
    wait_s: float = 0.0
    gamma_sum: int = 0
    rounds: int = 0

    def summary(self) -> dict:
        out = {k: getattr(self, k) for k in ("pre_accept", "pre_reject", "post_all", "post_reject", "bonus",
                                              "draft_only", "rounds", "gamma_sum")}
        out.update(target_s=round(self.target_s, 6), window_s=round(self.window_s, 6), wait_s=round(self.wait_s, 6))
        return {"pearl": out}


@torch.inference_mode()
def pearl_generate(
    target: ModelRunner,
    draft: ConcurrentDraft,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    eos_token_ids: set[int] | None = None,
    window: WindowLength | None = None,
    pre_verify: bool = True,
    post_verify: bool = True,
    proposal_topk: int = 64,
    governor: DraftGovernor | None = None,
    cores: "Cores | None" = None,
) -> DecodeResult:
    """PEARL decoding of ``prompts`` (token id lists, ragged) with ``draft`` drafting beside ``target``.

    ``window``: the draft window per round (default a fixed 4); ``pre_verify``/``post_verify``: the paper's
    two strategies (either off is its ablation); ``proposal_topk``: when sampling, the draft draws from its
    ``k`` most likely tokens (renormalised) and verification reads those ``k`` probabilities.

    Returns the new tokens per row (stopping after an EOS or at ``max_new_tokens``) and stats;
    ``stats.drafter["pearl"]`` counts rounds by kind and sums the target's forward seconds, the draft's window
    seconds and the seconds the target waited for the draft.

    ``governor``: decides per round whether the draft drafts (see the module's "Fallback"); a plain round runs the
    target on ``cores.alone()`` (default: the threads it has), a drafting one on ``cores.shared()``; the prefill,
    before the draft has anything to do, runs on ``cores.alone()``.
    """
    window = window or WindowLength(4)
    gmax = window.largest
    stats, t0 = DecodeStats(), time.perf_counter()
    state, out, verifier = start_generation(target, prompts, max_new_tokens, sampling, eos_token_ids, gmax + 1)
    if cores is not None:  # the draft has nothing to do before the first round: the prefill takes every core
        cores.alone()
    with timed(stats, "prefill_s", "target_s"):
        logits, _ = target.prefill(state.padded(), state.seq_lens)
    stats.target_calls += 1
    first = verifier.first_token(logits)
    state.append(first)
    out.add_each(first.tolist())
    b, dev = len(prompts), state.seq.device
    live = list(range(b))  # batch row -> prompt: finished rows leave the batch after their round
    draft.begin(b, state.seq.shape[1] + gmax, gmax, sampling, proposal_topk)
    if governor is not None:
        governor.begin()
    pending: list[list[int]] = [[] for _ in range(b)]
    pending_q: list[SparseProbs | None] = [None] * b  # [1, m, k] proposals of the pending drafts (sampling)
    fed = [0] * b  # draft cache positions that hold the row's tokens
    first_window = True
    rounds = _Rounds()
    while not all(out.done):
        round_start = time.perf_counter()
        # a round that verifies a concurrent window's drafts harvests that round's work: timed as drafting where
        # the governor probes in blocks (alternating probes would then time no plain round)
        harvests = governor is not None and governor.blocks and any(pending)
        concurrent = governor is None or governor.drafts(len(live))
        if cores is not None:
            cores.shared() if concurrent else cores.alone()
        gamma = window.choose()
        lens = state.seq_lens_host
        depth, verify_row, use_window, run = [0] * b, [False] * b, [False] * b, [[] for _ in range(b)]
        for r in range(b):
            if out.done[live[r]]:  # a row that finished at the prompt's token, before any round
                pending[r] = []
                continue
            left = out.max_new - len(out.tokens[live[r]])  # tokens the row may still emit (>= 1)
            m = len(pending[r])
            if m > left - 1:  # the chain would emit too much: verify what fits and draw the bonus
                pending[r], m = pending[r][: left - 1], left - 1
                if pending_q[r] is not None:
                    pending_q[r] = SparseProbs(pending_q[r].ids[:, :m], pending_q[r].probs[:, :m])
                verify_row[r] = True
            elif not concurrent:  # a plain round: verify what is pending and draw the next token, the draft idle
                verify_row[r] = True
            elif m > 0 and not post_verify:  # verify the pending drafts alone, the draft idle
                verify_row[r] = True
            elif m == 0 and not pre_verify:  # draft only; the target skips the row
                use_window[r] = True
            else:
                use_window[r] = verify_row[r] = True
            # a window longer than what the row may still emit after this round would only be cut next round
            depth[r] = min(gamma, max(1, left - m - 1)) if use_window[r] else 0
            run[r] = pending[r] if verify_row[r] else []
        drafting = any(depth)
        if drafting:
            draft_lens = [lens[r] + len(pending[r]) for r in range(b)]
            keep = [min(fed[r], draft_lens[r] - 1) for r in range(b)]
            lo = min(keep)  # the draft reads only what it has not cached
            draft.seq[:, lo: state.seq.shape[1]].copy_(state.seq[:, lo:])
            for r in range(b):
                if pending[r]:
                    draft.seq[r, lens[r]: draft_lens[r]] = torch.tensor(pending[r])
            first_window = min(fed) == 0  # it also feeds a whole prompt: not a time per forward to learn from
            draft.submit(draft_lens, depth, keep)
            fed = [draft_lens[r] + max(depth[r] - 1, 0) for r in range(b)]
        logits, target_seconds = None, None
        nodes = max(1 + len(x) for x in run)
        if any(verify_row):
            width = nodes - 1
            ttree = DraftTree.chain(state.roots, _pad(run, width, dev))
            with timed(stats, "target_s") as seconds:
                logits, _ = target.forward_tree(ttree)
            target_seconds = seconds[0]
            stats.target_calls += 1
        win = None
        if drafting:
            t_wait = time.perf_counter()
            win = draft.result()
            rounds.wait_s += time.perf_counter() - t_wait
            rounds.window_s += win.seconds
            stats.draft_calls += win.forwards
            if draft.remote:
                stats.remote_draft_calls += win.forwards
        rounds.rounds += 1
        rounds.gamma_sum += gamma
        if target_seconds is not None:
            rounds.target_s += target_seconds
        tested_all = accepted_all = emitted_all = 0
        new_pending: list[list[int]] = [[] for _ in range(b)]
        new_q: list[SparseProbs | None] = [None] * b
        if logits is not None and all(verify_row) and not any(run) and not any(use_window):
            # Every row verifies its root alone (a plain round with nothing pending): `ar`'s step, the same draw
            # from the same generator, without the chain verifier's host time (1.9 ms a round sampled, one row).
            emitted_all = _plain_round(target, state, out, verifier.first_token(logits[:, 0]), live, stats)
            rounds.bonus += b
        elif logits is not None:
            chains = []
            for r in range(b):
                chain = list(run[r])
                if verify_row[r] and use_window[r]:
                    chain.append(int(win.tokens[r, 0]))
                chains.append(chain)
            vtree = DraftTree.chain(state.roots, _pad(chains, nodes, dev),
                                    None if sampling.greedy else _chain_q(chains, run, verify_row, use_window,
                                                                         pending_q, win, nodes, dev))
            bonus = torch.tensor([verify_row[r] and not use_window[r] for r in range(b)], device=dev)
            verdict = verifier.verify(vtree, logits, bonus=bonus)
            path_len, has_next = verdict.path_len.long(), verdict.has_next
            emitted_n = path_len - 1 + has_next.long()
            keep_kv = path_len - (~has_next).long()
            emitted = verdict.emitted(vtree)
            # one transfer to the host: per row path length, has_next, tokens emitted, KV kept, the tokens
            host = torch.cat([torch.stack([path_len, has_next.long(), emitted_n, keep_kv], 1), emitted], 1).tolist()
            target.commit(verdict.path, keep_kv, True, [h[3] for h in host])
            state.advance(emitted, emitted_n, [h[2] for h in host])
            for r in range(b):
                if not verify_row[r]:
                    continue
                n_path, nxt, n_emit = host[r][0], host[r][1], host[r][2]
                tested_all += min(n_path, len(chains[r]))  # the accepted drafts and a rejected one
                accepted_all += n_path - 1
                stats.drafted_tokens += len(chains[r])
                stats.accepted_tokens += n_path - 1
                stats.accept_lengths.append(n_path - 1)
                out.add(live[r], host[r][4: 4 + n_emit])
                emitted_all += n_emit
                pre = len(run[r]) == 0
                if use_window[r] and not nxt:  # every draft accepted, the window's first token too
                    new_pending[r], new_q[r] = _window_tail(win, r, 1, depth[r])
                    if pre:
                        rounds.pre_accept += 1
                    else:
                        rounds.post_all += 1
                elif not use_window[r]:
                    rounds.bonus += 1
                elif pre:
                    rounds.pre_reject += 1
                else:
                    rounds.post_reject += 1
            stats.steps += 1
        for r in range(b):
            if not verify_row[r] and use_window[r]:  # drafting only: the whole window waits for the next round
                new_pending[r], new_q[r] = _window_tail(win, r, 0, depth[r])
                rounds.draft_only += 1
        pending, pending_q = new_pending, new_q
        # one-row forwards teach the window rule the target's step cost, also once a batch is down to one row
        # (a plain round's forward ran on other threads than the window rule's costs)
        window.observe(tested_all, accepted_all, win.seconds if win and not first_window else None,
                       win.forwards if win else 0, target_seconds if b == 1 and concurrent else None, nodes)
        if governor is not None:
            governor.observe(concurrent or harvests, b, emitted_all, time.perf_counter() - round_start)
        live, kept = leave_batch(live, out.done, target, state, draft)
        if kept is not None:  # later rounds compute only the rows still generating
            pending, pending_q, fed = ([x[r] for r in kept] for x in (pending, pending_q, fed))
            b = len(live)
    stats.drafter = rounds.summary()
    if governor is not None:
        stats.drafter["governor"] = governor.summary()
    stats.total_s = time.perf_counter() - t0
    return DecodeResult(out.tokens, stats)


def _plain_round(target: ModelRunner, state, out, token: torch.Tensor, live: list[int], stats: DecodeStats) -> int:
    """Commit a round in which every row verified its root alone: ``token [B]`` its next token per row. Returns
    the tokens emitted (one a row)."""
    b = token.shape[0]
    ones, zero_path = one_token_path(b, token.device)
    target.commit(zero_path, ones, True, [1] * b)
    state.append(token)
    for r, t in enumerate(token.tolist()):
        out.add(live[r], [t])
        stats.accept_lengths.append(0)
    stats.steps += 1
    return b


def _window_tail(win, r: int, start: int, depth: int) -> tuple[list[int], SparseProbs | None]:
    """Row ``r``'s window tokens ``start .. depth - 1`` (the drafted ones) and the proposals they were drawn
    from, ``[1, n, k]`` (None when greedy): the next round's pending drafts."""
    tokens = [t for t in win.tokens[r, start:depth].tolist() if t >= 0]
    if win.q is None:
        return tokens, None
    end = start + len(tokens)
    return tokens, SparseProbs(win.q.ids[r: r + 1, start:end], win.q.probs[r: r + 1, start:end])


def _pad(rows: list[list[int]], width: int, device) -> torch.Tensor:
    """``[B, width] int64`` of the token lists, -1 padded."""
    out = torch.full((len(rows), width), -1, dtype=torch.int64)
    for r, row in enumerate(rows):
        if row:
            out[r, : len(row)] = torch.tensor(row)
    return out.to(device)


def _chain_q(chains, run, verify_row, use_window, pending_q, win, width: int, device) -> SparseProbs:
    """``[B, width, k]`` the proposals of each row's verified chain: its pending drafts', then the window's
    first token's (one-hot, all zero, where a row has none)."""
    k = max([q.k for q in pending_q if q is not None] + [win.q.k if win is not None and win.q is not None else 1])
    ids = torch.full((len(chains), width, k), -1, dtype=torch.int64)
    probs = torch.zeros(len(chains), width, k)
    for r in range(len(chains)):
        m = len(run[r])
        if m and pending_q[r] is not None:
            kk = pending_q[r].k
            ids[r, :m, :kk], probs[r, :m, :kk] = pending_q[r].ids[0, :m], pending_q[r].probs[0, :m]
        if verify_row[r] and use_window[r]:
            kk = win.q.k
            ids[r, m, :kk], probs[r, m, :kk] = win.q.ids[r, 0], win.q.probs[r, 0]
    return SparseProbs(ids.to(device), probs.to(device))


class PearlDecoding:
    """What the registry's ``pearl`` builds, run by :meth:`generate`: the round options, and factories of the draft
    backend and the window rule, called at the first generation (building the method, e.g. for a memory
    estimate, starts no process and times nothing).

    make_backend: ``() -> (ConcurrentDraft, core or None)``, the core a worker is pinned to; make_window:
    ``() -> WindowLength``; largest_window: the window's upper bound (for the cache margin). A generation runs the
    target's drafting rounds on one intra-op thread, off the worker's core, and its prefill and plain rounds on
    every core, restored afterwards (an inline backend runs target and draft on that one thread, one after the
    other).
    """

    needs_hidden = False  # the draft reads tokens only

    def __init__(self, make_backend, make_window, largest_window: int, pre_verify: bool = True,
                 post_verify: bool = True, proposal_topk: int = 64, draft_positions: int | None = None):
        self.make_backend, self.make_window, self.largest_window = make_backend, make_window, largest_window
        self.draft_positions = draft_positions  # the draft's max_position_embeddings (None: unbounded)
        self.pre_verify, self.post_verify, self.proposal_topk = pre_verify, post_verify, proposal_topk
        self.window: WindowLength | None = None

    @property
    def margin(self) -> int:
        """Cache room past the longest sequence for one round's chain."""
        return self.largest_window + 1

    def generate(self, target: ModelRunner, prompts: list[list[int]], max_new_tokens: int,
                 sampling: SamplingConfig, eos_token_ids: set[int] | None,
                 governor: DraftGovernor | None = None) -> DecodeResult:
        """PEARL over ``prompts``; ``governor``: rounds without the draft, on every core, where they emit more per
        second (not with ``pre_verify`` off: its drafting-only rounds emit nothing, so a round's rate means nothing)."""
        # The draft runs ahead of the target for the whole generation (its window beyond the last token), so
        # unlike the drafters of the other methods it cannot stop at its context's end: refused up front.
        need = max((len(p) for p in prompts), default=0) + max_new_tokens + self.largest_window
        if self.draft_positions is not None and prompts and need > self.draft_positions:
            raise ValueError(f"context too long for pearl's draft: prompt, max_new_tokens and the draft window need "
                             f"{need} positions, the draft has {self.draft_positions} (sd, gsd and ouroboros stop "
                             f"drafting there and go on as ar)")
        draft, core = self.make_backend()
        cores = Cores(avoid=core)
        try:
            cores.shared()
            if self.window is None:
                self.window = self.make_window()  # an adaptive window calibrates on this one thread
            return pearl_generate(target, draft, prompts, max_new_tokens, sampling, eos_token_ids, self.window,
                                  self.pre_verify, self.post_verify, self.proposal_topk,
                                  governor if self.pre_verify else None, cores)
        finally:
            cores.alone()


class Cores:
    """Switches this process between one intra-op thread off core ``avoid`` (``shared``: a draft worker has that
    core) and the threads and cores it started with (``alone``)."""

    def __init__(self, avoid: int | None = None):
        self.threads, self.cores, self.avoid = torch.get_num_threads(), os.sched_getaffinity(0), avoid
        self._shared: bool | None = None

    def shared(self) -> None:
        if self._shared is not True:
            torch.set_num_threads(1)
            if self.avoid is not None and self.cores - {self.avoid}:
                os.sched_setaffinity(0, self.cores - {self.avoid})
            self._shared = True

    def alone(self) -> None:
        if self._shared is not False:
            torch.set_num_threads(self.threads)
            os.sched_setaffinity(0, self.cores)
            self._shared = False


@contextmanager
def one_thread(avoid: int | None = None):
    """Run the body on one intra-op thread, off core ``avoid`` (if given); both restored afterwards."""
    cores = Cores(avoid)
    cores.shared()
    try:
        yield
    finally:
        cores.alone()
