"""Decode loops: the generic speculative loop and the autoregressive baseline.

Both return new tokens per row and the same statistics. A step of the speculative loop is:
drafter proposes a tree -> target runs over it -> verifier picks the accepted path and the next
token -> the runner keeps the accepted KV -> drafter and policy learn from the outcome.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from specdec.contracts import Budget, DecodeState, LengthPolicy
from specdec.drafters.base import Drafter
from specdec.counters import add_counters
from specdec.model import ModelRunner
from specdec.policies import DraftGovernor, StaticLength, cap_nodes, prune
from specdec.tree import DraftTree
from specdec.verify import SamplingConfig, Verifier



@dataclass
class DecodeStats:
    """Counters of one generation. Times in seconds: ``target_s`` in target forwards, ``draft_s`` in
    the drafter's ``propose``/``update``, ``total_s`` end to end; ``prefill_s`` is the prompt's
    target forward, included in both ``target_s`` and ``total_s``."""

    target_calls: int = 0
    draft_calls: int = 0
    remote_draft_calls: int = 0  # of draft_calls, those run in another process (PEARL's worker)
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    steps: int = 0
    prefill_s: float = 0.0
    target_s: float = 0.0
    draft_s: float = 0.0
    total_s: float = 0.0
    accept_lengths: list[int] = field(default_factory=list)
    drafter: dict = field(default_factory=dict)
    chunks: int = 1  # generations the batch was split into to fit memory (``SpecDecoder.generate_ids``)
    memory_estimate: int | None = None  # bytes the largest chunk was estimated to need beyond the weights

    def merge(self, other: "DecodeStats") -> None:
        """Add the counters of ``other``, a generation of other rows run after this one (a batch chunk)."""
        for name in ("target_calls", "draft_calls", "remote_draft_calls", "drafted_tokens", "accepted_tokens", "steps", "prefill_s",
                     "target_s", "draft_s", "total_s", "chunks"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.accept_lengths += other.accept_lengths
        self.drafter = add_counters(self.drafter, other.drafter)
        if other.memory_estimate is not None:
            self.memory_estimate = max(self.memory_estimate or 0, other.memory_estimate)

    def record(self, step: "StepOutcome", rows: list[int]) -> None:
        """Count one verification step of the ``rows`` still generating."""
        self.steps += 1
        self.target_calls += 1
        for r in rows:
            self.drafted_tokens += step.drafted[r]
            self.accepted_tokens += step.lengths[r] - 1
            self.accept_lengths.append(step.lengths[r] - 1)


@dataclass
class DecodeResult:
    tokens: list[list[int]]
    stats: DecodeStats


# The pieces every decode loop is built from (this module's two loops and PEARL's): start_generation, Outputs,
# timed, leave_batch.

def start_generation(target: ModelRunner, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingConfig,
                     eos_token_ids: set[int] | None, margin: int) -> tuple[DecodeState, "Outputs", Verifier]:
    """Check the inputs, lay the prompts into a decode state and reset the runner for them (with
    ``margin`` cache positions past the longest sequence for a step's draft tree). Returns the state, the
    per-row outputs and the verifier for ``sampling``."""
    if not prompts:
        raise ValueError("no prompts given")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt: at least one token is needed")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > target.max_positions:
        raise ValueError(f"context too long: prompt plus max_new_tokens needs {longest + max_new_tokens} positions, "
                         f"the model has {target.max_positions}")
    state = DecodeState.of(prompts, longest + max_new_tokens + 1, target.device)
    target.reset(len(prompts), state.seq.shape[1] + margin)
    return state, Outputs(len(prompts), max_new_tokens, eos_token_ids or set()), Verifier(sampling, target.device)


class Outputs:
    """Per-row new tokens with EOS and length limits: ``tokens [B]`` lists, ``done [B]`` host bools."""

    def __init__(self, b: int, max_new_tokens: int, eos: set[int]):
        self.tokens: list[list[int]] = [[] for _ in range(b)]
        self.done = [False] * b
        self.max_new, self.eos = max_new_tokens, eos

    def add(self, row: int, new: list[int]) -> None:
        out = self.tokens[row]
        for tok in new:
            out.append(tok)
            if tok in self.eos or len(out) >= self.max_new:
                self.done[row] = True
                return

    def add_each(self, tokens: list[int]) -> None:
        """One new token per row (finished rows ignore theirs)."""
        for r, tok in enumerate(tokens):
            if not self.done[r]:
                self.add(r, [tok])

    def left(self, rows: list[int]) -> list[int]:
        """Draft tokens each of ``rows`` may still use: what it may emit less the one token every step
        adds (0 for finished rows)."""
        return [0 if self.done[r] else self.max_new - len(self.tokens[r]) - 1 for r in rows]


def leave_batch(live: list[int], done: list[bool], *holders) -> tuple[list[int], list[int] | None]:
    """Drop the finished rows from the batch: ``live`` maps batch rows to prompts; every holder of per-row
    state (the runner, the decode state, the drafter, the policy) keeps the unfinished rows. Returns the
    new map and the batch rows kept (None where no row left)."""
    keep = [r for r, i in enumerate(live) if not done[i]]
    if keep and len(keep) < len(live):
        for holder in holders:
            holder.keep_rows(keep)
        return [live[r] for r in keep], keep
    return live, None


@contextmanager
def timed(stats: DecodeStats, *fields: str):
    """Add the wall time of the ``with`` body to each of ``stats``'s ``fields``; yields a one-item list
    that holds the seconds afterwards (for a caller that needs the value too)."""
    seconds = [0.0]
    t0 = time.perf_counter()
    try:
        yield seconds
    finally:
        seconds[0] = time.perf_counter() - t0
        for name in fields:
            setattr(stats, name, getattr(stats, name) + seconds[0])


@dataclass
class StepOutcome:
    """What one verification step did, on the host after one transfer.

    path ``[B,T]`` / path_len ``[B]``: the accepted nodes per row (root included; 0 for finished rows,
    which stand still); emitted ``[B,T]``: the tokens the step emits per row (accepted drafts, then the
    next token; ``path_len`` of them); lengths, drafted, tokens: ``path_len``, the draft nodes verified
    and the emitted tokens per row, on the host.
    """

    path: torch.Tensor
    path_len: torch.Tensor
    emitted: torch.Tensor
    lengths: list[int]
    drafted: list[int]
    tokens: list[list[int]]

    @classmethod
    def of(cls, tree: DraftTree, verdict, active: list[bool]) -> "StepOutcome":
        path_len = verdict.path_len.long()
        if not all(active):  # finished rows stand still
            path_len = torch.where(torch.tensor(active, device=path_len.device), path_len, 0)
        emitted = verdict.emitted(tree)
        host = torch.cat([path_len[:, None], tree.num_drafted[:, None], emitted], dim=1).tolist()
        return cls(verdict.path, path_len, emitted, [h[0] for h in host], [h[1] for h in host],
                   [h[2: 2 + h[0]] for h in host])

    @classmethod
    def plain(cls, token: torch.Tensor, active: list[bool]) -> "StepOutcome":
        """A step that verified each row's root alone: ``token [B]`` the next token per row (finished rows
        stand still)."""
        b, dev = token.shape[0], token.device
        return cls(torch.zeros(b, 1, dtype=torch.int64, device=dev), torch.tensor(active, dtype=torch.int64, device=dev),
                   token[:, None], [int(a) for a in active], [0] * b,
                   [[t] if a else [] for t, a in zip(token.tolist(), active)])


def tree_margin(drafter: Drafter, policy: LengthPolicy, max_new_tokens: int) -> int:
    """Cache room past the longest sequence for one step's draft tree: the largest tree ``drafter`` can
    propose under ``policy``'s deepest budget (a row never drafts more than it may still emit)."""
    return drafter.max_tree_size(min(policy.max_depth, max_new_tokens))


@torch.inference_mode()
def speculative_generate(
    target: ModelRunner,
    drafter: Drafter,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    eos_token_ids: set[int] | None = None,
    policy: LengthPolicy | None = None,
    governor: DraftGovernor | None = None,
) -> DecodeResult:
    """Speculative decoding of ``prompts`` (token id lists, ragged) with ``drafter`` and ``policy``
    (a length policy of :mod:`specdec.policies`: each step's per-row budget, and the measured step cost
    that every target forward is timed into). A tree that carries per-node acceptance estimates is cut to
    what pays for its cost (:func:`specdec.policies.prune`) before the target sees it. A ``governor``
    (:class:`specdec.policies.DraftGovernor`) times whole steps and makes the loop draft nothing while steps
    without a draft emit more tokens per second.

    Returns the new tokens of each row (stopping after an EOS or at ``max_new_tokens``) and stats.
    """
    policy = policy or StaticLength(64)
    stats, t0 = DecodeStats(), time.perf_counter()
    margin = tree_margin(drafter, policy, max_new_tokens)
    state, out, verifier = start_generation(target, prompts, max_new_tokens, sampling, eos_token_ids, margin)
    with timed(stats, "prefill_s", "target_s"):
        logits, prompt_hidden = target.prefill(state.padded(), state.seq_lens, drafter.needs_hidden)
    stats.target_calls += 1
    first = verifier.first_token(logits)
    state.append(first)
    out.add_each(first.tolist())
    with timed(stats, "draft_s"):
        drafter.begin(state)
        policy.begin(len(prompts), state)
        if governor is not None:
            governor.begin()
        if drafter.needs_hidden:
            drafter.add_hidden(prompt_hidden, state.seq_lens - 1)
    # Finished rows leave the batch where every holder of per-row state can drop rows (every shipped drafter
    # and policy can), so later steps compute only the rows still generating; elsewhere they stand still in it.
    leave = drafter.keeps_rows and policy.keeps_rows
    live = list(range(len(prompts)))  # batch row -> prompt
    while not all(out.done):
        step_start = time.perf_counter()
        drafting = governor is None or governor.drafts(len(live))
        with timed(stats, "draft_s"):
            budget = policy.budget(out.left(live)) if drafting else Budget([0] * len(live))
            tree = drafter.propose(state, budget)
            if tree.accept is not None and budget.cost is not None:
                tree = prune(tree, budget.cost, [not out.done[i] for i in live])
            if budget.max_nodes is not None:
                tree = cap_nodes(tree, budget.max_nodes)
            tree.build_mask()
        with timed(stats, "target_s") as seconds:
            logits, hidden = target.forward_tree(tree, drafter.needs_hidden)
        policy.observe_step(tree.size, seconds[0], tree.tokens.shape[0])
        going = [not out.done[i] for i in live]
        if tree.size == 1 and not drafter.per_node:
            # Nothing drafted (a governed plain step, or no row found a draft): `ar`'s step, the same draw from the
            # same generator (so a generation that never drafts is `ar`'s, sampled too), at 0.4 ms less host time
            # than the tree verifier's (2.38 -> 2.01 ms a step; 4 rows, T = 1, 33-37 ms steps).
            step = StepOutcome.plain(verifier.first_token(logits[:, 0]), going)
        else:
            verdict = verifier.verify(tree, logits, per_node=drafter.per_node)
            if drafter.per_node:
                drafter.observe_verdict(tree, verdict)
            step = StepOutcome.of(tree, verdict, going)
        target.commit(step.path, step.path_len, tree.is_chain, step.lengths)
        state.advance(step.emitted, step.path_len, step.lengths)
        active = [r for r, n in enumerate(step.lengths) if n > 0]
        policy.update([step.drafted[r] for r in active], [step.lengths[r] - 1 for r in active], active)
        stats.record(step, active)
        for r in active:
            out.add(live[r], step.tokens[r])
        with timed(stats, "draft_s"):
            if drafter.needs_hidden:
                drafter.add_hidden(hidden.gather(1, step.path.clamp(min=0)[..., None].expand(-1, -1, hidden.shape[-1])),
                                   step.path_len)
            drafter.update(state, tree, step.path, step.lengths, step.drafted)
        if governor is not None:
            governor.observe(drafting, len(live), sum(step.lengths[r] for r in active),
                             time.perf_counter() - step_start)
        if leave:
            live, _ = leave_batch(live, out.done, target, state, drafter, policy)
    drafter.finish()
    stats.draft_calls = drafter.draft_calls
    stats.drafter = drafter.summary()
    if governor is not None:
        stats.drafter["governor"] = governor.summary()
    stats.total_s = time.perf_counter() - t0
    return DecodeResult(out.tokens, stats)


def one_token_path(b: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A step that commits each of ``b`` rows' root alone (``ar``'s step, and PEARL's plain rounds): ``[b]`` int64
    ones (the path lengths) and ``[b, 1]`` int64 zeros (the root's node index), for :meth:`ModelRunner.commit`."""
    return torch.ones(b, dtype=torch.int64, device=device), torch.zeros(b, 1, dtype=torch.int64, device=device)


@torch.inference_mode()
def autoregressive_generate(
    target: ModelRunner,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    eos_token_ids: set[int] | None = None,
) -> DecodeResult:
    """One token per target forward, on the same runner and sampler as the speculative loop."""
    stats, t0 = DecodeStats(), time.perf_counter()
    state, out, verifier = start_generation(target, prompts, max_new_tokens, sampling, eos_token_ids, 0)
    with timed(stats, "prefill_s", "target_s"):
        logits, _ = target.prefill(state.padded(), state.seq_lens)
    stats.target_calls += 1
    live = list(range(len(prompts)))  # batch row -> prompt (rows that finish early leave the batch)
    ones, zero_path = one_token_path(len(live), target.device)
    while True:
        tok = verifier.first_token(logits)
        for r, t in zip(live, tok.tolist()):
            if not out.done[r]:
                out.add(r, [t])
        if all(out.done):
            break
        live, keep = leave_batch(live, out.done, target)
        if keep is not None:
            tok = tok[torch.tensor(keep, device=tok.device)]
            ones, zero_path = one_token_path(len(live), target.device)
        with timed(stats, "target_s"):
            logits, _ = target.forward_tree(DraftTree.chain(tok))
        stats.target_calls += 1
        stats.steps += 1
        target.commit(zero_path, ones, True, [1] * len(live))
        logits = logits[:, 0]
    stats.total_s = time.perf_counter() - t0
    return DecodeResult(out.tokens, stats)
