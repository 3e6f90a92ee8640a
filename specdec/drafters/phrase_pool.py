"""Ouroboros' phrase pool: short token runs keyed by the token before them, bounded per key.

The layout is the one a GPU would hold: a fixed table ``phrases [V, G, P]`` (``G`` phrases of at most
``P`` tokens per key token, ``-1`` padded), ``lens [V, G]``, ``counts [V]`` and a last-touch stamp
``stamps [V, G]``. This is the CPU version, in numpy (per-insert work is a few small array operations;
a host-side torch op costs several times more per call).

Eviction is FIFO with refresh on hit, per key: inserting a phrase already there (or one that is a
prefix of a stored phrase) only refreshes it; a phrase that extends a stored one replaces it; a new phrase
takes a free slot or the least recently touched one. :meth:`lookup` returns the newest phrases first.
Each phrase counts its inserts (``seen [V, G] uint8``, saturating), so a lookup may rank by how often a
phrase occurred before how recently (``order="frequent"``). Each phrase carries a small source tag (``sources [V, G] int8``, e.g. the lookahead window or the target's
verification), which a drafter can learn acceptance by; a refresh keeps the higher of the two tags.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

FORMAT = 2


class PhrasePool:
    """Phrases keyed by a token id. vocab_size: ``V``; capacity: ``G`` phrases per key; phrase_len: ``P``."""

    def __init__(self, vocab_size: int, capacity: int = 8, phrase_len: int = 4):
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        if capacity < 1:
            raise ValueError(f"pool capacity must be >= 1, got {capacity}")
        if phrase_len < 1:
            raise ValueError(f"phrase length must be >= 1, got {phrase_len}")
        self.vocab_size, self.capacity, self.phrase_len = vocab_size, capacity, phrase_len
        self.phrases = np.full((vocab_size, capacity, phrase_len), -1, dtype=np.int32)
        self.lens = np.zeros((vocab_size, capacity), dtype=np.int16)
        self.stamps = np.zeros((vocab_size, capacity), dtype=np.int64)
        self.sources = np.zeros((vocab_size, capacity), dtype=np.int8)
        self.seen = np.zeros((vocab_size, capacity), dtype=np.uint8)
        self.counts = np.zeros(vocab_size, dtype=np.int16)
        self.clock = 0
        self.inserts = self.refreshes = self.lookups = self.hits = 0

    def __len__(self) -> int:
        return int(self.counts.sum())

    def clear(self) -> None:
        """Forget every phrase (the shapes stay)."""
        self.phrases.fill(-1)
        self.lens.fill(0)
        self.stamps.fill(0)
        self.sources.fill(0)
        self.seen.fill(0)
        self.counts.fill(0)
        self.clock = 0
        self.inserts = self.refreshes = self.lookups = self.hits = 0

    def _check_key(self, key: int) -> None:
        if not 0 <= key < self.vocab_size:
            raise ValueError(f"key token {key} is outside the pool's vocabulary of {self.vocab_size}")

    def insert(self, key: int, phrase, source: int = 0) -> None:
        """Add ``phrase`` (token ids, cut to ``P``) after ``key`` with tag ``source`` (0-127); see the module
        docstring for dedup and eviction."""
        self._check_key(key)
        p = np.asarray(phrase, dtype=np.int32)[: self.phrase_len]
        n = len(p)
        if n == 0:
            return
        if p.min() < 0 or p.max() >= self.vocab_size:
            raise ValueError(f"phrase tokens must be in [0, {self.vocab_size}), got {p.tolist()}")
        self.clock += 1
        c = int(self.counts[key])
        if c:
            lens = self.lens[key, :c].astype(np.int64)
            diff = self.phrases[key, :c, :n] != p  # [c, n]
            first = np.where(diff.any(1), diff.argmax(1), n)  # first mismatch
            agree = np.nonzero(first >= np.minimum(lens, n))[0]  # one is a prefix of the other
            if len(agree):
                s = int(agree[0])
                if lens[s] >= n:  # already stored (whole or as a prefix): refresh
                    self.stamps[key, s] = self.clock
                    self.seen[key, s] = min(255, int(self.seen[key, s]) + 1)
                else:  # this phrase extends the stored one
                    self._write(key, s, p, self.sources[key, s], int(self.seen[key, s]))
                self.sources[key, s] = max(int(self.sources[key, s]), source)
                self.refreshes += 1
                return
        slot = c if c < self.capacity else int(self.stamps[key].argmin())
        if c < self.capacity:
            self.counts[key] = c + 1
        self._write(key, slot, p, source)
        self.inserts += 1

    def remove(self, key: int, phrase) -> bool:
        """Drop the stored phrase equal to ``phrase`` after ``key`` (the key's last slot fills the hole).
        Returns whether it was there."""
        self._check_key(key)
        p = np.asarray(phrase, dtype=np.int32)
        c = int(self.counts[key])
        n = len(p)
        if c == 0 or not 0 < n <= self.phrase_len:
            return False
        found = np.nonzero((self.lens[key, :c] == n) & (self.phrases[key, :c, :n] == p).all(1))[0]
        if not len(found):
            return False
        s, last = int(found[0]), c - 1
        for a in (self.phrases, self.lens, self.stamps, self.sources, self.seen):
            a[key, s] = a[key, last]
        self.phrases[key, last] = -1
        for a in (self.lens, self.stamps, self.sources, self.seen):
            a[key, last] = 0
        self.counts[key] = last
        return True

    def replace(self, key: int, old, new, source: int = 0) -> None:
        """Put ``new`` in place of ``old`` after ``key`` (a plain insert when ``old`` is not stored)."""
        self.remove(key, old)
        self.insert(key, new, source)

    def _write(self, key: int, slot: int, p: np.ndarray, source: int, seen: int = 0) -> None:
        self.phrases[key, slot] = -1
        self.phrases[key, slot, : len(p)] = p
        self.lens[key, slot] = len(p)
        self.stamps[key, slot] = self.clock
        self.sources[key, slot] = source
        self.seen[key, slot] = min(255, seen + 1)

    def lookup(self, key: int, k: int | None = None, order: str = "recent") -> list[list[int]]:
        """Up to ``k`` (default all) phrases after ``key``: newest first (``order="recent"``), or the most often
        inserted first, newest first among equals (``"frequent"``)."""
        return [p for p, _, _ in self.lookup_tagged(key, k, order)]

    def lookup_tagged(self, key: int, k: int | None = None, order: str = "recent") -> list[tuple[list[int], int, int]]:
        """Up to ``k`` ``(phrase, source, times inserted)`` triples after ``key``, in ``order`` (see :meth:`lookup`)."""
        self._check_key(key)
        self.lookups += 1
        c = int(self.counts[key])
        if c == 0 or k == 0:
            return []
        self.hits += 1
        if order == "recent":
            rank = np.argsort(-self.stamps[key, :c], kind="stable")
        elif order == "frequent":
            rank = np.lexsort((-self.stamps[key, :c], -self.seen[key, :c].astype(np.int64)))
        else:
            raise ValueError(f"order must be 'recent' or 'frequent', got {order!r}")
        return [(self.phrases[key, s, : self.lens[key, s]].tolist(), int(self.sources[key, s]), int(self.seen[key, s]))
                for s in rank[: k if k is not None else c]]

    def stats(self) -> dict:
        """Counters since the pool was made or cleared (JSON-serialisable)."""
        return {"phrases": len(self), "keys": int((self.counts > 0).sum()), "inserts": self.inserts,
                "refreshes": self.refreshes, "lookups": self.lookups, "hits": self.hits}

    # ---- persistence ------------------------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> None:
        """Write the pool's non-empty keys to ``path`` (``.npz``), atomically: a temporary file in the same
        folder, then a rename, so the file is never half-written."""
        path = Path(path)
        keys = np.nonzero(self.counts)[0].astype(np.int32)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, format=np.int32(FORMAT), shape=np.array([self.vocab_size, self.capacity, self.phrase_len]),
                         keys=keys, phrases=self.phrases[keys], lens=self.lens[keys], stamps=self.stamps[keys],
                         sources=self.sources[keys], seen=self.seen[keys], counts=self.counts[keys], clock=np.int64(self.clock))
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike, vocab_size: int | None = None, capacity: int | None = None,
             phrase_len: int | None = None, max_source: int = 127) -> "PhrasePool":
        """A pool saved by :meth:`save`. Given sizes must match the file's (a clear error otherwise); a file
        that is not a pool, is damaged, or tags a phrase with a source above ``max_source`` raises
        ``ValueError``."""
        try:
            with np.load(path, allow_pickle=False) as z:
                data = {k: z[k] for k in z.files}
        except FileNotFoundError:
            raise
        except Exception as e:  # zip / npy format errors come in several types
            raise ValueError(f"{path}: not a readable phrase pool file ({type(e).__name__}: {e})") from None
        need = {"format", "shape", "keys", "phrases", "lens", "stamps", "sources", "seen", "counts", "clock"}
        if set(data) != need or int(data["format"]) != FORMAT:
            raise ValueError(f"{path}: not a phrase pool file of format {FORMAT} (fields {sorted(data)})")
        v, g, p = (int(x) for x in data["shape"])
        for name, want, got in (("vocabulary", vocab_size, v), ("capacity", capacity, g), ("phrase length", phrase_len, p)):
            if want is not None and want != got:
                raise ValueError(f"{path}: the pool's {name} is {got}, this configuration needs {want}")
        keys = data["keys"]
        n = len(keys)
        shapes = {"phrases": (n, g, p), "lens": (n, g), "stamps": (n, g), "sources": (n, g), "seen": (n, g), "counts": (n,)}
        if any(data[k].shape != s for k, s in shapes.items()) or (n and (keys.min() < 0 or keys.max() >= v)):
            raise ValueError(f"{path}: corrupt phrase pool (array shapes or keys do not fit {v}x{g}x{p})")
        counts, lens, phrases = data["counts"], data["lens"], data["phrases"]
        used = np.arange(g)[None] < counts[:, None] if n else np.zeros((0, g), dtype=bool)  # [n, G] filled slots
        if n and (counts.min() < 1 or counts.max() > g or lens.max() > p or lens[used].min() < 1
                  or data["seen"][used].min() < 1 or data["sources"].min() < 0 or data["sources"].max() > max_source
                  or phrases.max() >= v or phrases.min() < -1):
            raise ValueError(f"{path}: corrupt phrase pool (counts, lengths, tags or token ids out of range)")
        pool = cls(v, g, p)
        pool.phrases[keys], pool.lens[keys], pool.stamps[keys], pool.counts[keys] = phrases, lens, data["stamps"], counts
        pool.sources[keys], pool.seen[keys] = data["sources"], data["seen"]
        pool.clock = int(data["clock"])
        return pool
