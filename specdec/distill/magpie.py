"""Prompts without a data set: the instruct target writes user turns itself (the Magpie recipe,
Xu et al. 2024).

Given only its chat template up to where the user's text begins, an instruct model continues with a
plausible user turn and closes it with its end-of-turn token. Sampled at a temperature, that gives
as many prompts as wanted, in the style of what the model was tuned on. Each candidate is then
filtered, in this order: it must end within the token budget (``unfinished``), be mostly ASCII
(``language``), have a sensible length (``length``), contain a common English word (``language``),
differ from every prompt kept so far
(``duplicate``), and share no word n-gram with the evaluation prompts (``dev_overlap``). The
survivors get a cheap keyword guess at their category, so held-out splits cover every kind.
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from specdec.distill.corpus import Corpus, Record
from specdec.distill.data import generate, name_seed

_SENTINEL = "\u2063specdec-user-turn\u2063"
_WORD = re.compile(r"[a-z0-9]+")
_ENGLISH = frozenset("the a an of to and in is are for on with that this it be what how why who which when where "
                     "can you your i my me please write explain give make list describe create find tell".split())

CATEGORIES = ("translation", "summarization", "code", "math", "rag", "writing", "qa", "other")
_RULES = [
    ("translation", re.compile(r"\btranslat|\b(into|in|to) (french|spanish|german|italian|chinese|japanese|"
                               r"portuguese|russian|arabic|english)\b", re.I)),
    ("summarization", re.compile(r"\bsummar|\btl;?dr\b|\bcondense\b|\bkey points\b", re.I)),
    ("code", re.compile(r"\b(python|javascript|java|c\+\+|sql|html|css|regex|function|code|program|script|"
                        r"algorithm|api|compile|debug|class|array|string)\b|def |```", re.I)),
    ("math", re.compile(r"\b(calculate|solve|equation|how many|how much|percent|probability|integral|derivative|"
                        r"sum of|average|area|volume|ratio)\b|\d+\s*[-+*/x^=]\s*\d+", re.I)),
    ("writing", re.compile(r"\b(write|compose|draft|create)\b.*\b(story|poem|essay|letter|email|blog|article|"
                           r"speech|song|post|review|script)\b", re.I | re.S)),
    ("qa", re.compile(r"^\s*(what|who|when|where|why|how|which|is|are|can|does|do)\b|\?\s*$", re.I)),
]


def guess_category(text: str) -> str:
    """A keyword guess among :data:`CATEGORIES`; long passages followed by a question count as ``rag``."""
    if len(text.split()) > 80 and "?" in text[-300:]:
        return "rag"
    for name, rule in _RULES:
        if rule.search(text):
            return name
    return "other"


def user_prefix(tokenizer) -> list[int]:
    """The chat template's ids up to where a user's text begins (system turn included, if any)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("Magpie prompts need an instruct model with a chat template; this tokenizer has none")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False,
                                         add_generation_prompt=False)
    if _SENTINEL not in text:
        raise ValueError("the chat template does not place the user's text verbatim; Magpie needs a prefix")
    return tokenizer(text[: text.index(_SENTINEL)], add_special_tokens=False)["input_ids"]


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


@dataclass
class PromptFilter:
    """The filters, with their state (what was kept so far) and counts of what each dropped.

    ``dev_texts``: prompts that must not leak into training; a candidate sharing a word ``n``-gram with
    one of them (or, when shorter than ``n`` words, appearing inside one) is dropped."""

    dev_texts: list[str] = field(default_factory=list)
    n: int = 8
    min_words: int = 3
    max_chars: int = 4000
    min_ascii: float = 0.95
    seen: set = field(default_factory=set)
    dropped: dict = field(default_factory=lambda: {k: 0 for k in ("unfinished", "length", "language", "duplicate",
                                                                    "dev_overlap")})

    def __post_init__(self):
        self._dev_words = [" ".join(words(t)) for t in self.dev_texts]
        self._dev_grams = {tuple(w[i:i + self.n]) for t in self.dev_texts for w in [words(t)]
                           for i in range(len(w) - self.n + 1)}

    def remember(self, text: str) -> None:
        self.seen.add(" ".join(words(text)))

    def reason(self, text: str, ended: bool) -> str | None:
        """Why ``text`` is dropped, or None to keep it (and remember it)."""
        if not ended:
            return "unfinished"
        if sum(c.isascii() for c in text) < self.min_ascii * len(text):
            return "language"
        w = words(text)
        if len(w) < self.min_words or len(text) > self.max_chars:
            return "length"
        if not _ENGLISH.intersection(w):
            return "language"
        key = " ".join(w)
        if key in self.seen:
            return "duplicate"
        if len(w) >= self.n:
            if any(tuple(w[i:i + self.n]) in self._dev_grams for i in range(len(w) - self.n + 1)):
                return "dev_overlap"
        elif any(key in d for d in self._dev_words):
            return "dev_overlap"
        self.seen.add(key)
        return None

    def check(self, text: str, ended: bool) -> bool:
        why = self.reason(text, ended)
        if why:
            self.dropped[why] += 1
        return why is None


def read_openings(path: str) -> list[tuple[str, str]]:
    """Task openings (JSON lines ``{"category": ..., "text": ...}``) that steer Magpie towards a kind of
    user turn: the target continues ``text`` after the user prefix (e.g. ``"Summarize: "`` makes it write an
    article to be summarised), and the turn is filed under ``category``."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("text"), str) or not row["text"].strip() \
                    or row.get("category") not in CATEGORIES:
                raise ValueError(f"{path}:{n}: an opening needs a non-empty \"text\" and a \"category\" among "
                                 f"{', '.join(CATEGORIES)}")
            out.append((row["category"], row["text"]))
    if not out:
        raise ValueError(f"{path} holds no opening")
    return out


def make_user_turns(model, tokenizer, corpus: Corpus, target_count: int, batch_size: int, max_tokens: int,
                    eos: set[int], pad_id: int, dev_texts: list[str] = (), temperature: float = 1.0,
                    top_p: float = 1.0, seed: int = 0, deadline: float | None = None, info: dict | None = None,
                    progress: bool = True, openings: list[tuple[str, str]] = ()) -> list[str]:
    """Add ``user_{i:04d}`` shards of filtered user turns until the corpus holds ``target_count``
    (or the deadline passes). Existing shards are read back into the duplicate filter first, so a
    resumed run filters as an uninterrupted one would. With ``openings`` ((category, text) pairs,
    :func:`read_openings`), shard ``i`` continues opening ``i mod len(openings)``: its turns begin with that
    text and take its category (the shard's manifest entry names it). Returns the names written."""
    if temperature <= 0:
        raise ValueError("Magpie samples user turns: the temperature must be positive")
    prefix = user_prefix(tokenizer)
    filt = PromptFilter(list(dev_texts))
    have = 0
    for s in corpus.shards("user"):
        for r in corpus.read(s["name"]):
            filt.remember(tokenizer.decode(r.ids.tolist()))
            have += 1
    written = []
    names = [s["name"] for s in corpus.shards("user")]
    i = max((int(n.split("_")[1]) for n in names), default=-1) + 1
    empty = 0
    bar = tqdm(total=target_count, initial=min(have, target_count), desc="user turns", unit="prompt",
               disable=not progress)
    while have < target_count:
        if deadline is not None and time.time() > deadline:
            bar.write(f"time budget reached with {have} of {target_count} user turns")
            break
        name = f"user_{i:04d}"
        t0 = time.perf_counter()
        torch.manual_seed(name_seed(name, seed))
        before = dict(filt.dropped)
        category, opening = openings[i % len(openings)] if openings else (None, "")
        head = tokenizer(opening, add_special_tokens=False)["input_ids"] if opening else []
        rows = generate(model, [prefix + head] * batch_size, max_tokens, pad_id, eos, temperature, top_p)
        records = []
        for j, (new, ended) in enumerate(rows):
            body = new[:-1] if ended else new
            text = tokenizer.decode(head + body, skip_special_tokens=True).strip()
            if filt.check(text, ended):
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
                records.append(Record(f"magpie-{i:04d}-{j:04d}", category or guess_category(text),
                                      torch.tensor(ids).numpy(), len(ids)))
        dropped = {k: filt.dropped[k] - before[k] for k in filt.dropped}
        steer = {"opening": opening, "opening_category": category} if openings else {}
        corpus.write(name, records, "user", sampling={"temperature": temperature, "top_p": top_p},
                     max_new_tokens=max_tokens, candidates=batch_size, dropped=dropped, **steer,
                     seconds=round(time.perf_counter() - t0, 1), **(info or {}))
        written.append(name)
        have += len(records)
        i += 1
        empty = 0 if records else empty + 1
        if empty >= 3:
            raise ValueError(f"three Magpie shards in a row kept no user turn (dropped: {dropped}); this target "
                             "does not write usable user turns with these settings (try a larger --magpie-tokens)")
        bar.update(min(len(records), max(0, target_count - bar.n)))
        bar.set_postfix(kept=f"{len(records)}/{batch_size}")
    bar.close()
    return written
