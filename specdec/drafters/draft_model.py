"""Classic speculative decoding: a smaller same-vocabulary causal LM drafts a chain."""
from __future__ import annotations

import contextlib

import torch

from specdec.drafters.base import Budget, DecodeState, Drafter
from specdec.model import ModelRunner, model_label
from specdec.tree import DraftTree, SparseProbs
from specdec.verify import SamplingConfig, check_logits, processed_logits

# Catch-ups wider than this (a prompt a draft's prefill did not read, or the tokens of many skipped plain steps;
# never a drafting step's accepted tokens) compute each row's last logits only; a fresh draft's longer prompts are
# read by prefill (DraftModelDrafter.read_prompt).
CATCH_UP_ALL_LOGITS = 64
# Draft cache room past the longest sequence beyond the nodes a drafter reserves (a chain's tokens).
DRAFT_CACHE_SLACK = 8


class DraftModelDrafter(Drafter):
    """Drafts ``k`` tokens one forward at a time with its own preallocated cache.

    Greedy: the draft's argmax (deterministic proposals). Sampling: tokens drawn from ``q``, the
    draft's processed distribution restricted to its ``proposal_topk`` most likely tokens and
    renormalised; ``q`` travels to verification as those ``k`` probabilities per node
    (:class:`SparseProbs`), so rejection sampling stays exact without a vocabulary-wide row per node.
    The draft cache keeps every committed token it has seen; after verification it rolls back to
    the accepted prefix, so each step feeds it only the 1-2 tokens it has not seen yet.

    Each row drafts up to its ``budget.max_depth``; with a ``budget.stop`` rule, a row stops as soon as
    the rule says so after one of its tokens (the token stays in the draft). Drafting ends when no row
    goes on.

    Reduced-vocabulary drafts (a ``draft_vocab [Vd]`` buffer of target ids and a ``reduced_logits()``
    context, as ``specdec distill`` makes) run in their cheap mode: argmax / sampling over the draft
    vocabulary, mapped back to target ids.
    """

    keeps_rows = True  # keep_rows moves its per-row state: the draft cache and its lengths

    def __init__(self, runner: ModelRunner, sampling: SamplingConfig, proposal_topk: int = 64):
        if proposal_topk < 1:
            raise ValueError(f"proposal_topk must be >= 1, got {proposal_topk}")
        self.runner = runner
        self.sampling = sampling
        self.proposal_topk = proposal_topk
        self.generator = torch.Generator(device=runner.device)
        self.generator.manual_seed((sampling.seed if sampling.seed is not None else torch.seed()) + 7919)
        model = runner.model
        self.vocab_map: torch.Tensor | None = getattr(model, "draft_vocab", None)  # draft id -> target id
        self._reduced = model.reduced_logits if self.vocab_map is not None else contextlib.nullcontext
        self.target_vocab = model.config.get_text_config().vocab_size
        self.draft_nodes = 0  # raised by reserve()

    def max_tree_size(self, depth: int) -> int:
        return 1 + depth

    @property
    def margin(self) -> int:
        """Draft cache room past the longest sequence: the reserved nodes and :data:`DRAFT_CACHE_SLACK`."""
        return self.draft_nodes + DRAFT_CACHE_SLACK

    def keep_rows(self, rows: list[int]) -> None:
        self.runner.keep_rows(rows)  # nothing is pending: update() rolled the draft cache back

    def begin(self, state: DecodeState) -> None:
        super().begin(state)
        self.runner.reset(state.seq.shape[0], state.seq.shape[1] + self.margin)

    # ---- the model-draft component: what drafters built on one draft model (GSD, Ouroboros) call ----

    @property
    def seen(self) -> list[int]:
        """Per row, the committed tokens the draft cache holds (host ints, ``[B]``): the next catch-up starts there."""
        return self.runner.lengths_host

    def reserve(self, nodes: int) -> None:
        """Make room in the draft cache, from the next :meth:`begin`, for ``nodes`` pending nodes past the longest
        sequence (a drafter that grows trees or windows in the draft's pending region needs more than a chain)."""
        self.draft_nodes = max(self.draft_nodes, nodes)

    def forward_mode(self):
        """The context the draft's forwards run in: its reduced-vocabulary head where it has one."""
        return self._reduced()

    def root_positions(self) -> torch.Tensor:
        """``[B]`` the position of each row's last committed token in the draft cache (a tree grown in the pending
        region sits at these plus its nodes' depths)."""
        return self.runner.lengths - 1

    def forward_pending(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                        return_hidden: bool = False, extra_inputs: dict | None = None):
        """One draft forward over ``tokens [B, F]`` grown in the draft cache's pending region
        (:meth:`specdec.model.ModelRunner.forward_pending`), counted in :attr:`draft_calls`."""
        self.draft_calls += 1
        return self.runner.forward_pending(tokens, positions, mask, return_hidden, extra_inputs)

    def forward_tree(self, tree: DraftTree, logits_at: list[int] | None = None):
        """One draft forward over ``tree`` after the committed tokens (:meth:`specdec.model.ModelRunner.forward_tree`),
        counted in :attr:`draft_calls`."""
        self.draft_calls += 1
        return self.runner.forward_tree(tree, logits_at=logits_at)

    def commit(self, path: torch.Tensor, path_len: torch.Tensor, counts: list[int]) -> None:
        """Commit the nodes ``path [B, N]`` (``path_len [B]`` of them, ``counts`` on the host) of the last
        :meth:`forward_tree` to the draft cache: :attr:`seen` grows by ``counts``."""
        self.runner.commit(path, path_len, False, counts)

    def pick(self, logits: torch.Tensor) -> tuple[torch.Tensor, SparseProbs | None]:
        """The drafted token ``[B]`` (target ids) from the draft's logits ``[B, V]`` and, when sampling,
        the proposal it was drawn from (``[B, 1, k]``)."""
        if self.sampling.greedy:
            top, tok = logits.max(-1)
            if not bool(torch.isfinite(top).all()):  # the maximum comes with the argmax: the check is free here
                self.check(logits)
            return (tok if self.vocab_map is None else self.vocab_map[tok]), None
        self.check(logits)
        # Over a reduced vocabulary this is the distribution over full logits with -inf outside it
        # (temperature, top-k and top-p never select a -inf logit), then mapped back to target ids.
        q = SparseProbs.top_k(processed_logits(logits, self.sampling)[:, None], self.proposal_topk)
        if self.vocab_map is not None:
            q = q.map_ids(self.vocab_map)
        return q.sample(self.generator)[:, 0], q

    def check(self, logits: torch.Tensor) -> None:
        """Raise ``FloatingPointError`` where the draft's ``logits [..., V]`` name no token (NaN, +inf, a row all
        -inf; :func:`specdec.verify.check_logits`): a sampled draft's probabilities divide the target's."""
        check_logits(logits, f"the draft {model_label(self.runner.model)}")

    def fits(self, state: DecodeState, depth: int) -> bool:
        """Whether every row's context and ``depth`` drafted tokens lie within the draft's own
        ``max_position_embeddings`` (which may be shorter than the target's). Past it the drafters built on this
        one draft nothing, and decoding goes on one target token a step, exactly as ``ar``: a draft fed positions
        it has no embedding for would fail, or draft from positions it never learned."""
        return max(state.seq_lens_host) + depth <= self.runner.max_positions

    def propose(self, state: DecodeState, budget: Budget) -> DraftTree:
        with self.forward_mode():
            return self._propose(state, budget)

    def _propose(self, state: DecodeState, budget: Budget) -> DraftTree:
        max_len = budget.depth
        if max_len < 1 or not self.fits(state, max_len):
            return DraftTree.chain(state.roots)
        b = state.seq.shape[0]
        dev = state.seq.device
        logits, hidden = self.catch_up(state)
        tokens, probs = [], []
        # Rows still drafting; None while every row drafts to the same depth and no rule may stop one.
        depth = budget.row_depth(dev)
        going = None if budget.stop is None and min(budget.max_depth) == max_len else depth > 0
        for i in range(max_len):
            tok, q = self.pick(logits)
            if going is not None:
                tok = tok.masked_fill(~going, -1)  # a stopped row's chain ends at its first -1
                if budget.stop is not None:
                    going = going & budget.stop.keep_going(i + 1, logits, tok)
                going = going & (depth > i + 1)
            tokens.append(tok)
            probs.append(q)
            if going is not None and not bool(going.any()):
                break
            if i + 1 < max_len:
                logits, hidden = self.runner.forward_tree(DraftTree.chain(tok.clamp(min=0)), self.needs_hidden,
                                                          self.step_inputs(hidden))
                logits = logits[:, 0]
                hidden = hidden[:, 0] if hidden is not None else None
                self.runner.commit(torch.zeros(b, 1, dtype=torch.int64, device=dev),
                                   torch.ones(b, dtype=torch.int64, device=dev), True, [1] * b)
                self.draft_calls += 1
        drafts = torch.stack(tokens, dim=1)
        q = None if self.sampling.greedy else SparseProbs.cat(probs)
        return DraftTree.chain(state.roots, drafts, q)

    def catch_up(self, state: DecodeState) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed the committed tokens the draft has not seen (the root, and the previous step's accepted
        drafts and next token; a long prompt first through :meth:`read_prompt`) in one forward and commit them.
        Returns the draft's logits ``[B,V]`` and (``needs_hidden``) last hidden state ``[B,H]`` at each row's root."""
        self.read_prompt(state)
        b = state.seq.shape[0]
        dev = state.seq.device
        seen = self.seen
        todo = [state.seq_lens_host[r] - seen[r] for r in range(b)]
        width = max(todo)
        idx = torch.tensor(seen, device=dev)[:, None] + torch.arange(width, device=dev)
        pad = torch.arange(width, device=dev)[None] >= torch.tensor(todo, device=dev)[:, None]
        chunk = state.seq.gather(1, idx.clamp(max=state.seq.shape[1] - 1)).masked_fill(pad, -1)
        catch_up = DraftTree.chain(chunk[:, 0], chunk[:, 1:])
        # A prompt-sized catch-up computes logits at each row's last node only: [B, W, V] of them would be the
        # largest transient of a draft-model call (and a tenth of its prompt forward's work).
        cols = sorted({t - 1 for t in todo}) if width > CATCH_UP_ALL_LOGITS else None
        logits, hidden = self.runner.forward_tree(catch_up, self.needs_hidden, self.catch_up_inputs(idx), cols)
        last = torch.tensor(todo, device=dev) - 1
        rows = torch.arange(b, device=dev)
        logits = logits[rows, last if cols is None else torch.tensor([cols.index(t - 1) for t in todo], device=dev)]
        hidden = hidden[rows, last] if hidden is not None else None
        counts = torch.tensor(todo, device=dev)
        self.runner.commit(torch.arange(width, device=dev).expand(b, width), counts, True, todo)
        self.draft_calls += 1
        return logits, hidden

    def read_prompt(self, state: DecodeState) -> None:
        """Before the first catch-up of a generation (an empty draft cache), read each row's committed tokens but
        its root with the runner's prefill, which encodes ragged prompts row by row where padding them to the
        longest would waste most of the forward; the catch-up then feeds the roots. 16 dev prompts of 43-711
        tokens: the draft read them in 1.37 s as one padded chain, in 0.45 s by prefill, and the first drafting
        step paid for it. A short context (at most :data:`CATCH_UP_ALL_LOGITS`: one chain, the compiled graph) and
        a feature-conditioned draft (its forwards read the target's states beside the tokens) are left to the
        catch-up."""
        lens = state.seq_lens_host
        if self.needs_hidden or any(self.seen) or max(lens) <= CATCH_UP_ALL_LOGITS or min(lens) < 2:
            return
        self.runner.prefill(state.padded()[:, :-1], state.seq_lens - 1)
        self.draft_calls += 1

    def catch_up_inputs(self, positions: torch.Tensor) -> dict | None:
        """Extra model inputs for the catch-up nodes at ``positions [B,W]`` (none for a plain draft)."""
        return None

    def frontier_inputs(self, hidden: torch.Tensor | None) -> dict | None:
        """Extra model inputs for ``F`` new nodes of a tree, given their parents' draft hidden states
        ``[B,F,H]`` (none for a plain draft)."""
        return None

    def step_inputs(self, hidden: torch.Tensor | None) -> dict | None:
        """Extra model inputs for the next drafted token, given the draft's last hidden state ``[B,H]``."""
        return None

    def valid_prefix(self, state: DecodeState) -> list[int]:
        """Draft cache entries still valid after verification: the committed prefix the draft has
        computed, i.e. up to the last accepted draft token it has seen (``state`` now includes the
        accepted tokens and the next token)."""
        return [min(seen, total - 1) for seen, total in zip(self.seen, state.seq_lens_host)]

    def rollback(self, keep: list[int]) -> None:
        """Forget the draft cache past ``keep`` tokens per row (host ints, ``[B]``), as :meth:`valid_prefix` says."""
        self.runner.rollback(keep)

    def update(self, state: DecodeState, tree: DraftTree, path: torch.Tensor, path_len: list[int],
               drafted: list[int]) -> None:
        self.rollback(self.valid_prefix(state))
