"""A dynamic store of past outputs: the target's replies of earlier generations, indexed for suffix lookup.

SuffixDecoding (Oliaro et al. 2024) keeps a global suffix tree of earlier outputs beside the per-request
one, and llama.cpp's lookup decoding merges a dynamic n-gram cache after every run: a workload of similar
requests repeats its answers' phrasing, and the model's own earlier words predict its next ones better than
any fixed table. :class:`SuffixStore` is that memory for specdec: every finished row's output is added, the
oldest outputs are evicted past a token bound, and the store is saved atomically and loaded with validation,
so it persists across requests and processes.

The index is two :class:`~specdec.ngram_corpus.NGramCorpus` tiers: ``base`` over the older outputs and
``recent`` over those added since ``base`` was built. Adding re-indexes ``recent`` only, and folds it into
``base`` once it holds a quarter of ``base``'s tokens, so indexing costs O(1) amortised per token added.
A lookup takes, per row, the tier with the longer matching suffix (``recent`` on a tie).
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from specdec.ngram_corpus import NGramCorpus

STORE_FORMAT = 1
MIN_FOLD = 4096  # tokens ``recent`` may hold before it is folded into ``base``, at the least


class SuffixStore:
    """Past outputs (token id lists, ids in ``[0, vocab)``), at most ``max_tokens`` tokens, oldest evicted first.

    n_max: longest suffix looked up; k_max: continuations kept per n-gram (the most frequent, ties to the
    latest); fingerprint: the tokenizer's vocabulary digest (:func:`specdec.ngram_corpus.vocab_fingerprint`)
    a saved store must carry to be loaded for it ("" where the model has no tokenizer).
    """

    def __init__(self, vocab: int, n_max: int = 4, k_max: int = 4, max_tokens: int = 65536, fingerprint: str = ""):
        if vocab < 1 or n_max < 1 or k_max < 1:
            raise ValueError(f"need vocab, n_max, k_max >= 1, got {vocab}, {n_max}, {k_max}")
        if max_tokens < 2:
            raise ValueError(f"max_tokens must be >= 2, got {max_tokens}")
        self.vocab, self.n_max, self.k_max, self.max_tokens = vocab, n_max, k_max, max_tokens
        self.fingerprint = fingerprint
        self.docs: list[list[int]] = []  # oldest first
        self._n_base = 0  # docs[:_n_base] are indexed in base, the rest in recent
        self.base: NGramCorpus | None = None
        self.recent: NGramCorpus | None = None
        self.added = 0  # documents added since the store was made (loaded ones not counted)

    @property
    def num_tokens(self) -> int:
        return sum(len(d) for d in self.docs)

    def __len__(self) -> int:
        return len(self.docs)

    def add(self, docs: list[list[int]]) -> None:
        """Store ``docs`` (token id lists; those shorter than two tokens are skipped) and re-index. Past the bound
        the oldest outputs go until a quarter of it is free, so the whole index is rebuilt once per quarter bound
        of new tokens rather than after every generation; a document longer than the bound keeps its last
        ``max_tokens`` tokens."""
        new = []
        for d in docs:
            d = [int(t) for t in d]
            if any(not 0 <= t < self.vocab for t in d):
                raise ValueError(f"suffix store token ids must lie in [0, {self.vocab})")
            if len(d) >= 2:
                new.append(d[-self.max_tokens:])
        if not new:
            return
        self.docs.extend(new)
        self.added += len(new)
        total, evicted = self.num_tokens, 0
        if total > self.max_tokens:
            while total > self.max_tokens * 3 // 4 and evicted < len(self.docs) - 1:
                total -= len(self.docs[evicted])
                evicted += 1
        if evicted:
            del self.docs[:evicted]
            self._n_base = 0  # the base tier held evicted outputs: index everything again
        self._reindex()

    def _reindex(self) -> None:
        base_tokens = sum(len(d) for d in self.docs[: self._n_base])
        recent_tokens = sum(len(d) for d in self.docs[self._n_base:])
        if recent_tokens > max(MIN_FOLD, base_tokens // 4) or self._n_base == 0:
            self._n_base = len(self.docs)
            self.base = self._index(self.docs)
            self.recent = None
        else:
            self.recent = self._index(self.docs[self._n_base:])

    def _index(self, docs: list[list[int]]) -> NGramCorpus | None:
        if not docs:
            return None
        return NGramCorpus.build(docs, self.vocab, self.n_max, self.k_max, meta={"suffix_store": True})

    def match(self, seq: torch.Tensor, seq_lens: torch.Tensor, k: int, w: int,
              n_max: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Drafts for each row's context suffix from the stored outputs, as :meth:`NGramCorpus.match`: seq
        ``[B, L]`` (row ``b`` valid up to ``seq_lens[b]``), k drafts of w tokens -> drafts ``[B, k, w]`` int64
        (-1 padded), how many ``[B]`` and the matched suffix length ``[B]`` (0: none)."""
        if k < 1 or w < 1:
            raise ValueError(f"need k, w >= 1, got {k}, {w}")
        b, dev = seq.shape[0], seq.device
        tiers = [t for t in (self.recent, self.base) if t is not None]
        if not tiers:
            zero = torch.zeros(b, dtype=torch.int64, device=dev)
            return torch.full((b, k, w), -1, dtype=torch.int64, device=dev), zero, zero.clone()
        drafts, count, match_n = tiers[0].match(seq, seq_lens, k, w, n_max)
        if len(tiers) == 1:
            return drafts, count, match_n
        old, old_count, old_n = tiers[1].match(seq, seq_lens, k, w, n_max)
        # per row: the longer suffix's drafts; on a tie the recent tier's, then the older tier's not among them
        tie = (old_n == match_n)[:, None, None]
        both = torch.cat([torch.where(old_n[:, None, None] > match_n[:, None, None], old, drafts),
                          torch.where(tie, old, -1)], 1)  # [B, 2k, w]
        earlier = torch.ones(2 * k, 2 * k, dtype=torch.bool, device=dev).tril(-1)
        repeat = ((both[:, :, None, :] == both[:, None, :, :]).all(-1) & earlier).any(-1) | (both[:, :, 0] < 0)
        order = torch.sort(repeat.to(torch.int8), dim=1, stable=True).indices[:, :k]
        drafts = torch.where(repeat.gather(1, order)[:, :, None], -1, both.gather(1, order[:, :, None].expand(-1, -1, w)))
        return drafts, (drafts[:, :, 0] >= 0).sum(-1), torch.maximum(match_n, old_n)

    # ---- persistence ------------------------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> None:
        """Write the stored outputs to ``path`` (``.npz``) atomically: a temporary file in the same folder, then
        a rename, so a failed save leaves the old file as it was."""
        path = Path(path)
        flat = np.array([t for d in self.docs for t in d], dtype=np.int32)
        lengths = np.array([len(d) for d in self.docs], dtype=np.int64)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, format=np.int32(STORE_FORMAT),
                         shape=np.array([self.vocab, self.n_max, self.k_max, self.max_tokens], dtype=np.int64),
                         fingerprint=np.array(self.fingerprint), tokens=flat, lengths=lengths)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike, vocab: int, fingerprint: str = "", n_max: int | None = None,
             k_max: int | None = None, max_tokens: int | None = None) -> "SuffixStore":
        """A store written by :meth:`save`, for a model of ``vocab`` tokens whose tokenizer has ``fingerprint``.

        ``n_max``, ``k_max``, ``max_tokens``: this configuration's (default the file's); a store loaded under a
        smaller bound keeps its newest outputs. A file that is not a suffix store, is truncated or damaged, or
        was made for another vocabulary raises ``ValueError``."""
        try:
            with np.load(path, allow_pickle=False) as z:
                data = {k: z[k] for k in z.files}
        except FileNotFoundError:
            raise
        except Exception as e:  # zip and npy format errors come in several types
            raise ValueError(f"{path}: not a readable suffix store file ({type(e).__name__}: {e})") from None
        need = {"format", "shape", "fingerprint", "tokens", "lengths"}
        if set(data) != need or data["format"].shape != () or int(data["format"]) != STORE_FORMAT:
            raise ValueError(f"{path}: not a suffix store file of format {STORE_FORMAT} (fields {sorted(data)})")
        if data["shape"].shape != (4,):
            raise ValueError(f"{path}: corrupt suffix store (shape field {data['shape'].shape})")
        v, n, k, bound = (int(x) for x in data["shape"])
        got_fp = str(data["fingerprint"])
        if v != vocab or (fingerprint and got_fp and got_fp != fingerprint):
            raise ValueError(f"{path}: this suffix store was made for another vocabulary ({v} tokens, fingerprint "
                             f"{got_fp[:8] or 'none'}); the model has {vocab} tokens, fingerprint "
                             f"{fingerprint[:8] or 'none'}")
        tokens, lengths = data["tokens"], data["lengths"]
        if (tokens.ndim != 1 or lengths.ndim != 1 or (lengths.size and lengths.min() < 2)
                or int(lengths.sum()) != tokens.size or (tokens.size and (tokens.min() < 0 or tokens.max() >= v))):
            raise ValueError(f"{path}: corrupt suffix store (document lengths or token ids out of range)")
        store = cls(v, n_max or n, k_max or k, max_tokens or bound, got_fp or fingerprint)
        docs = [d.tolist() for d in np.split(tokens.astype(np.int64), np.cumsum(lengths)[:-1])] if lengths.size else []
        store.add(docs)
        store.added = 0
        return store


def main(argv: list[str] | None = None) -> None:
    """``python -m specdec.suffix_store --from-corpus CORPUS --out FILE``: a store warmed with an n-gram corpus's
    documents (the target's replies to training prompts), for ``hybrid --store-file FILE``."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--from-corpus", required=True, help="an n-gram corpus file (specdec ngram-corpus)")
    ap.add_argument("--out", required=True, help="the store file to write")
    ap.add_argument("--max-tokens", type=int, default=65536, help="the store's bound (hybrid's --store-tokens)")
    ap.add_argument("--n-max", type=int, default=6, help="longest suffix looked up (hybrid's --n-max)")
    args = ap.parse_args(argv)
    corpus = NGramCorpus.load(args.from_corpus)
    cut = (corpus.tokens < 0).nonzero().flatten().tolist()
    docs, prev = [], 0
    for c in cut:
        docs.append(corpus.tokens[prev:c].tolist())
        prev = c + 1
    store = SuffixStore(corpus.vocab, args.n_max, max_tokens=args.max_tokens,
                        fingerprint=corpus.meta.get("vocab_fingerprint", ""))
    store.add(docs)
    store.save(args.out)
    print(f"{args.out}: {len(store)} outputs, {store.num_tokens} tokens (of {sum(map(len, docs))} in the corpus)")


if __name__ == "__main__":
    main()
