"""Decode loops: the generic speculative loop and the autoregressive baseline.

Both return new tokens per row and the same statistics. A step of the speculative loop is:
drafter proposes a tree -> target runs over it -> verifier picks the accepted path and the next
token -> the runner keeps the accepted KV -> drafter and policy learn from the outcome.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specdec.drafters.base import DecodeState, Drafter
from specdec.model import ModelRunner
from specdec.policies import StaticLength, prune
from specdec.tree import DraftTree
from specdec.verify import SamplingConfig, Verifier

TREE_MARGIN = 256  # cache room past the longest sequence for one step's draft tree


@dataclass
class DecodeStats:
    """Counters of one generation. Times in seconds: ``target_s`` in target forwards, ``draft_s`` in
    the drafter's ``propose``/``update``, ``total_s`` end to end; ``prefill_s`` is the prompt's
    target forward, included in both ``target_s`` and ``total_s``."""

    target_calls: int = 0
    draft_calls: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    steps: int = 0
    prefill_s: float = 0.0
    target_s: float = 0.0
    draft_s: float = 0.0
    total_s: float = 0.0
    accept_lengths: list[int] = field(default_factory=list)
    drafter: dict = field(default_factory=dict)


@dataclass
class DecodeResult:
    tokens: list[list[int]]
    stats: DecodeStats


def _prepare(prompts: list[list[int]], max_new_tokens: int, extra: int, device) -> tuple[DecodeState, torch.Tensor]:
    if not prompts:
        raise ValueError("no prompts given")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt: at least one token is needed")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    b = len(prompts)
    lens = [len(p) for p in prompts]
    seq = torch.zeros(b, max(lens) + max_new_tokens + extra, dtype=torch.int64)
    for r, p in enumerate(prompts):
        seq[r, : len(p)] = torch.tensor(p, dtype=torch.int64)
    seq = seq.to(device)
    return DecodeState(seq, torch.tensor(lens, device=device), lens), torch.tensor(lens, device=device)


def _check_capacity(runner: ModelRunner, needed: int) -> None:
    if needed > runner.max_positions:
        raise ValueError(
            f"context too long: prompt plus max_new_tokens needs {needed} positions, the model has {runner.max_positions}")


class _Outputs:
    """Per-row new tokens with EOS and length limits."""

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

    def left(self) -> list[int]:
        """``[B]`` draft tokens each row may still use: what it may emit less the one token every step
        adds (0 for finished rows)."""
        return [0 if d else self.max_new - len(t) - 1 for t, d in zip(self.tokens, self.done)]


@torch.inference_mode()
def speculative_generate(
    target: ModelRunner,
    drafter: Drafter,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    eos_token_ids: set[int] | None = None,
    policy=None,
) -> DecodeResult:
    """Speculative decoding of ``prompts`` (token id lists, ragged) with ``drafter`` and ``policy``
    (a length policy of :mod:`specdec.policies`: each step's per-row budget, and the measured step cost
    that every target forward is timed into). A tree that carries per-node acceptance estimates is cut to
    what pays for its cost (:func:`specdec.policies.prune`) before the target sees it.

    Returns the new tokens of each row (stopping after an EOS or at ``max_new_tokens``) and stats.
    """
    policy = policy or StaticLength(64)
    t0 = time.perf_counter()
    stats = DecodeStats()
    state, prompt_lens = _prepare(prompts, max_new_tokens, 1, target.device)
    _check_capacity(target, max(state.seq_lens_host) + max_new_tokens)
    target.reset(len(prompts), state.seq.shape[1] + TREE_MARGIN)
    b = len(prompts)
    verifier = Verifier(sampling, target.device)
    out = _Outputs(b, max_new_tokens, eos_token_ids or set())
    rows = torch.arange(b, device=target.device)

    need_hidden = drafter.needs_hidden
    ts = time.perf_counter()
    logits, prompt_hidden = target.prefill(state.seq[:, : max(state.seq_lens_host)], prompt_lens, need_hidden)
    stats.prefill_s = time.perf_counter() - ts
    stats.target_s += stats.prefill_s
    stats.target_calls += 1
    first = verifier.first_token(logits)
    state.seq[rows, state.seq_lens] = first
    state.seq_lens += 1
    state.seq_lens_host = [n + 1 for n in state.seq_lens_host]
    for r, tok in enumerate(first.tolist()):
        out.add(r, [tok])

    td = time.perf_counter()
    drafter.begin(state)
    policy.begin(b)
    if need_hidden:
        drafter.add_hidden(prompt_hidden, prompt_lens)
    stats.draft_s += time.perf_counter() - td
    target_len = [n - 1 for n in state.seq_lens_host]
    while not all(out.done):
        td = time.perf_counter()
        budget = policy.budget(out.left())
        tree = drafter.propose(state, budget)
        if tree.accept is not None and budget.cost is not None:
            tree = prune(tree, budget.cost)
        tree.build_mask()
        stats.draft_s += time.perf_counter() - td

        ts = time.perf_counter()
        logits, hidden = target.forward_tree(tree, need_hidden)
        forward_s = time.perf_counter() - ts
        stats.target_s += forward_s
        stats.target_calls += 1
        policy.observe_step(tree.size, forward_s)

        verdict = verifier.verify(tree, logits)
        path, path_len, nxt = verdict.path, verdict.path_len, verdict.next_token
        active = torch.tensor([not d for d in out.done], device=target.device)
        path_len = torch.where(active, path_len, 0)  # finished rows stand still
        # Tokens this step emits per row: the accepted drafts, then the next token.
        emitted = tree.tokens.gather(1, path.clamp(min=0))[:, 1:]
        emitted = torch.cat([emitted, nxt[:, None]], dim=1)
        emitted.scatter_(1, (path_len.long() - 1).clamp(min=0)[:, None], nxt[:, None])
        host = torch.cat([path_len[:, None].long(), tree.num_drafted[:, None], emitted], dim=1).tolist()
        lens = [h[0] for h in host]

        new_target_len = [t + n for t, n in zip(target_len, lens)]
        target.commit(path, path_len, tree.is_chain, max(new_target_len))
        target_len = new_target_len
        width = emitted.shape[1]
        pos = state.seq_lens[:, None] + torch.arange(width, device=target.device)
        keep = torch.arange(width, device=target.device)[None] < path_len[:, None]
        state.seq.scatter_(1, torch.where(keep, pos, 0), torch.where(keep, emitted, state.seq[:, :1]))
        state.seq_lens += path_len.long()
        state.seq_lens_host = [s + n for s, n in zip(state.seq_lens_host, lens)]

        stats.steps += 1
        rows_active = [r for r in range(b) if not out.done[r]]
        policy.update([host[r][1] for r in rows_active], [host[r][0] - 1 for r in rows_active], rows_active)
        for r in rows_active:
            n, drafted = host[r][0], host[r][1]
            stats.drafted_tokens += drafted
            stats.accepted_tokens += n - 1
            stats.accept_lengths.append(n - 1)
            out.add(r, host[r][2: 2 + n])
        td = time.perf_counter()
        if need_hidden:
            drafter.add_hidden(hidden.gather(1, path.clamp(min=0)[..., None].expand(-1, -1, hidden.shape[-1])), path_len)
        drafter.update(state, tree, path, lens, [h[1] for h in host])
        stats.draft_s += time.perf_counter() - td
    stats.draft_calls = drafter.draft_calls
    stats.drafter = drafter.summary()
    stats.total_s = time.perf_counter() - t0
    return DecodeResult(out.tokens, stats)


@torch.inference_mode()
def autoregressive_generate(
    target: ModelRunner,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    eos_token_ids: set[int] | None = None,
) -> DecodeResult:
    """One token per target forward, on the same runner and sampler as the speculative loop."""
    t0 = time.perf_counter()
    stats = DecodeStats()
    state, prompt_lens = _prepare(prompts, max_new_tokens, 1, target.device)
    _check_capacity(target, max(state.seq_lens_host) + max_new_tokens)
    b = len(prompts)
    target.reset(b, state.seq.shape[1])
    verifier = Verifier(sampling, target.device)
    out = _Outputs(b, max_new_tokens, eos_token_ids or set())
    ts = time.perf_counter()
    logits, _ = target.prefill(state.seq[:, : max(state.seq_lens_host)], prompt_lens)
    stats.prefill_s = time.perf_counter() - ts
    stats.target_s += stats.prefill_s
    stats.target_calls += 1
    ones = torch.ones(b, dtype=torch.int64, device=target.device)
    zero_path = torch.zeros(b, 1, dtype=torch.int64, device=target.device)
    write_pos = max(state.seq_lens_host)
    while True:
        tok = verifier.first_token(logits)
        for r, t in enumerate(tok.tolist()):
            if not out.done[r]:
                out.add(r, [t])
        if all(out.done):
            break
        ts = time.perf_counter()
        logits, _ = target.forward_tree(DraftTree.chain(tok))
        stats.target_s += time.perf_counter() - ts
        stats.target_calls += 1
        stats.steps += 1
        write_pos += 1
        target.commit(zero_path, ones, True, write_pos)
        logits = logits[:, 0]
    stats.total_s = time.perf_counter() - t0
    return DecodeResult(out.tokens, stats)
