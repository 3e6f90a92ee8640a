"""The method registry: one declaration per decoding method.

A :class:`Method` names the method, its options (a dataclass whose fields carry defaults, help and
allowed values), whether it needs a draft model, and how it builds, on a decoder, a :class:`Built`: its
drafter and length policy (or a decode loop of its own). ``SpecDecoder.generate_ids``, ``specdec generate``
(flags and ``--help``) and the ``specdec bench`` labels (``name:key=value:...``) are all derived from
:data:`REGISTRY`; adding a method means adding one declaration here (or calling :func:`register` from outside).

Builders receive a :class:`BuildContext` as ``dec`` (the decoder satisfies it) and use nothing else of
it, so this module does not import the API above it.
"""
from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, runtime_checkable

from specdec.contracts import LengthPolicy
from specdec.decoding import DecodeResult, tree_margin
from specdec.draft_models import is_feature_draft
from specdec.drafters import DraftModelDrafter, NGrammysDrafter, PromptLookupDrafter
from specdec.drafters.base import Drafter
from specdec.drafters.feature_draft import FeatureDraftDrafter
from specdec.drafters.graph_draft import SIBLINGS, GraphDrafter
from specdec.drafters.hybrid import HybridDrafter, SuccessorTable
from specdec.drafters.ouroboros import ATTACH, ORDERS, SOURCES, OuroborosDrafter, PhraseRates
from specdec.drafters.phrase_pool import PhrasePool
from specdec.drafters.ngrammys import STRATEGIES, VERIFY_MODES, corpus_slots
from specdec.model import ModelRunner
from specdec.ngram_corpus import vocab_fingerprint
from specdec.policies import (EXPLORE, AcceptanceModel, ConfidenceStop, DraftGovernor, HeuristicLength, NodeAcceptance,
                              ProbabilityCalibration, StaticLength, StepCost)
from specdec.policies.disco import DiscoClassifier, DiscoStop, OracleStop, PlattCalibration, draft_fingerprint
from specdec.pearl import PearlDecoding, WindowLength, one_thread
from specdec.suffix_store import SuffixStore
from specdec.verify import SamplingConfig


def option(default, help: str, choices: tuple | None = None, flag: str | None = None, cli: bool = True,
           low: float | None = 1, high: float | None = None, closed: bool = False):
    """A method option: a dataclass field with its help text, allowed values (``choices``, or numbers in
    ``[low, high)``, ``[low, high]`` when ``closed``; ``low=None`` for no bound), and CLI flag (default
    ``--name-with-dashes``; ``cli=False`` keeps it to bench labels and Python)."""
    return field(default=default, metadata={"help": help, "choices": choices, "flag": flag, "cli": cli,
                                            "low": low, "high": high, "closed": closed})


@dataclass(frozen=True)
class NoOptions:
    """A method without options."""


@dataclass(frozen=True)
class GovernedOptions:
    """Options of the methods a :class:`specdec.policies.DraftGovernor` may stop drafting for."""

    govern: int = option(1, "stop drafting while steps without a draft emit more tokens per second, measured "
                            "per batch size, and try drafting again later (specdec.policies.DraftGovernor); "
                            "0: always draft", (0, 1))
    explore: float = option(EXPLORE, "the governor's probe budget: the share of decode time a lost probe of drafting "
                                  "may cost before the next (DraftGovernor's explore)", low=0.001, high=1.0,
                            closed=True, cli=False)


@dataclass(frozen=True)
class PLDOptions(GovernedOptions):
    num_tokens: int = option(10, "longest draft")
    n_min: int = option(1, "shortest context n-gram matched", cli=False)
    n_max: int = option(4, "longest context n-gram matched")
    schedule: str = option("cost", "cost: cut each draft to the length with the most expected tokens per second "
                                   "(measured step cost, acceptance learned per matched n-gram size); static; "
                                   "heuristic (transformers' schedule)", ("cost", "static", "heuristic"))
    history: int = option(1, "cost schedule: keep acceptance per matched size and per outcome of the row's last "
                             "verified draft, rejected, partly or wholly accepted (1), or per matched size only (0)",
                          (0, 1))


@dataclass(frozen=True)
class SDOptions(GovernedOptions):
    draft_length: int = option(5, "draft tokens per step (heuristic: the starting length)")
    schedule: str = option("static", "static; heuristic (transformers' schedule: +2 after a fully accepted draft, "
                                     "else -1); disco (a trained classifier stops each row's draft, see "
                                     "--disco-mode); oracle (benchmarks only, greedy: drafts until the first token "
                                     "the target's own greedy run disagrees with)",
                           ("static", "heuristic", "disco", "oracle"))
    disco_mode: str = option("paper", "disco: paper (go on while the calibrated acceptance probability >= "
                                      "--disco-threshold) or cost (go on while one more token pays for its draft "
                                      "and verification cost, measured)", ("paper", "cost"))
    disco_threshold: float | None = option(None, "disco paper mode: the threshold (default: the classifier's, tuned "
                                                 "on a validation split)", low=0.0, high=1.0, closed=True)
    max_draft_length: int | None = option(None, "disco/oracle: the longest draft (default: disco the classifier's "
                                                "tuned maximum, oracle 32)")
    disco: str | None = option(None, "disco: the classifier file (default: the one shipped with the draft)")
    confidence: float = option(0.0, "stop a row's draft once the draft's top-1 probability falls below this "
                                    "(transformers' assistant_confidence_threshold; 0: off)", low=0.0, high=1.0)
    proposal_topk: int = option(64, "sampling: the draft samples from its k most likely tokens (renormalised), and "
                                    "verification reads those k probabilities per node")
    draft: str | None = option(None, "which loaded draft (--draft A,B loads several; default: the first)", cli=False)


@dataclass(frozen=True)
class NGrammysOptions(GovernedOptions):
    k: int = option(10, "drafts per step")
    w: int = option(6, "tokens per draft")
    q: int = option(1, "context query length")
    n_max: int = option(6, "longest suffix matched first (<= q turns that tier off)")
    strategy: str = option("mixed", "draft sources", STRATEGIES)
    verify: str = option("tree", "trie (tree), k branches (batch, the paper's batch rows), the first draft only "
                                 "(chain)", VERIFY_MODES)
    c: int | None = option(None, "drafts from the n-gram corpus per step (default 2 with a corpus, else 0)",
                           flag="--corpus-slots", low=0)
    support: int = option(1, "acceptance estimates per how many drafts share a node (1) or not (0)", (0, 1))
    schedule: str = option("cost", "cost: prune the trees to the nodes worth their measured verification "
                                   "cost (a batch's to one width for all rows); static: all k x w drafts, as in "
                                   "the paper", ("cost", "static"))


@dataclass(frozen=True)
class HybridOptions(GovernedOptions):
    k: int = option(10, "drafts per step, from all sources together")
    w: int = option(6, "tokens per draft")
    q: int = option(1, "context query length")
    n_max: int = option(6, "longest suffix matched first, in the context and in the store")
    c: int | None = option(None, "drafts from the n-gram corpus per step (default 2 with a corpus, else 0)",
                           flag="--corpus-slots", low=0)
    s: int = option(2, "drafts per step from the store of past outputs (0: no store)", low=0)
    r: int = option(2, "drafts per step from recycled successors, the target's top tokens after each verified "
                       "node (0: none)", low=0)
    store_tokens: int = option(65536, "tokens the store of past outputs keeps (the oldest go first)", low=2)
    store_file: str | None = option(None, "load the store of past outputs from this file when it is first made (if "
                                          "the file exists) and save it there after every generation")
    support: int = option(1, "acceptance estimates per how many drafts share a node (1) or not (0)", (0, 1))
    schedule: str = option("cost", "cost: prune the trees to the nodes worth their measured verification cost; "
                                   "static: all k x w drafts", ("cost", "static"))


@dataclass(frozen=True)
class GSDOptions(GovernedOptions):
    k: int = option(4, "candidates (top-k, or draws) per expanded node")
    tau: int = option(2, "preceding tokens a merge must match: a candidate whose (tau + 1)-gram already occurs in "
                         "the graph shares that node's successors", low=0)
    prob_threshold: float = option(0.2, "a node whose draft probability is below this is not expanded", low=0.0,
                                   high=1.0, closed=True)
    sibling_threshold: float = option(0.3, "nor one below this fraction of its best sibling's probability", low=0.0,
                                      high=1.0, closed=True)
    max_depth: int = option(10, "draft levels per step (one draft forward each)")
    max_nodes: int = option(32, "draft nodes per step, in the graph and in the unmerged tree")
    merge: int = option(1, "merge recurring n-grams (0: a plain top-k tree, the ablation)", (0, 1))
    siblings: str = option("topk", "topk: the k most likely tokens, verified one-hot; sample: k draws without "
                                   "replacement, each verified against the distribution it was drawn from "
                                   "(sampling only)", SIBLINGS)
    schedule: str | None = option(None, "cost: a node is expanded, and a level drafted, only where it may pay for "
                                        "the draft forward, and the planner keeps the nodes worth their measured "
                                        "verification cost (calibrated draft probabilities); static: the paper's "
                                        "rules alone, the whole unmerged tree up to max_nodes (default: cost with "
                                        "siblings=topk, static with siblings=sample)",
                                  ("cost", "static"))
    proposal_topk: int = option(64, "siblings=sample: the draft draws from its k most likely tokens (renormalised)")
    draft: str | None = option(None, "which loaded draft (default: the first)", cli=False)


@dataclass(frozen=True)
class OuroborosOptions(GovernedOptions):
    gamma: int = option(1, "chain tokens the draft model drafts per step")
    k: int = option(2, "pool phrases appended per attachment point (0: none)", low=0)
    phrase_len: int = option(4, "tokens per phrase (after its key token)")
    w: int = option(4, "lookahead window width W (the draft runs (W - 1) + (N - 2) W window nodes per forward)",
                    low=2)
    n: int = option(3, "lookahead level N: the window's n-grams have N tokens", low=3)
    capacity: int = option(8, "phrases the pool keeps per key token (FIFO, refreshed on hit)")
    n_verify: int = option(4, "pool phrases the draft checks after its last token in each forward", low=0)
    lookahead: int = option(0, "draft phrase by phrase: lookahead window and pool phrases in the draft's forwards "
                               "(0: one chain token per draft forward, as sd)", (0, 1))
    lengthen: int = option(1, "append pool phrases to the draft for the target to verify", (0, 1))
    verification: int = option(1, "feed the pool from verification: confirmed runs after rejected draft tokens, and "
                                  "the target's corrections of the phrases it tried", (0, 1))
    history: int = option(1, "keep the pool across generations (0: every generation starts cold)", (0, 1))
    context: int = option(1, "also feed the pool every committed token's next phrase_len tokens, prompt and output "
                             "(not in the paper)", (0, 1))
    attach: str = option("all", "where phrases hang: after the last chain token (the paper), or after the root and "
                                 "every chain token", ATTACH)
    order: str = option("recent", "which pool phrases come first: the newest (the paper) or the most often seen "
                                  "(newest among equals)", ORDERS)
    schedule: str | None = option(None, "cost: the planner keeps the nodes worth their measured verification cost "
                                        "(calibrated draft probabilities, measured phrase acceptance); static: the "
                                        "whole draft (default: cost when greedy, static when sampling)",
                                  ("cost", "static"))
    pool_file: str | None = option(None, "load the pool from this file when it is first made (if the file exists) "
                                         "and save it there after every generation")
    proposal_topk: int = option(64, "sampling: the draft samples from its k most likely tokens (renormalised)")
    draft: str | None = option(None, "which loaded draft (default: the first)", cli=False)


@dataclass(frozen=True)
class PearlOptions(GovernedOptions):
    gamma: int = option(3, "draft window per round (window=fixed), and the adaptive rule's first choice")
    window: str = option("adaptive", "adaptive: each round picks the window with the most expected tokens per "
                                     "second from the target's measured step cost, the draft's measured forward "
                                     "time and the acceptance so far; fixed: --gamma", ("adaptive", "fixed"))
    max_gamma: int = option(8, "adaptive: the longest window")
    pre_verify: int = option(1, "the target checks a fresh window's first token while the rest is drafted "
                                "(0: the ablation, a drafting-only round)", (0, 1))
    post_verify: int = option(1, "the draft drafts the next window while the target verifies (0: the ablation, "
                                 "verify alone and draw a bonus token)", (0, 1))
    backend: str = option("process", "process: the draft in a worker process on a core of its own (concurrent); "
                                     "inline: in this process, one after the other (the same outputs, no overlap)",
                          ("process", "inline"))
    proposal_topk: int = option(64, "sampling: the draft samples from its k most likely tokens (renormalised)")
    draft: str | None = option(None, "which loaded draft (default: the first)", cli=False)


class OwnLoop(Protocol):
    """A decode loop of a method's own (PEARL's, whose draft runs beside the target)."""

    needs_hidden: bool  # whether its draft reads the target's hidden states

    @property
    def margin(self) -> int:
        """Cache room past the longest sequence for one round's tokens."""
        ...

    def generate(self, target: ModelRunner, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingConfig,
                 eos_token_ids: set[int], governor: DraftGovernor | None) -> DecodeResult: ...


@runtime_checkable
class BuildContext(Protocol):
    """What a method's builder may use of the decoder it builds on: the models, measured costs, shared tables,
    and state learned across calls. ``SpecDecoder`` satisfies it; a test builds every method on a view exposing only these members."""

    model: Any  # the target (a transformers PreTrainedModel)
    runner: ModelRunner  # the target's runner
    tokenizer: Any  # the target's tokenizer (None where the decoder was given none)

    @property
    def compiled(self) -> bool:
        """Whether decoding runs through the compiled graphs now."""

    def get_draft(self, name: str | None = None) -> tuple[Any, ModelRunner]:
        """The draft model and its runner: the default one, or the one loaded as ``name``."""

    def draft_names(self) -> list[str]:
        """The loaded drafts' names, the default first."""

    def draft_seconds(self, name: str | None = None) -> float:
        """Seconds of one draft forward (one token), measured on first use per draft."""

    def draft_backend(self, name: str, kind: str = "process") -> tuple[Any, int | None]:
        """A backend drafting with draft ``name`` beside the target (PEARL) and the core it keeps to."""

    def step_cost(self) -> StepCost:
        """The target's measured step cost per tree size."""

    def ngram_tables(self) -> Any:
        """The target's unigram and bigram tables."""

    def ngram_corpus(self) -> Any:
        """The n-gram corpus (None: none)."""

    def disco_path(self, name: str) -> Path:
        """The DISCO classifier shipped with draft ``name``."""

    def reference_tokens(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        """The target's own greedy continuation of ``prompt`` (memoised)."""

    def references(self) -> dict[tuple[int, ...], list[int]]:
        """Every reference run so far (prompt tuple -> new tokens)."""

    def learned(self, key: tuple, make: Callable[[], Any]) -> Any:
        """The state stored under ``key`` (acceptance tables, phrase pools, calibrations), made by ``make()``
        on first use: methods learn across calls, one store per method and option set."""


@dataclass(frozen=True)
class Built:
    """What a method's ``build`` returns: a drafter and its length policy for the shared decode loop
    (:func:`specdec.decoding.speculative_generate`), or a ``loop`` of its own. Exactly one of ``drafter`` and
    ``loop`` is set."""

    drafter: Drafter | None = None
    policy: LengthPolicy | None = None
    loop: OwnLoop | None = None
    governor: dict = dataclasses.field(default_factory=dict)  # options of its DraftGovernor, where one governs it

    def __post_init__(self):
        if (self.drafter is None) == (self.loop is None):
            raise TypeError("a method builds a drafter (and its policy) or a loop of its own, exactly one")
        if (self.loop is None) == (self.policy is None):
            raise TypeError("a drafter comes with its length policy; a method's own loop keeps its own")

    @property
    def needs_hidden(self) -> bool:
        """Whether the draft reads the target's hidden states (the target then returns them)."""
        return (self.loop if self.loop is not None else self.drafter).needs_hidden

    @property
    def draft_nodes(self) -> int | None:
        """Nodes past the longest sequence that the draft model's own forwards grow (:attr:`Drafter.draft_nodes`;
        None for a loop of its own)."""
        return None if self.drafter is None else self.drafter.draft_nodes

    def margin(self, max_new_tokens: int) -> int:
        """Cache room past the longest sequence for one step's drafts."""
        if self.loop is not None:
            return self.loop.margin
        return tree_margin(self.drafter, self.policy, max_new_tokens)


@dataclass(frozen=True)
class Method:
    """A decoding method.

    build: ``(dec, options, sampling) -> Built``; None for plain autoregressive decoding.
    prepare: ``(dec, options, prompts, max_new_tokens, sampling) -> None``, work a method needs done for
    these prompts before it decodes (the oracle's reference runs); benchmarks call it outside the timed
    region, ``generate_ids`` before every call (it must be cheap when repeated).
    """

    name: str
    summary: str
    options: type = NoOptions
    needs_draft: bool = False
    build: Callable[[BuildContext, Any, SamplingConfig], Built] | None = None
    prepare: Callable[[BuildContext, Any, list[list[int]], int, SamplingConfig], None] | None = None

    def parse(self, given: dict) -> Any:
        """The options dataclass from ``given`` (name -> value; strings from labels are converted to
        the field's type). Unknown names and bad values raise ``ValueError``."""
        fields = {f.name: f for f in dataclasses.fields(self.options)}
        unknown = sorted(set(given) - set(fields))
        if unknown:
            known = ", ".join(fields) or "none"
            raise ValueError(f"unknown options for {self.name!r}: {unknown} (it takes: {known})")
        hints = typing.get_type_hints(self.options)
        values = {name: _convert(self.name, fields[name], _non_none(hints[name]), value) for name, value in given.items()}
        return self.options(**values)

    def fields(self) -> list[dataclasses.Field]:
        return list(dataclasses.fields(self.options))


def _non_none(hint) -> type:
    """The non-None type of an option's annotation (``int | None`` -> ``int``)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def _convert(method: str, f: dataclasses.Field, kind: type, value):
    if value is None:
        if f.default is not None:
            raise ValueError(f"{method}: option {f.name!r} needs a value")
        return None
    try:
        if kind is int and not isinstance(value, bool):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            out = int(value)
        elif kind is float:
            out = float(value)
        else:
            out = str(value)
    except (TypeError, ValueError):
        raise ValueError(f"{method}: option {f.name!r} must be {kind.__name__}, got {value!r}") from None
    choices = f.metadata.get("choices")
    if choices and out not in choices:
        raise ValueError(f"{method}: option {f.name!r} must be one of {', '.join(map(str, choices))}, got {value!r}")
    low, high = f.metadata.get("low"), f.metadata.get("high")
    if kind in (int, float) and not choices:
        closed = f.metadata.get("closed")
        if high is not None and not (low <= out <= high if closed else low <= out < high):
            raise ValueError(f"{method}: option {f.name!r} must be in [{low:g}, {high:g}{']' if closed else ')'}, "
                             f"got {value!r}")
        if low is not None and out < low:
            raise ValueError(f"{method}: option {f.name!r} must be >= {low:g}, got {value!r}")
    return out


# --- builders -------------------------------------------------------------------------------------

def _length_policy(schedule: str, k: int, max_k: int, cost: StepCost | None = None, stop=None):
    if schedule == "heuristic":
        return HeuristicLength(k, max_k=max_k, cost=cost, stop=stop)
    return StaticLength(k, cost=cost, stop=stop)


def _build_pld(dec: BuildContext, o: PLDOptions, sampling: SamplingConfig):
    cost = o.schedule == "cost"
    acceptance = dec.learned(("pld", o.history), AcceptanceModel) if cost else None
    drafter = PromptLookupDrafter(o.num_tokens, o.n_min, o.n_max, acceptance=acceptance, history=bool(o.history))
    policy = _length_policy(o.schedule, o.num_tokens, o.num_tokens, dec.step_cost() if cost else None)
    return Built(drafter, policy)


def _build_sd(dec: BuildContext, o: SDOptions, sampling: SamplingConfig):
    draft, runner = dec.get_draft(o.draft)
    cls = FeatureDraftDrafter if is_feature_draft(draft) else DraftModelDrafter
    drafter = cls(runner, sampling, o.proposal_topk)
    if o.schedule in ("static", "heuristic"):
        if o.disco_threshold is not None or o.max_draft_length is not None or o.disco is not None:
            raise ValueError("disco_threshold, max_draft_length and disco apply to schedule=disco or oracle")
        stop = ConfidenceStop(o.confidence) if o.confidence > 0 else None
        return Built(drafter, _length_policy(o.schedule, o.draft_length, 64, stop=stop))
    if o.confidence > 0:
        raise ValueError(f"confidence is its own stop rule; schedule={o.schedule} has another")
    if o.schedule == "oracle":
        if not sampling.greedy:
            raise ValueError("the oracle schedule is greedy only (it follows the target's greedy reference run)")
        return Built(drafter, StaticLength(o.max_draft_length or 32, stop=OracleStop(dec.references())))
    name = o.draft or dec.draft_names()[0]
    classifier = DiscoClassifier.load(o.disco or dec.disco_path(name), draft_fingerprint(draft))
    start = classifier.meta.get("calibration", (1.0, 0.0))
    calibration = dec.learned(("disco", name, o.disco), lambda: PlattCalibration(*start))  # learned across calls
    max_len = o.max_draft_length or int(classifier.meta.get("max_length", 8))
    cost = dec.step_cost() if o.disco_mode == "cost" else None
    seconds = dec.draft_seconds(name) if o.disco_mode == "cost" else None
    stop = DiscoStop(classifier, o.disco_mode, o.disco_threshold, calibration, cost, seconds)
    return Built(drafter, StaticLength(max_len, stop=stop))


def _prepare_sd(dec: BuildContext, o: SDOptions, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingConfig):
    if o.schedule == "oracle":
        for p in prompts:
            dec.reference_tokens(p, max_new_tokens)


def _build_ngrammys(dec: BuildContext, o: NGrammysOptions, sampling: SamplingConfig):
    c = o.c
    if c is None:  # a few corpus slots where the decoder has a corpus
        with_corpus = dec.ngram_corpus() is not None and o.strategy != "bigram"
        c = corpus_slots(o.k, with_corpus)
    o = dataclasses.replace(o, c=c)
    tables = dec.ngram_tables() if o.strategy != "context" else None
    cost = o.schedule == "cost"
    acceptance = None
    if cost:  # learned across calls, one table per option set
        key = ("ngrammys",) + tuple(sorted((f.name, getattr(o, f.name)) for f in dataclasses.fields(o)))
        acceptance = dec.learned(key, lambda: NodeAcceptance(o.k, o.w, o.q, o.n_max, corpus=c > 0))
    drafter = NGrammysDrafter(tables, k=o.k, w=o.w, q=o.q, n_max=o.n_max, strategy=o.strategy, verify=o.verify,
                              acceptance=acceptance, corpus=dec.ngram_corpus() if c else None, c=c,
                              support=bool(o.support))
    return Built(drafter, StaticLength(o.w, cost=dec.step_cost() if cost else None))


def _build_hybrid(dec: BuildContext, o: HybridOptions, sampling: SamplingConfig):
    corpus = dec.ngram_corpus()
    c = corpus_slots(o.k, corpus is not None) if o.c is None else o.c
    o = dataclasses.replace(o, c=c)
    vocab = dec.model.get_output_embeddings().weight.shape[0]
    # Learned across calls, one set per option set: labels that run side by side never read each other's state.
    key = ("hybrid", o)

    def make_store():
        fp = vocab_fingerprint(dec.tokenizer) if dec.tokenizer is not None else ""
        if o.store_file is not None and os.path.exists(o.store_file):
            return SuffixStore.load(o.store_file, vocab, fp, n_max=o.n_max, max_tokens=o.store_tokens)
        return SuffixStore(vocab, n_max=o.n_max, max_tokens=o.store_tokens, fingerprint=fp)

    store = dec.learned(key + ("store",), make_store) if o.s else None
    successors = dec.learned(key + ("successors",), lambda: SuccessorTable(vocab, max(o.r, 1))) if o.r else None
    cost = o.schedule == "cost"
    acceptance = dec.learned(key + ("acceptance",), lambda: NodeAcceptance(
        o.k, o.w, o.q, o.n_max, corpus=c > 0, store=o.s > 0, recycle=o.r > 0)) if cost else None
    drafter = HybridDrafter(dec.ngram_tables(), store=store, s=o.s, successors=successors, r=o.r,
                            store_file=o.store_file, acceptance=acceptance, k=o.k, w=o.w, q=o.q, n_max=o.n_max,
                            corpus=corpus if c else None, c=c, support=bool(o.support))
    return Built(drafter, StaticLength(o.w, cost=dec.step_cost() if cost else None))


def _build_gsd(dec: BuildContext, o: GSDOptions, sampling: SamplingConfig):
    draft, runner = dec.get_draft(o.draft)
    cls = FeatureDraftDrafter if is_feature_draft(draft) else DraftModelDrafter
    schedule = o.schedule or ("cost" if o.siblings == "topk" else "static")
    if schedule == "cost" and o.siblings == "sample":
        raise ValueError("siblings=sample runs with schedule=static: the planner keeps nodes by estimates that read "
                         "their own drawn values, which would bias the proposals they are verified with")
    calibration = cost = seconds = None
    if schedule == "cost":  # learned across calls, per draft and sampling configuration
        name = o.draft or dec.draft_names()[0]
        key = ("gsd", name, sampling.greedy, sampling.temperature, sampling.top_k, sampling.top_p)
        calibration = dec.learned(key, ProbabilityCalibration)
        cost, seconds = dec.step_cost(), dec.draft_seconds(name)
    drafter = GraphDrafter(cls(runner, sampling, o.proposal_topk), sampling, k=o.k, tau=o.tau,
                           prob_threshold=o.prob_threshold, sibling_threshold=o.sibling_threshold,
                           max_depth=o.max_depth, max_nodes=o.max_nodes, merge=bool(o.merge), siblings=o.siblings,
                           calibration=calibration, cost=cost, draft_seconds=seconds)
    return Built(drafter, StaticLength(o.max_depth, cost=cost))


def _build_ouroboros(dec: BuildContext, o: OuroborosOptions, sampling: SamplingConfig):
    draft, runner = dec.get_draft(o.draft)
    name = o.draft or dec.draft_names()[0]
    if is_feature_draft(draft):
        raise ValueError(f"ouroboros needs a plain draft model; {name!r} is feature-conditioned (EAGLE), and its "
                         "lookahead window would need the target's hidden state at every window node")
    schedule = o.schedule or ("cost" if sampling.greedy else "static")
    if schedule == "cost" and not sampling.greedy:
        raise ValueError("ouroboros samples with schedule=static: the planner would cut chain tokens by estimates "
                         "read off their own drawn values, which biases the proposals they are verified with")
    # One pool and one set of learned rates per draft, option set and sampling configuration: labels that run
    # side by side in a benchmark never read each other's phrases.
    key = ("ouroboros", name, o, sampling.greedy, sampling.temperature, sampling.top_k, sampling.top_p)
    vocab = dec.model.get_output_embeddings().weight.shape[0]

    def make_pool():
        if o.pool_file is not None and os.path.exists(o.pool_file):
            return PhrasePool.load(o.pool_file, vocab, o.capacity, o.phrase_len, max_source=len(SOURCES) - 1)
        return PhrasePool(vocab, o.capacity, o.phrase_len)

    pool = dec.learned(key + ("pool",), make_pool)
    calibration = dec.learned(key + ("calibration",), ProbabilityCalibration) if schedule == "cost" else None
    drafter = OuroborosDrafter(DraftModelDrafter(runner, sampling, o.proposal_topk), sampling, pool, gamma=o.gamma,
                               k=o.k, window=o.w, level=o.n, n_verify=o.n_verify, lookahead=bool(o.lookahead),
                               lengthen=bool(o.lengthen), verification=bool(o.verification),
                               history=bool(o.history), context=bool(o.context), attach=o.attach, order=o.order,
                               calibration=calibration,
                               rates=dec.learned(key + ("rates",), lambda: PhraseRates(o.phrase_len)),
                               pool_file=o.pool_file)
    depth = o.gamma + (o.phrase_len if o.lengthen and o.k else 0)
    return Built(drafter, StaticLength(depth, cost=dec.step_cost() if schedule == "cost" else None))


def _build_pearl(dec: BuildContext, o: PearlOptions, sampling: SamplingConfig):
    draft, _ = dec.get_draft(o.draft)
    name = str(o.draft) if o.draft is not None else dec.draft_names()[0]
    if is_feature_draft(draft):
        raise ValueError(f"pearl needs a plain draft model; {name!r} is feature-conditioned (EAGLE), and it would "
                         "need the target's hidden states of the very positions the target is verifying concurrently")
    if o.window == "adaptive" and o.gamma > o.max_gamma:
        raise ValueError(f"pearl: gamma ({o.gamma}) must be <= max_gamma ({o.max_gamma})")

    def make_window():
        if o.window == "fixed":
            return WindowLength(o.gamma)
        # costs on the one thread the target runs at, learned across calls
        cost = dec.learned(("pearl", "cost", dec.compiled), lambda: one_thread_cost(dec))
        return WindowLength(o.gamma, True, o.max_gamma, cost, dec.draft_seconds(name))

    largest = o.gamma if o.window == "fixed" else o.max_gamma
    positions = getattr(draft.config.get_text_config(), "max_position_embeddings", None)
    return Built(loop=PearlDecoding(lambda: dec.draft_backend(name, o.backend), make_window, largest,
                                    bool(o.pre_verify), bool(o.post_verify), o.proposal_topk, positions),
                 governor={"blocks": True})  # a round's window is verified by the next round


def one_thread_cost(dec: BuildContext) -> StepCost:
    """The target's step cost measured on one intra-op thread (the thread PEARL's target runs on)."""
    with one_thread():
        return StepCost.calibrate(dec.runner, sizes=tuple(range(1, 10)))


REGISTRY: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Add ``method`` to :data:`REGISTRY` (its name must be new)."""
    if method.name in REGISTRY:
        raise ValueError(f"method {method.name!r} is already registered")
    if not dataclasses.is_dataclass(method.options):
        raise TypeError(f"{method.name}: options must be a dataclass")
    REGISTRY[method.name] = method
    return method


register(Method("ar", "specdec's own autoregressive loop (preallocated KV cache, one token per target call)"))
register(Method("sd", "classic speculative decoding with a same-vocabulary draft model (--draft)", SDOptions, True,
                _build_sd, _prepare_sd))
register(Method("pld", "prompt lookup: the continuation of the longest matching context n-gram, cut to a "
                       "cost-aware length", PLDOptions, False, _build_pld))
register(Method("ngrammys", "N-Grammys: k drafts from context n-grams, the n-gram corpus and the model's bigram "
                            "table, merged into one trie", NGrammysOptions, False, _build_ngrammys))
register(Method("hybrid", "one trie from every model-free source: context n-grams, the n-gram corpus, a store of "
                          "past outputs kept across requests, recycled target successors and bigram rows, cut by "
                          "the cost planner", HybridOptions, False, _build_hybrid))
register(Method("gsd", "GSD: the draft model's top-k continuations grown level by level as a graph (recurring "
                       "n-grams merged, low-probability nodes not expanded), verified as one tree", GSDOptions, True,
                _build_gsd))

register(Method("pearl", "PEARL: the draft model drafts in a worker process on its own core while the target "
                         "verifies (pre-verify, post-verify), with an adaptive window", PearlOptions, True,
                _build_pearl))
register(Method("ouroboros", "Ouroboros: the draft model drafts phrase by phrase (lookahead window, phrase pool), "
                             "pool phrases lengthen the draft, verification and history feed the pool",
                OuroborosOptions, True, _build_ouroboros))


def get(name: str) -> Method:
    """The registered method ``name`` (a clear error listing the others if there is none)."""
    if name not in REGISTRY:
        raise ValueError(f"unknown method {name!r}: choose from {', '.join(REGISTRY)}")
    return REGISTRY[name]


def names() -> tuple[str, ...]:
    return tuple(REGISTRY)


def parse_label(label: str) -> tuple[str, dict[str, str]]:
    """``"ngrammys:k=5:strategy=context"`` -> ``("ngrammys", {"k": "5", "strategy": "context"})``
    (values stay strings; :meth:`Method.parse` types them)."""
    name, *pairs = label.split(":")
    opts: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"bad method option {pair!r} in {label!r}: use name=value")
        if key in opts:
            raise ValueError(f"option {key!r} given twice in {label!r}")
        opts[key] = value
    return name, opts


def __getattr__(name: str):
    if name == "METHODS":  # the registered names, as registered so far
        return names()
    raise AttributeError(name)
