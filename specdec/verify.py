"""Acceptance of draft trees: greedy and lossless sampling, over the target's processed logits.

:meth:`Verifier.verify` returns a :class:`VerifyResult`: the accepted path and next token, and on
request what the target wanted at every node (its argmax, or the top-k of its sampling distribution),
for drafters that learn from rejected nodes and policies that label their decisions; ``bonus=False``
verifies without drawing a token after a fully accepted branch (PEARL's post-verify).

Every method inherits its losslessness from here: greedy output equals the target's argmax
chain; sampled output follows the target's distribution after temperature, top-k and top-p,
processed exactly as transformers' ``generate`` does (temperature, then top-k, then top-p).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec import kernels
from specdec.tree import DraftTree


@dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 means greedy; top_k 0/None and top_p 1.0/None disable those filters."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0 or self.temperature != self.temperature:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def processed_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """The sampling logits ``[..., V] fp32`` of ``logits [..., V]`` under ``cfg`` (not greedy): divided
    by the temperature, filtered tokens at ``-inf``. Their softmax is :func:`processed_probs`."""
    x = logits.float() / cfg.temperature
    v = x.shape[-1]
    if cfg.top_k:
        k = min(cfg.top_k, v)
        kth = x.topk(k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if cfg.top_p is not None and cfg.top_p < 1.0:
        # As transformers' TopPLogitsWarper: drop the low tail whose mass is <= 1 - top_p, keep >= 1 token.
        sorted_x, order = x.sort(dim=-1)
        cum = sorted_x.softmax(-1).cumsum(-1)
        drop_sorted = cum <= 1 - cfg.top_p
        drop_sorted[..., -1] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def processed_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """The sampling distribution ``[..., V] fp32`` of ``logits [..., V]`` under ``cfg`` (not greedy)."""
    return processed_logits(logits, cfg).softmax(-1)


def check_logits(logits: torch.Tensor, who: str = "the model") -> None:
    """Raise where a row of ``logits [..., V]`` names no token: a NaN anywhere, a ``+inf`` (no distribution, and
    no single argmax, follows from it) or a row that is all ``-inf``. A broken model or a dtype overflow must not
    turn into a wrong answer; single ``-inf`` entries (masked tokens) are fine. ``who`` names the model in the
    error (a draft's logits are checked too: sampling verification divides by the draft's probabilities).

    One reduction answers all three: each row's maximum is finite exactly when the row is usable, because the
    maximum carries any NaN (max reductions propagate NaN) and is ``+inf`` or ``-inf`` in the other two cases.
    ``isnan(logits).any()`` would write a mask as large as the logits (4-7x slower on a CPU at SmolLM2's 49k
    vocabulary)."""
    top = logits.amax(-1)
    if bool(torch.isfinite(top).all()):
        return
    hint = " (try --dtype fp32)" if logits.dtype != torch.float32 else ""
    if bool(torch.isnan(top).any()):
        raise FloatingPointError(f"{who} produced NaN logits{hint}")
    if bool((top == float("inf")).any()):
        raise FloatingPointError(f"{who} produced +inf logits{hint}")
    raise FloatingPointError(f"{who} produced a row of logits that are all -inf: no token can follow")


@dataclass(frozen=True)
class VerifyResult:
    """What one verification decided, and (on request) what the target wanted at every node.

    ``B`` rows, ``T`` tree nodes (node 0 the root), ``k = min(topk, V)`` for the Verifier's ``topk``.

    Attributes:
        path: ``[B, T] int64``, the accepted nodes from the root (node 0), -1 padded.
        path_len: ``[B] int32``, accepted nodes including the root (``>= 1``).
        next_token: ``[B] int64``, the token emitted after the accepted drafts: the target's argmax
            (greedy) or a draw from its distribution or rejection residual (sampling) at the path's
            last node; ``-1`` where ``has_next`` is False.
        has_next: ``[B] bool``. Always True with ``bonus=True``. With ``bonus=False``, False where
            the path ends at a leaf (every draft on its branch accepted: no bonus token is drawn).
        target_argmax: ``[B, T] int64`` or None (greedy with ``per_node``): the target's argmax at
            every node, the token it would emit after that node, whether the node was accepted or
            not: ``logits.argmax(-1)`` (first maximum on ties); -1 on node ``T-1``'s row with
            ``bonus=False`` (it has no logits).
        target_topk_ids: ``[B, T, k] int64`` or None (sampling with ``per_node``): the ``k`` most
            likely tokens of the target's processed distribution (after temperature, top-k, top-p,
            as :func:`processed_probs`) at every node, most likely first; -1 where the probability
            is 0 (fewer than ``k`` tokens survive the filters) and on node ``T-1``'s row with
            ``bonus=False``.
        target_topk_probs: ``[B, T, k] fp32`` or None: their probabilities (0 where the id is -1).

    Tokens emitted by row ``b``: the drafts on ``path[b, 1:path_len[b]]``, then ``next_token[b]``
    if ``has_next[b]`` (:meth:`emitted`).
    """

    path: torch.Tensor
    path_len: torch.Tensor
    next_token: torch.Tensor
    has_next: torch.Tensor
    target_argmax: torch.Tensor | None = None
    target_topk_ids: torch.Tensor | None = None
    target_topk_probs: torch.Tensor | None = None

    @property
    def num_emitted(self) -> torch.Tensor:
        """``[B] int64`` tokens this verification emits per row: accepted drafts plus the next token."""
        return self.path_len.long() - 1 + self.has_next.long()

    def emitted(self, tree: DraftTree) -> torch.Tensor:
        """``[B, T] int64`` the tokens emitted per row (accepted drafts, then the next token if any),
        -1 padded after :attr:`num_emitted` entries. ``tree`` is the verified tree."""
        drafts = tree.tokens.gather(1, self.path.clamp(min=0))[:, 1:]  # -1 path padding gathers the root: masked below
        out = torch.cat([drafts, self.next_token[:, None]], dim=1)
        out.scatter_(1, (self.path_len.long() - 1)[:, None], self.next_token[:, None])
        width = torch.arange(out.shape[1], device=out.device)
        return out.masked_fill_(width >= self.num_emitted[:, None], -1)


def ends_at_leaf(tree: DraftTree, path: torch.Tensor, path_len: torch.Tensor) -> torch.Tensor:
    """``[B] bool``: whether each row's accepted path ends at a node without valid children."""
    b, t = tree.tokens.shape
    if tree.is_chain:  # the only possible child of node i is node i + 1 = path_len
        nxt = path_len.long()
        return (nxt >= t) | ~tree.valid.gather(1, nxt.clamp(max=t - 1)[:, None]).squeeze(1)
    children = torch.zeros(b, t, dtype=torch.int32, device=tree.tokens.device)
    children.scatter_add_(1, tree.parents[:, 1:].clamp(min=0), tree.valid[:, 1:].int())
    end = path.gather(1, (path_len.long() - 1)[:, None])
    return children.gather(1, end).squeeze(1) == 0


def node_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``[B, N] int64`` the argmax of every row of ``logits [B, N, V]`` (first maximum on ties, as
    ``torch.argmax``).

    Every row is verified as a one-node tree, whose next token is the argmax: the greedy verify
    kernel's argmax reads bf16 in place and is about 3x faster on a CPU than ``torch.argmax`` (which
    needs an fp32 copy to be fast: 160-180 us against about 55 us for ``[1, 6, 49152]`` bf16), and
    on a GPU it is the same Triton argmax.
    """
    b, n, v = logits.shape
    if b * n == 0:
        return torch.empty(b, n, dtype=torch.int64, device=logits.device)
    root = torch.zeros(b * n, 1, dtype=torch.int64, device=logits.device)
    _, _, nxt = kernels.tree_verify_greedy(root, root - 1, logits.reshape(b * n, 1, v))
    return nxt.view(b, n)


class Verifier:
    """Greedy or sampling acceptance with its own random stream (independent of any drafter's).

    ``per_node``: compute the per-node fields of :class:`VerifyResult` by default (each
    :meth:`verify` call can override it); ``topk``: how many of the target's most likely tokens
    sampling mode reports per node. Per-node data is opt-in because it is measurable next to the
    verification itself, though not next to a target forward: on one CPU thread, ``[1, 6, 49152]``
    bf16 logits, the greedy argmax at every node adds about 47 us to a 45-60 us verification, the
    sampling top-8 about 175 us to a 2.4 ms one (temperature 0.8), against 30-40 ms for SmolLM2-135M's
    verification forward. ``bonus=False`` adds about 30 us (greedy) and 140 us (sampling): the kernels
    take ``T`` logits rows, so the logits get one padding row.
    """

    def __init__(self, cfg: SamplingConfig, device: torch.device, per_node: bool = False, topk: int = 8):
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        self.cfg = cfg
        self.per_node = per_node
        self.topk = topk
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(cfg.seed if cfg.seed is not None else torch.seed())

    def first_token(self, logits: torch.Tensor) -> torch.Tensor:
        """Next token ``[B]`` from logits ``[B,V]`` (after prefill or a plain decode step)."""
        check_logits(logits)
        if self.cfg.greedy:
            return logits.float().argmax(-1)  # torch's half-precision argmax on a CPU is about 2x slower than widening first
        probs = processed_probs(logits, self.cfg)
        u = torch.rand(probs.shape[0], generator=self.generator, device=probs.device)
        return kernels.sample_from_probs(probs, u)

    def verify(
        self, tree: DraftTree, logits: torch.Tensor, *, bonus: "bool | torch.Tensor" = True,
        per_node: bool | None = None
    ) -> VerifyResult:
        """Accept a path of ``tree`` given the target's logits at its nodes.

        Args:
            tree: ``B`` rows of ``T`` nodes.
            logits: ``[B, T, V]`` the target's logits at every node with ``bonus=True``;
                ``[B, T-1, V]`` at nodes ``0 .. T-2`` with ``bonus=False``: node ``T-1`` (a leaf:
                parents precede children) needs no logits, so the target's forward can leave it out
                and it becomes the next call's root. Logits of other leaves are never read then.
            bonus: False for PEARL's post-verify: where a row's path ends at a leaf (all drafts on
                its branch accepted), emit no token after it (``has_next`` False, ``next_token``
                -1): the drafter continues from that leaf and the target's next call checks its
                continuation. Where a draft is rejected the correction token is emitted as usual.
                A row without a next token has its leaf as the next root, whose KV is by convention
                not cached: keep the KV of its path without the leaf (``path_len - 1`` nodes).
                A ``[B] bool`` tensor chooses per row (logits as for False): a True row draws its next
                token at any leaf, as with ``bonus=True``, which needs the leaf's logits, so its node
                ``T-1`` must be invalid (its chain or tree ends earlier).
            per_node: compute ``target_argmax`` (greedy) or ``target_topk_*`` (sampling); None
                uses the Verifier's default.

        Sampling with ``bonus=False`` stays lossless. Every token emitted is either an accepted draft
        (accepted with probability ``min(1, p(x)/q(x))`` against the target's distribution ``p``
        after the emitted prefix, or after the earlier siblings' rejections its residual) or a draw
        from the residual ``norm(max(p - q, 0))`` after a rejection: the recursive rejection sampler
        makes each such token follow ``p`` given the prefix, exactly as with ``bonus=True``. The only
        difference is at a leaf, where ``bonus=True`` would draw the next token from the target's
        untouched distribution at the leaf, ``p(. | prefix, leaf)``. Skipping that draw defers it:
        the next call's root is the leaf, so its first decision (an accepted draft or a draw) is
        made against the same ``p(. | prefix, leaf)``, with fresh randomness independent of
        everything emitted so far. The stream of emitted tokens therefore has the same law as with
        ``bonus=True``: the target's, token by token (tests/test_verify_result.py checks this with
        chi-square tests). A rejected draft is never deferred: its residual draw is emitted now.

        Returns:
            :class:`VerifyResult`.
        """
        b, t = tree.tokens.shape
        per_row = isinstance(bonus, torch.Tensor)
        if per_row:
            if tuple(bonus.shape) != (b,) or bonus.dtype != torch.bool:
                raise ValueError(f"a per-row bonus must be a [B] = [{b}] bool tensor, got {tuple(bonus.shape)} "
                                 f"{bonus.dtype}")
            if bool((bonus & tree.valid[:, t - 1]).any()):
                raise ValueError("a row drawing a bonus token needs its leaf's logits: its node T-1 must be invalid")
        everywhere = not per_row and bool(bonus)
        rows = t if everywhere else t - 1
        if logits.dim() != 3 or tuple(logits.shape[:2]) != (b, rows):
            raise ValueError(f"logits must be [B, {'T' if rows == t else 'T-1'}, V] = [{b}, {rows}, V] for a tree of "
                             f"{t} nodes with bonus={'per row' if per_row else bonus}, got {tuple(logits.shape)}")
        if logits.numel():
            check_logits(logits)
        per_node = self.per_node if per_node is None else per_node
        # The kernels take T rows; node T-1's row (a zero row) is only read if that leaf is accepted, and
        # what it yields then (a next token) is dropped below.
        full = logits if rows == t else torch.cat([logits, logits.new_zeros(b, 1, logits.shape[2])], dim=1)
        argmax = topk_ids = topk_probs = None
        if self.cfg.greedy:
            path, path_len, nxt = kernels.tree_verify_greedy(tree.tokens, tree.parents, full, tree.valid)
            if per_node:
                argmax = torch.full((b, t), -1, dtype=torch.int64, device=logits.device)
                argmax[:, :rows] = node_argmax(logits)
        else:
            x = processed_logits(full, self.cfg)
            probs = x.softmax(-1)
            u = torch.rand(b, t + 1, generator=self.generator, device=logits.device)
            q = tree.draft_probs
            path, path_len, nxt = kernels.tree_verify_sampling(tree.tokens, tree.parents, probs,
                                                               None if q is None else q.probs, u, tree.valid,
                                                               None if q is None else q.ids)
            if per_node:
                topk_ids, topk_probs = self._node_topk(x, rows)
        if everywhere:
            has_next = torch.ones(b, dtype=torch.bool, device=nxt.device)
        else:
            has_next = ~ends_at_leaf(tree, path, path_len)
            if per_row:
                has_next |= bonus.to(has_next.device)
            nxt = torch.where(has_next, nxt, -1)
        return VerifyResult(path, path_len, nxt, has_next, argmax, topk_ids, topk_probs)

    def _node_topk(self, x: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k ids ``[B, T, k] int64`` and probs ``[B, T, k] fp32`` of ``softmax(x)`` for the processed
        logits ``x [B, T, V]`` (the distribution the sampler uses), rows from ``rows`` on blanked."""
        b, t, v = x.shape
        k = min(self.topk, v)
        # topk_entropy at temperature 1 of the processed logits: softmax(x), the filtered tokens at 0.
        probs, ids, _, _ = kernels.topk_entropy(x.reshape(b * t, v), k, 1.0)
        probs, ids = probs.view(b, t, k), ids.view(b, t, k)
        keep = probs > 0
        keep[:, rows:] = False
        return torch.where(keep, ids, -1), torch.where(keep, probs, 0.0)
