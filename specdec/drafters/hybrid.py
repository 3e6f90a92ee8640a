"""``hybrid``: one tree per row from every model-free drafting source, cut by the one planner.

Each step a row's candidate drafts come from

- its own context (longest-suffix and last-``q`` matches) and the shipped n-gram corpus, as N-Grammys,
- a :class:`~specdec.suffix_store.SuffixStore` of earlier outputs that grows with every generation and
  persists across requests and processes (SuffixDecoding's global tree, llama.cpp's dynamic cache),
- token recycling (Luo et al. 2024): a :class:`SuccessorTable` ``[V, r]`` of the tokens the target wanted
  after each token at every node it verified, updated every step at no model cost,
- the model's bigram table for the slots left.

The candidates are ranked by source (long context matches, stored outputs, corpus, last-``q`` matches,
recycled successors, bigram rows), the first ``k`` form a trie, and every node carries the reach
estimate learned online for its cell (source and match length, rank, depth, how many drafts share it;
:class:`~specdec.policies.NodeAcceptance`), so the decode loop's planner keeps the nodes that pay for
their verification. Drafts are fixed tokens, verified as N-Grammys' are: the output is the target's.
"""
from __future__ import annotations

import torch

from specdec.contracts import DecodeState, num_cells, num_sources
from specdec.drafters.ngrammys import NGrammysDrafter
from specdec.suffix_store import SuffixStore
from specdec.tree import DraftTree

STORE_CONTEXT = 8  # prompt tokens stored before each output, so its first tokens have their context


class SuccessorTable:
    """``table [V, r] int64``: per token, the last ``r`` distinct tokens the target wanted right after it
    (its argmax when greedy, its likeliest tokens when sampling), newest first, -1 where fewer were seen."""

    def __init__(self, vocab: int, r: int = 4, device="cpu"):
        if vocab < 1 or r < 1:
            raise ValueError(f"need vocab, r >= 1, got {vocab}, {r}")
        # one row more than the vocabulary, all -1: indexing with -1 (no token) reads it, so a chain needs no masking
        self._rows = torch.full((vocab + 1, r), -1, dtype=torch.int64, device=device)

    @property
    def table(self) -> torch.Tensor:
        """``[V, r]`` the successors of each token."""
        return self._rows[:-1]

    @property
    def r(self) -> int:
        return self.table.shape[1]

    def on(self, device) -> torch.Tensor:
        """The ``[V + 1, r]`` rows (the last one all -1) on ``device``."""
        if self._rows.device != torch.device(device):
            self._rows = self._rows.to(device)
        return self._rows

    def observe(self, tokens: torch.Tensor, successors: torch.Tensor) -> None:
        """tokens: ``[N]`` ids; successors: ``[N, m]`` what the target wanted after each (likeliest first, -1
        for none). They go to the front of their token's row, repeats dropped (where one token occurs twice
        in ``tokens`` one of its observations is kept)."""
        keep = successors[:, 0] >= 0
        tokens, successors = tokens[keep], successors[keep]
        if not tokens.numel():
            return
        table = self.on(tokens.device)
        rows = torch.cat([successors, table[tokens]], 1)  # [N, m + r]
        n = rows.shape[1]
        earlier = torch.ones(n, n, dtype=torch.bool, device=rows.device).tril(-1)  # [i, j]: j before i
        repeat = ((rows[:, :, None] == rows[:, None, :]) & earlier).any(-1) | (rows < 0)
        order = torch.sort(repeat.to(torch.int8), dim=1, stable=True).indices[:, : self.r]
        table[tokens] = torch.where(repeat.gather(1, order), -1, rows.gather(1, order))

    def chains(self, roots: torch.Tensor, r: int, w: int) -> torch.Tensor:
        """``[B, r, w]`` drafts: successor ``i`` of each root, each followed by the newest successor of its
        last token, ``w`` tokens in all (-1 from the first token without one)."""
        table = self.on(roots.device)
        newest = table[:, 0]
        cols = [table[roots, :r]]
        for _ in range(w - 1):
            cols.append(newest[cols[-1]])  # -1 reads the all -1 row
        return torch.stack(cols, -1)


class HybridDrafter(NGrammysDrafter):
    """N-Grammys' ``k`` slots (context, corpus, bigram) plus ``s`` slots of stored past outputs and ``r`` of
    recycled successors, ranked by source and cut to ``k``; ``store`` and ``successors`` are learned across
    generations (the caller keeps them), ``store_file``: where the store is saved after every generation.

    The other arguments are :class:`~specdec.drafters.ngrammys.NGrammysDrafter`'s; ``acceptance`` must be a
    ``NodeAcceptance(k, w, q, n_max, corpus=c > 0, store=s > 0, recycle=r > 0)``.
    """

    KINDS = ("bigram", "context", "corpus", "store", "recycle")

    def __init__(self, tables, *, store: SuffixStore | None = None, s: int = 0,
                 successors: SuccessorTable | None = None, r: int = 0, store_file: str | None = None,
                 acceptance=None, **ngrammys):
        super().__init__(tables, acceptance=None, **ngrammys)
        if s < 0 or s > self.k or r < 0 or r > self.k:
            raise ValueError(f"store slots s and recycled slots r must lie in [0, k={self.k}], got s={s}, r={r}")
        if s and store is None:
            raise ValueError("store slots (s > 0) need a suffix store")
        if r and successors is None:
            raise ValueError("recycled slots (r > 0) need a successor table")
        if r and r > successors.r:
            raise ValueError(f"r={r} exceeds the successor table's width {successors.r}")
        self.store, self.s = (store if s else None), s
        self.successors, self.r = (successors if r else None), r
        self.store_file = store_file if s else None
        self.per_node = bool(r)  # recycling learns from the target's output at every verified node
        if acceptance is not None and acceptance.proposed.numel() != self.num_cells():
            raise ValueError(f"the acceptance table does not fit this drafter: build it with NodeAcceptance(k, w, q, "
                             f"n_max, corpus={self.c > 0}, store={s > 0}, recycle={r > 0})")
        self.acceptance = acceptance
        self._seq: torch.Tensor | None = None  # the last step's [B, L] tokens, read when rows leave
        self._lens: list[int] = []
        self._prompt_lens: list[int] = []
        self._outputs: list[list[int]] = []  # finished rows' outputs, stored when the generation ends

    def num_cells(self) -> int:
        return num_cells(self.k, self.w, self.q, self.n_max, self.c > 0, self.s > 0, self.r > 0)

    def _first_store_source(self) -> int:
        return num_sources(self.q, self.n_max, self.c > 0)

    def source_kind(self, source: int) -> int:
        store0 = self._first_store_source()
        if source < store0:
            return super().source_kind(source)
        return 3 if source < store0 + (self.n_max if self.s else 0) else 4

    def begin(self, state: DecodeState) -> None:
        super().begin(state)
        self._seq, self._lens = state.seq, list(state.seq_lens_host)
        self._prompt_lens = list(state.seq_lens_host)
        self._outputs = []

    def drafts(self, state: DecodeState, w: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[B,k,w]`` drafts (-1 padded), ``[B,k]`` each slot's source and ``[B,k]`` its rank within it, as
        :meth:`NGrammysDrafter.drafts`; the ranking puts the likelier sources first."""
        drafts, source, rank = super().drafts(state, w)
        b, k, dev = drafts.shape[0], self.k, drafts.device
        n_ctx = num_sources(self.q, self.n_max)
        # priority: 0 long context matches, 1 stored outputs, 2 corpus, 3 last-q matches, 4 recycled, 5 bigram
        prio = torch.where(source >= n_ctx, 2, torch.where(source >= 2, 0, torch.where(source == 1, 3, 5)))
        parts, prios, sources, ranks = [drafts], [prio], [source], [rank]
        store0 = self._first_store_source()
        if self.s:
            got, _, match_n = self.store.match(state.seq, state.seq_lens, self.s, w, self.n_max)
            parts.append(got)
            prios.append(torch.ones(b, self.s, dtype=torch.int64, device=dev))
            sources.append((store0 + match_n.to(dev) - 1).clamp(min=store0)[:, None].expand(b, self.s))
            ranks.append(torch.arange(self.s, device=dev)[None].expand(b, self.s))
        if self.r:
            parts.append(self.successors.chains(state.roots, self.r, w))
            prios.append(torch.full((b, self.r), 4, dtype=torch.int64, device=dev))
            sources.append(torch.full((b, self.r), store0 + (self.n_max if self.s else 0), dtype=torch.int64,
                                      device=dev))
            ranks.append(torch.arange(self.r, device=dev)[None].expand(b, self.r))
        if len(parts) == 1:
            return drafts, source, rank
        drafts, prio = torch.cat(parts, 1), torch.cat(prios, 1)
        prio = torch.where(drafts[:, :, 0] >= 0, prio, 6)  # empty slots last
        order = torch.sort(prio, dim=1, stable=True).indices[:, :k]
        drafts = drafts.gather(1, order[:, :, None].expand(-1, -1, w))
        # a slot's rank among its own source's drafts as ranked here (the cells' rank dimension is k wide)
        source, rank = torch.cat(sources, 1).gather(1, order), torch.cat(ranks, 1).gather(1, order)
        return drafts, source, rank.clamp(max=k - 1)

    def observe_verdict(self, tree: DraftTree, verdict) -> None:
        if self.successors is None:
            return
        if verdict.target_argmax is not None:
            wanted = verdict.target_argmax[..., None]
        else:
            wanted = verdict.target_topk_ids[..., : self.r]
        valid = tree.valid & (wanted[..., 0] >= 0)
        self.successors.observe(tree.tokens[valid], wanted[valid])

    def update(self, state: DecodeState, tree: DraftTree, path: torch.Tensor, path_len: list[int],
               drafted: list[int]) -> None:
        self._seq, self._lens = state.seq, list(state.seq_lens_host)  # kept for the rows that leave
        super().update(state, tree, path, path_len, drafted)

    def keep_rows(self, rows: list[int]) -> None:
        if self.store is None:  # nothing else is kept per row
            return
        kept = set(rows)
        self._harvest([r for r in range(len(self._prompt_lens)) if r not in kept])
        self._seq = self._seq.index_select(0, torch.tensor(rows, device=self._seq.device))
        self._lens = [self._lens[r] for r in rows]
        self._prompt_lens = [self._prompt_lens[r] for r in rows]

    def finish(self) -> None:
        """The store learns the generation's outputs at its end (one re-index per generation, and drafts within
        a generation do not depend on when other rows finished)."""
        self._harvest(range(len(self._prompt_lens)))
        self._prompt_lens, self._seq = [], None
        if self.store is not None:
            self.store.add(self._outputs)
            self._outputs = []
            if self.store_file is not None:
                self.store.save(self.store_file)

    def _harvest(self, rows) -> None:
        """Keep the outputs of ``rows`` (the last step's batch rows), each after its prompt's last tokens."""
        if self.store is None or self._seq is None:
            return
        for r in rows:
            start = max(0, self._prompt_lens[r] - STORE_CONTEXT)
            if self._lens[r] > self._prompt_lens[r]:
                self._outputs.append(self._seq[r, start: self._lens[r]].tolist())

    def summary(self) -> dict:
        out = super().summary()
        if self.store is not None:
            out["store"] = {"documents": len(self.store), "tokens": self.store.num_tokens}
        return out
