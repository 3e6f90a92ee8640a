"""A distillation corpus: the target's own text as compact token shards that accumulate across runs.

Layout of a corpus folder::

    manifest.json        target, its fingerprint, generation dtype, token dtype, one entry per shard
    {name}.npz           one shard: every record's token ids, concatenated

A shard holds ``tokens`` (``uint16`` when the vocabulary fits, else ``uint32``; ``[N]``), ``offsets``
(``int64 [R+1]``, record ``r`` is ``tokens[offsets[r]:offsets[r+1]]``), ``prompt_len`` (``int32 [R]``:
the first ``prompt_len`` ids are the prompt, the rest the target's reply) and ``meta`` (JSON: each
record's prompt id and category). Its manifest entry names its kind (``user`` turns written by the
target itself, or ``reply``), its sampling, the device and the command that made it.

One corpus belongs to one target, one generation dtype and one vocabulary: :meth:`Corpus.open` refuses
a mismatch with a clear error instead of mixing data. Shards are written to a temporary file and
renamed, then the manifest is rewritten the same way, so an interrupted run leaves whole shards only
and the next run resumes by skipping the names that exist. Nothing model-derived besides the ids is
stored: hidden states and soft labels are recomputed from the ids when training.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT = 1


class CorpusMismatch(ValueError):
    """The corpus was made by another target, dtype or vocabulary than this run's."""


@dataclass(frozen=True)
class Record:
    id: str               # the prompt's id (held-out splits are by prompt)
    category: str
    ids: np.ndarray       # [L] token ids: prompt then reply
    prompt_len: int


def target_fingerprint(model, tokenizer) -> dict:
    """What must match for two shards to describe the same target: the vocabulary size, a hash of
    the tokenizer's vocabulary and of the model's config (architecture and sizes)."""
    from specdec.ngram_corpus import vocab_fingerprint

    cfg = model.config.get_text_config()
    shape = {k: getattr(cfg, k, None) for k in ("model_type", "hidden_size", "num_hidden_layers",
                                                  "num_attention_heads", "num_key_value_heads", "intermediate_size")}
    return {"vocab_size": int(cfg.vocab_size),
            "tokenizer": vocab_fingerprint(tokenizer),
            "config_sha": hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]}


def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


class Corpus:
    """A corpus folder. Create or reopen one with :meth:`open`; read one with :meth:`load`."""

    def __init__(self, root: Path, manifest: dict):
        self.root = Path(root)
        self.manifest = manifest

    @classmethod
    def open(cls, root: str | Path, target: str, fingerprint: dict, gen_dtype: str) -> "Corpus":
        """Open ``root`` for writing, creating it if needed; raises :class:`CorpusMismatch` when it
        holds shards of another target, generation dtype or vocabulary."""
        root = Path(root)
        want = {"target": target, "fingerprint": fingerprint, "gen_dtype": gen_dtype}
        if (root / "manifest.json").exists():
            corpus = cls.load(root)
            have = {k: corpus.manifest[k] for k in want}
            diff = [k for k in ("target", "gen_dtype") if have[k] != want[k]] + \
                [f"fingerprint.{k}" for k in fingerprint if have["fingerprint"].get(k) != fingerprint[k]]
            if diff:
                raise CorpusMismatch(
                    f"corpus {root} holds shards of another target or dtype ({', '.join(diff)}: the corpus has "
                    f"{have}, this run {want}); use another --corpus folder rather than mixing them")
            return corpus
        vocab = int(fingerprint["vocab_size"])
        manifest = {"format": FORMAT, **want, "token_dtype": "uint16" if vocab <= 1 << 16 else "uint32",
                    "shards": []}
        root.mkdir(parents=True, exist_ok=True)
        corpus = cls(root, manifest)
        corpus._save_manifest()
        return corpus

    @classmethod
    def load(cls, root: str | Path) -> "Corpus":
        """A corpus for reading; checks the manifest's format and that every listed shard exists."""
        root = Path(root)
        path = root / "manifest.json"
        if not path.exists():
            raise FileNotFoundError(f"no corpus at {root} (no manifest.json): make one with `specdec corpus`")
        manifest = json.loads(path.read_text())
        if manifest.get("format") != FORMAT:
            raise ValueError(f"corpus {root} has format {manifest.get('format')!r}; this specdec reads format {FORMAT}")
        missing = [s["name"] for s in manifest["shards"] if not (root / f"{s['name']}.npz").exists()]
        if missing:
            raise ValueError(f"corpus {root}: the manifest lists shards that are not there: {missing[:5]}")
        return cls(root, manifest)

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["fingerprint"]["vocab_size"])

    def has(self, name: str) -> bool:
        return any(s["name"] == name for s in self.manifest["shards"])

    def shards(self, kind: str | None = None) -> list[dict]:
        """Manifest entries, in the order written, optionally of one kind."""
        return [s for s in self.manifest["shards"] if kind is None or s["kind"] == kind]

    def write(self, name: str, records: list[Record], kind: str, **info) -> dict:
        """Write shard ``name`` (``kind``: ``user`` or ``reply``; ``info``: sampling, device, command, ...)
        and list it in the manifest. A name already listed is an error (resume skips those)."""
        if self.has(name):
            raise ValueError(f"corpus {self.root} already has a shard {name!r}")
        if not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
            raise ValueError(f"shard names are letters, digits, '-', '_' and '.', got {name!r}")
        dtype = np.dtype(self.manifest["token_dtype"])
        lens = np.array([len(r.ids) for r in records], dtype=np.int64)
        tokens = np.concatenate([np.asarray(r.ids, dtype=np.int64) for r in records]) if records else np.zeros(0, np.int64)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            raise ValueError(f"token ids outside the vocabulary [0, {self.vocab_size}) in shard {name!r}")
        arrays = {"tokens": tokens.astype(dtype), "offsets": np.concatenate([[0], np.cumsum(lens)]),
                  "prompt_len": np.array([r.prompt_len for r in records], dtype=np.int32),
                  "meta": np.array(json.dumps([[r.id, r.category] for r in records]))}

        def save(tmp: Path) -> None:
            with open(tmp, "wb") as f:
                np.savez_compressed(f, **arrays)

        _write_atomic(self.root / f"{name}.npz", save)
        entry = {"name": name, "kind": kind, "records": len(records), "tokens": int(lens.sum()),
                 "reply_tokens": int(sum(len(r.ids) - r.prompt_len for r in records)), **info}
        self.manifest["shards"].append(entry)
        self._save_manifest()
        return entry

    def read(self, name: str) -> list[Record]:
        """The records of shard ``name``."""
        with np.load(self.root / f"{name}.npz") as z:
            tokens, offsets, plen = z["tokens"], z["offsets"], z["prompt_len"]
            meta = json.loads(str(z["meta"]))
        return [Record(meta[r][0], meta[r][1], tokens[offsets[r]:offsets[r + 1]].astype(np.int64), int(plen[r]))
                for r in range(len(plen))]

    def records(self, kind: str | None = None) -> list[Record]:
        return [r for s in self.shards(kind) for r in self.read(s["name"])]

    def reply_tokens(self, kind: str = "reply") -> int:
        return sum(s["reply_tokens"] for s in self.shards(kind))

    def _save_manifest(self) -> None:
        _write_atomic(self.root / "manifest.json", lambda tmp: tmp.write_text(json.dumps(self.manifest, indent=1)))
