"""A model-derived n-gram corpus: the target's own greedy replies, indexed for suffix lookup.

The N-Grammys bigram table asks the model for its next token after one token and no context, and
those rows are seldom accepted. Text the model actually wrote in reply to real prompts carries the
phrases it keeps reusing ("Here's a ...", code idioms, answer formats). :class:`NGramCorpus` indexes
every n-gram (``n = 1 .. n_max``) of such replies with its most frequent continuations, so a decoding
step looks up its last ``n`` tokens and drafts what followed them. Drafts are only guesses: the
corpus never changes what is generated, only how many tokens a step accepts.

:func:`generate_corpus` builds the token lists with batched greedy decoding; the CLI's
``specdec ngram-corpus`` writes them to a file that :func:`NGramCorpus.load` reads and indexes.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

CORPUS_VERSION = 1


def max_exact_n(vocab: int, n_max: int) -> int:
    """The largest ``n <= n_max`` whose n-grams pack exactly into one int64 key (``vocab**n < 2**63``)."""
    n = 0
    while n < n_max and vocab ** (n + 1) < 2**63:
        n += 1
    return n


def pack_keys(windows: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[..., n]`` token ids -> ``[...]`` int64 keys ``sum_i t_i * vocab**(n-1-i)`` (exact, see :func:`max_exact_n`)."""
    key = torch.zeros(windows.shape[:-1], dtype=torch.int64, device=windows.device)
    for i in range(windows.shape[-1]):
        key = key * vocab + windows[..., i]
    return key


@dataclass
class NGramCorpus:
    """Suffix-lookup index over token lists (documents).

    ``tokens``: ``[N] int64``, the documents joined with ``-1`` separators (and ``-1`` at the end), so
    no n-gram or continuation crosses a document. Per ``n`` in ``1 .. n_max``: ``keys[n-1]`` ``[U_n]``
    sorted int64 n-gram keys and ``starts[n-1]`` ``[U_n, k_max]`` positions in ``tokens`` where each of
    that n-gram's ``k_max`` most frequent continuations (by their first ``span`` tokens; ties to the
    latest) begins, ``-1`` where there are fewer.
    """

    tokens: torch.Tensor
    vocab: int
    keys: list[torch.Tensor]
    starts: list[torch.Tensor]
    meta: dict = field(default_factory=dict)
    span: int = 4
    _copies: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _rows: list | None = field(default=None, init=False, repr=False, compare=False)  # per n: {key: table row}

    @property
    def n_max(self) -> int:
        return len(self.keys)

    @property
    def k_max(self) -> int:
        return self.starts[0].shape[1]

    @classmethod
    def build(cls, documents: list[list[int]], vocab: int, n_max: int = 4, k_max: int = 4, span: int = 4,
              meta: dict | None = None) -> "NGramCorpus":
        """Index ``documents`` (token id lists, ids in ``[0, vocab)``). ``n_max`` is lowered to the longest
        n-gram that packs exactly into an int64 key and has a continuation; ``span``: continuation tokens that tell two
        continuations apart when counting them."""
        longest = max((len(d) for d in documents), default=0)
        if longest < 2:
            raise ValueError("an n-gram corpus needs a document of at least two tokens")
        if n_max < 1 or k_max < 1 or span < 1:
            raise ValueError(f"need n_max, k_max, span >= 1, got {n_max}, {k_max}, {span}")
        flat = []
        for d in documents:
            if any(not 0 <= t < vocab for t in d):
                raise ValueError(f"corpus token ids must lie in [0, {vocab})")
            flat.extend(d)
            flat.append(-1)
        tokens = torch.tensor(flat, dtype=torch.int64)
        n_max = min(max_exact_n(vocab, n_max), longest - 1)  # every n-gram size then has a continuation
        span = min(span, max_exact_n(vocab + 1, span))
        pad = torch.cat([tokens, torch.full((span,), -1, dtype=torch.int64)])
        # The continuation key of position i: its next ``span`` tokens, a document's end and all after it
        # read as the id ``vocab``.
        ahead = pad.unfold(0, span, 1)[: tokens.numel()]
        ended = torch.cummax((ahead < 0).long(), -1).values.bool()
        cont = pack_keys(torch.where(ended, vocab, ahead), vocab + 1).numpy()
        keys, starts = [], []
        for n in range(1, n_max + 1):
            pos = torch.arange(n, tokens.numel())  # continuation starts; the n-gram is tokens[pos-n:pos]
            grams = tokens.unfold(0, n, 1)[: tokens.numel() - n]  # grams[i] = tokens[i:i+n], i = pos - n
            ok = (grams >= 0).all(-1) & (tokens[pos] >= 0)
            pos, grams = pos[ok], grams[ok]
            key = pack_keys(grams, vocab).numpy()
            c, p = cont[pos.numpy()], pos.numpy()
            # group equal (key, continuation); count and keep the latest start
            o = np.lexsort((p, c, key))
            key, c, p = key[o], c[o], p[o]
            last = np.ones(len(key), dtype=bool)
            last[:-1] = (key[1:] != key[:-1]) | (c[1:] != c[:-1])
            ends = np.flatnonzero(last)
            counts = np.diff(np.concatenate([[-1], ends]))
            gk, gp = key[ends], p[ends]
            o = np.lexsort((-gp, -counts, gk))  # per key: most frequent first, then latest
            gk, gp = gk[o], gp[o]
            uniq, first = np.unique(gk, return_index=True)
            rank = np.arange(len(gk)) - np.repeat(first, np.diff(np.concatenate([first, [len(gk)]])))
            table = np.full((len(uniq), k_max), -1, dtype=np.int64)
            sel = rank < k_max
            table[np.searchsorted(uniq, gk[sel]), rank[sel]] = gp[sel]
            keys.append(torch.from_numpy(uniq))
            starts.append(torch.from_numpy(table))
        return cls(tokens, vocab, keys, starts, dict(meta or {}), span)

    def _on(self, device: torch.device) -> tuple:
        if device == self.tokens.device:
            return self.tokens, self.keys, self.starts
        if device not in self._copies:
            self._copies[device] = (self.tokens.to(device), [k.to(device) for k in self.keys],
                                    [s.to(device) for s in self.starts])
        return self._copies[device]

    def match(self, seq: torch.Tensor, seq_lens: torch.Tensor, k: int, w: int,
              n_max: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Drafts for each row's context suffix from the corpus; the longest suffix found wins.

        seq: ``[B, L]`` token ids, row ``b`` valid up to ``seq_lens[b]``; k: drafts per row (at most
        ``k_max``); w: draft length; n_max: longest suffix tried (default the index's). Returns
        drafts ``[B, k, w]`` int64 (-1 padded, most frequent first), how many drafts ``[B]`` and the
        matched suffix length ``[B]`` (0: none). On the CPU the lookup is a dictionary probe per row
        and suffix length (a few microseconds); elsewhere a batched binary search on the device.
        """
        if k < 1 or w < 1:
            raise ValueError(f"need k, w >= 1, got {k}, {w}")
        top = self.n_max if n_max is None else min(n_max, self.n_max)
        k_eff = min(k, self.k_max)
        lens = seq_lens.to(device=seq.device, dtype=torch.int64)
        if seq.device.type == "cpu":
            found, match_n = self._find_host(seq, lens, k_eff, top)
        else:
            found, match_n = self._find_device(seq, lens, k_eff, top)
        tokens = self._on(seq.device)[0]
        b = seq.shape[0]
        count = (found >= 0).sum(-1)
        span = found[:, :, None] + torch.arange(w, device=seq.device)
        drafts = tokens.gather(0, span.clamp(0, tokens.numel() - 1).reshape(-1)).reshape(b, k_eff, w)
        drafts = torch.where((found[:, :, None] >= 0), drafts, -1)
        # a -1 separator ends a continuation: blank everything after it
        drafts = torch.where(torch.cummax((drafts < 0).long(), -1).values.bool(), -1, drafts)
        if k_eff < k:
            drafts = torch.cat([drafts, drafts.new_full((b, k - k_eff, w), -1)], 1)
        return drafts, count, match_n

    def _tails(self, seq: torch.Tensor, lens: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, n]`` last ``n`` tokens of each row and ``[B]`` whether they are all corpus ids."""
        idx = lens[:, None] - n + torch.arange(n, device=seq.device)[None]
        grams = seq.gather(1, idx.clamp(min=0)).long()
        return grams, (lens >= n) & (grams >= 0).all(-1) & (grams < self.vocab).all(-1)

    def _find_host(self, seq, lens, k: int, top: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rows is None:
            self._rows = [dict(zip(key.tolist(), range(key.numel()))) for key in self.keys]
        tails, _ = self._tails(seq, lens, top)
        found = torch.full((seq.shape[0], k), -1, dtype=torch.int64)
        match_n = torch.zeros(seq.shape[0], dtype=torch.int64)
        for b, (tail, length) in enumerate(zip(tails.tolist(), lens.tolist())):
            for n in range(min(top, length), 0, -1):
                gram = tail[top - n:]
                if not all(0 <= t < self.vocab for t in gram):
                    continue  # an id the corpus cannot hold: only shorter suffixes may match
                key = 0
                for t in gram:
                    key = key * self.vocab + t
                row = self._rows[n - 1].get(key)
                if row is not None:
                    found[b] = self.starts[n - 1][row, :k]
                    match_n[b] = n
                    break
        return found, match_n

    def _find_device(self, seq, lens, k: int, top: int) -> tuple[torch.Tensor, torch.Tensor]:
        _, keys, starts = self._on(seq.device)
        found = torch.full((seq.shape[0], k), -1, dtype=torch.int64, device=seq.device)
        match_n = torch.zeros(seq.shape[0], dtype=torch.int64, device=seq.device)
        for n in range(top, 0, -1):
            grams, valid = self._tails(seq, lens, n)
            key = pack_keys(grams.clamp(0, self.vocab - 1), self.vocab)
            at = torch.searchsorted(keys[n - 1], key).clamp(max=keys[n - 1].numel() - 1)
            hit = valid & (match_n == 0) & (keys[n - 1][at] == key)
            found = torch.where(hit[:, None], starts[n - 1][at, :k], found)
            match_n = torch.where(hit, n, match_n)
        return found, match_n

    def save(self, path: Path | str) -> None:
        """Write the documents (not the index, which :meth:`load` rebuilds in about a second)."""
        docs, cut = [], (self.tokens < 0).nonzero().flatten().tolist()
        prev = 0
        for c in cut:
            docs.append(self.tokens[prev:c].to(torch.int32))
            prev = c + 1
        lengths = torch.tensor([d.numel() for d in docs], dtype=torch.int64)
        torch.save({"version": CORPUS_VERSION, "vocab": self.vocab, "tokens": torch.cat(docs), "lengths": lengths,
                    "n_max": self.n_max, "k_max": self.k_max, "span": self.span, "meta": self.meta}, Path(path))

    @classmethod
    def load(cls, path: Path | str, data: dict | None = None) -> "NGramCorpus":
        """Read a corpus written by :meth:`save` (``data``: its contents, when already read) and index it."""
        data = torch.load(Path(path), weights_only=True) if data is None else data
        if data.get("version") != CORPUS_VERSION:
            raise ValueError(f"{path}: n-gram corpus version {data.get('version')}, expected {CORPUS_VERSION}")
        docs = [d.tolist() for d in torch.split(data["tokens"].long(), data["lengths"].tolist())]
        return cls.build(docs, int(data["vocab"]), int(data["n_max"]), int(data["k_max"]), int(data.get("span", 4)),
                         meta=data["meta"])


def vocab_fingerprint(tokenizer) -> str:
    """A digest of a tokenizer's vocabulary (string -> id): a corpus only fits models that share it."""
    items = sorted(tokenizer.get_vocab().items())
    return hashlib.blake2b(repr(items).encode(), digest_size=16).hexdigest()


SHIPPED = Path(__file__).parent / "data" / "ngram_corpus"


def shipped_corpus(tokenizer, folder: Path = SHIPPED) -> NGramCorpus | None:
    """The shipped corpus built for ``tokenizer``'s vocabulary, or None."""
    fp = vocab_fingerprint(tokenizer)
    for path in sorted(Path(folder).glob("*.pt")):
        data = torch.load(path, weights_only=True)
        if data.get("meta", {}).get("vocab_fingerprint") == fp:
            return NGramCorpus.load(path, data)
    return None


def generate_corpus(decoder, prompts: list[list[int]], max_new_tokens: int = 128, batch_size: int = 8,
                    progress: bool = False, meta: dict | None = None) -> NGramCorpus:
    """The target's greedy replies to ``prompts`` (token id lists), indexed as an :class:`NGramCorpus`.

    decoder: a :class:`specdec.api.SpecDecoder`; prompts run in batches of ``batch_size``, shortest
    first (less padding). Each document is a prompt's last 8 tokens (the turn's end, so a reply's first
    tokens have their context) followed by its reply."""
    if not prompts:
        raise ValueError("no prompts to generate a corpus from")
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    starts = range(0, len(order), batch_size)
    if progress:
        from tqdm import tqdm

        starts = tqdm(starts, desc="corpus replies", unit="batch")
    docs: list[list[int] | None] = [None] * len(prompts)
    for s in starts:
        batch = order[s: s + batch_size]
        res = decoder.generate_ids([prompts[i] for i in batch], "ar", max_new_tokens)
        for i, toks in zip(batch, res.tokens):
            docs[i] = list(prompts[i][-8:]) + list(toks)
    vocab = decoder.model.get_output_embeddings().weight.shape[0]
    info = {"documents": len(docs), "max_new_tokens": max_new_tokens, **(meta or {})}
    if getattr(decoder, "tokenizer", None) is not None:
        info["vocab_fingerprint"] = vocab_fingerprint(decoder.tokenizer)
    return NGramCorpus.build(docs, vocab, meta=info)
