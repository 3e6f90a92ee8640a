"""specdec's learning-free drafters as vLLM speculative proposers (vLLM's ``custom_class`` hook).

One line of configuration, no fork and no patch of vLLM::

    LLM(model=..., speculative_config={"method": "custom_class", "num_speculative_tokens": 8,
                                       "model": "specdec.integrations.vllm.PromptLookupProposer"})

- :class:`PromptLookupProposer`: prompt lookup (``pld``), the continuation of the longest context
  n-gram match, from :func:`specdec.kernels.ngram_match`.
- :class:`NGrammysProposer`: N-Grammys' best chain, since vLLM verifies chains: of the drafts N-Grammys makes
  from context matches, the n-gram corpus and the model's bigram table, the path of their trie with the most
  expected accepted tokens by per-node estimates learned from vLLM's verification outcomes.

vLLM calls ``propose`` once per step for its whole batch; both proposers run the batch through one call
of specdec's batched kernels. Each request's draft length is cost-aware (``"adaptive": true``, the
default): acceptance estimates learned from vLLM's verification outcomes (prompt lookup's per match kind;
N-Grammys' per draft node) and the step cost fitted to vLLM's own step times
(:mod:`specdec.policies.batch_length`) decide how many tokens each request drafts, up to
``num_speculative_tokens``. With ``"history": true`` (the default) prompt lookup's acceptance model is also
kept per outcome of the request's own last verified draft (none yet, rejected, partly or wholly accepted): a
request that is copying its context goes on copying, one that is not rarely starts. (N-Grammys' node
estimates carry no outcome: with ``slots > 1`` ``history`` does not change its lengths.)

Options come from the environment variable ``SPECDEC_VLLM_OPTIONS`` (a JSON object), since vLLM's
speculative config takes no extra keys; unknown options fail at engine start. This module imports
torch and specdec's kernels only: vLLM is not imported (the proposer reads the ``VllmConfig`` it is
handed), and transformers only where the N-Grammys proposer first loads its tables.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from specdec import kernels, settings
from specdec.contracts import OUTCOMES, DecodeState, last_outcome, with_outcome
from specdec.policies.acceptance import AcceptanceModel
from specdec.policies.batch_length import LinearStepCost, plan_lengths

OPTIONS_ENV = "SPECDEC_VLLM_OPTIONS"
# A child of vLLM's own logger, so its lines appear where vLLM's do, in whichever process runs the proposer.
log = logging.getLogger("vllm.specdec")
LOG_EVERY = 500  # steps between the proposer's progress lines (level INFO)
KEY_TOKENS = 64  # a request's last tokens that, with its length, identify it across steps (request_key)


def read_options(defaults: dict, nullable: frozenset = frozenset(), env: str = OPTIONS_ENV) -> dict:
    """``defaults`` updated from the JSON object in ``$env``. A key not in ``defaults``, or a value of
    another type than its default's (``null`` only for the keys in ``nullable``), is a ``ValueError``
    that names the allowed options."""
    raw = (settings.get(env) or "").strip()
    if not raw:
        return dict(defaults)
    try:
        given = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"${env} must be a JSON object: {exc}") from exc
    if not isinstance(given, dict):
        raise ValueError(f"${env} must be a JSON object, got {type(given).__name__}")
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} in ${env}; allowed: {sorted(defaults)}")
    for key, value in given.items():
        want = type(defaults[key])
        if value is None and key in nullable:
            continue
        if not isinstance(value, want) or (want is not bool and isinstance(value, bool)):
            raise ValueError(f"option {key!r} in ${env} must be {want.__name__}, got {value!r}")
    return {**defaults, **given}


@dataclass
class ChainNodes:
    """Per chain of one :meth:`_ChainProposer.chains` call, its nodes' cells (what a proposer learns by) and
    their estimates of being accepted (reached), both ``R`` host lists of ``w`` (-1 / 0 past the chain)."""

    cells: list[list[int]]
    reach: list[list[float]]


class _ChainProposer:
    """What both proposers share: vLLM's call convention, per-request lengths and their bookkeeping.

    Subclasses implement :meth:`chains`: ``[R, w]`` drafts (-1 padded), ``[R]`` int signals (the match kind an
    acceptance model is kept for) and, for a proposer that learns per draft node, :class:`ChainNodes` (else
    None) for the ``R`` requests that draft this step. With nodes, each chain's length is planned from its
    nodes' own estimates, and :meth:`learn_nodes` gets the cells a step verified and how many of each chain
    it accepted; without, from the signal's acceptance model.
    """

    DEFAULTS: dict = {"adaptive": True, "history": True}
    HISTORY = OUTCOMES
    NULLABLE: frozenset = frozenset()

    def __init__(self, vllm_config):
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.vocab_size = int(vllm_config.model_config.get_vocab_size())
        self.model_path = str(vllm_config.model_config.model)
        self.tokenizer_path = str(getattr(vllm_config.model_config, "tokenizer", None) or self.model_path)
        self.options = read_options(self.DEFAULTS, self.NULLABLE)
        self.adaptive = bool(self.options["adaptive"])
        self.history = bool(self.options["history"])
        self._outcome: dict[int, int] = {}  # row -> its request's last verified draft's outcome (last_outcome)
        self.acceptance = AcceptanceModel()
        self.cost = LinearStepCost()
        # request_key -> (drafted, signal, outcome, node cells) of the request's draft last step; None where two
        # requests with one key drafted differently (neither learns from that step)
        self._last: dict[tuple[int, int], tuple | None] = {}
        self._last_rows = 0  # requests that drafted last step
        self._last_tokens = 0  # tokens the previous step verified (its rows' 1 + drafts)
        self._last_end: float | None = None
        self.stats = {"steps": 0, "rows": 0, "proposed": 0, "drafted": 0, "accepted": 0}
        self._propose_s = 0.0  # the proposer's own time over its steps (outside the step cost it fits)

    def load_model(self, *args, **kwargs) -> None:
        """vLLM hands its target model here; the chain proposers draft without it."""

    def chains(self, seq: torch.Tensor, lens: torch.Tensor, w: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                             "ChainNodes | None"]:
        raise NotImplementedError

    def learn_nodes(self, cells: list[list[int]], accepted: list[int]) -> None:
        """Per chain verified last step: its drafted nodes' cells (from :meth:`chains`) and how many were accepted."""

    @staticmethod
    def request_key(token_ids: np.ndarray, row: int, n: int) -> tuple[int, int]:
        """What identifies the request in batch ``row`` at length ``n`` from one step to the next: ``n`` and
        a hash of its last :data:`KEY_TOKENS` tokens. vLLM's hook passes no request ids, and vLLM moves
        requests to other rows when others finish, so a request is known by its tokens, not its row."""
        return n, hash(token_ids[row, max(0, n - KEY_TOKENS): n].tobytes())

    def _learn(self, sampled_token_ids: list[list[int]], num_tokens: np.ndarray, token_ids: np.ndarray,
               now: float) -> None:
        """Fold the outcome of the step vLLM just ran into the acceptance model and the step cost."""
        decoding = same = 0
        outcome: dict[int, int] = {}
        node_cells: list[list[int]] = []
        node_accepted: list[int] = []
        for row, sampled in enumerate(sampled_token_ids):
            if not sampled:
                continue
            decoding += 1
            # The same request, one verification later: the tokens it had then, now followed by what it sampled.
            before = int(num_tokens[row]) - len(sampled)
            prev = self._last.get(self.request_key(token_ids, row, before)) if before > 0 else None
            if prev is None:
                continue
            same += 1
            drafted, signal, was, cells = prev
            accepted = min(len(sampled) - 1, drafted)
            self.acceptance.observe(signal, drafted, accepted)
            if cells is not None and drafted > 0:
                node_cells.append(list(cells[:drafted]))
                node_accepted.append(accepted)
            self.stats["drafted"] += drafted
            self.stats["accepted"] += accepted
            outcome[row] = last_outcome(drafted, accepted, was)
        self._outcome = outcome
        if node_cells:
            self.learn_nodes(node_cells, node_accepted)
        # Time only steps that verified exactly the rows drafted for: one that also prefilled a request
        # (a new row, or a row not decoding) costs far more than its decode tokens.
        if self._last_end is not None and same == decoding == self._last_rows == len(sampled_token_ids) > 0:
            self.cost.observe(self._last_tokens, now - self._last_end)

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings=None, **_) -> list[list[int]]:
        """Draft tokens per request, as vLLM's ``NgramProposer.propose`` returns them.

        sampled_token_ids: per batch row, the tokens vLLM sampled last step (empty: the row does not
        decode now, e.g. a prefill in progress); num_tokens_no_spec: ``[>= B]`` tokens per row, those
        included; token_ids_cpu: ``[>= B, max_model_len]`` int32 token ids. Returns ``B`` lists of at
        most ``num_speculative_tokens`` ids."""
        now = time.perf_counter()
        self._learn(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, now)
        b = len(sampled_token_ids)
        out: list[list[int]] = [[] for _ in range(b)]
        lens_all = np.asarray(num_tokens_no_spec[:b], dtype=np.int64)
        rows = [i for i in range(b) if sampled_token_ids[i] and 0 < lens_all[i] < self.max_model_len]
        self._last, self._last_rows = {}, len(rows)
        if rows:
            lens = lens_all[rows]
            width = int(lens.max())
            seq = torch.from_numpy(np.ascontiguousarray(token_ids_cpu[rows, :width], dtype=np.int64))
            drafts, signals, nodes = self.chains(seq, torch.from_numpy(lens), self.k)
            room = np.minimum(self.max_model_len - lens, self.k)
            found = (drafts >= 0).sum(1).tolist()
            drafted = [min(int(f), int(r)) for f, r in zip(found, room)]
            signals = signals.tolist()
            if self.history:
                signals = [with_outcome(s, self._outcome.get(row, 0)) for s, row in zip(signals, rows)]
            if self.adaptive:
                reach = []
                for j, (n, s) in enumerate(zip(drafted, signals)):
                    if nodes is not None:
                        reach.append(nodes.reach[j][:n])
                    else:
                        beta, gamma = self.acceptance.params(s)
                        reach.append([beta * gamma ** i for i in range(n)])
                drafted = plan_lengths(reach, self.cost)
            draft_rows = drafts.tolist()
            for j, row in enumerate(rows):
                out[row] = draft_rows[j][: drafted[j]]
                key = self.request_key(token_ids_cpu, row, int(lens[j]))
                entry = (drafted[j], signals[j], self._outcome.get(row, 0),
                         None if nodes is None else tuple(nodes.cells[j][: drafted[j]]))
                # identical requests (one prompt twice, greedy) draft alike and share their entry
                self._last[key] = entry if self._last.get(key, entry) == entry else None
            self.stats["steps"] += 1
            self.stats["rows"] += len(rows)
            self.stats["proposed"] += sum(drafted)
            self._propose_s += time.perf_counter() - now
            if self.stats["steps"] % LOG_EVERY == 0:
                a, b = self.cost.coefficients()
                log.info("specdec %s: %s; step cost %.1f ms + %.2f ms/token (fitted: %s); proposer %.2f ms/step",
                         type(self).__name__, self.stats, 1e3 * a, 1e3 * b, self.cost.ready,
                         1e3 * self._propose_s / self.stats["steps"])
        self._last_tokens = sum(1 + len(out[r]) for r in rows)
        self._last_end = time.perf_counter()
        return out


class PromptLookupProposer(_ChainProposer):
    """Prompt lookup: the continuation of the longest suffix n-gram (``n_min .. n_max`` tokens) that occurred
    earlier in the request; the acceptance model is kept per matched n-gram size (and, with ``history``, per
    outcome of the request's last draft)."""

    DEFAULTS = {**_ChainProposer.DEFAULTS, "n_min": 1, "n_max": 4}

    def __init__(self, vllm_config):
        super().__init__(vllm_config)
        self.n_min, self.n_max = int(self.options["n_min"]), int(self.options["n_max"])
        if not 1 <= self.n_min <= self.n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got n_min={self.n_min}, n_max={self.n_max}")

    def chains(self, seq, lens, w):
        drafts, _, _, match_n = kernels.ngram_match(seq, lens, self.n_min, self.n_max, 1, w)
        return drafts[:, 0], match_n.long(), None


class NGrammysProposer(_ChainProposer):
    """N-Grammys' best chain per request. :class:`specdec.drafters.ngrammys.NGrammysDrafter` makes ``slots``
    drafts (longest-suffix context matches of ``q + 1 .. n_max`` tokens, the n-gram corpus's continuations,
    matches of the last ``q`` tokens, the model's extended bigram rows); merged into a trie, the root-to-leaf
    path with the most expected accepted tokens is the chain, by per-node estimates
    (:class:`specdec.policies.NodeAcceptance`: source, rank, depth and how many drafts share the node) learned
    from vLLM's verification of the chains. On the 96 dev replies this chain gets 2.26 tokens per call
    against 2.14 for the first draft alone (``python -m bench.studies.chain_choice``); ``slots = 1`` drafts that one.
    The chain is cut by cost with the same per-node estimates. The signal is the source of the draft the chain
    follows (with ``history``, split by the outcome of the request's last draft).

    Options: ``corpus``: ``"auto"`` (the shipped corpus made for this tokenizer's vocabulary, if any), a
    path to a corpus file (refused unless it was made for this vocabulary), or ``null``; ``bigram``: use
    the model's bigram table (computed once from the model with transformers and cached under
    ``$SPECDEC_CACHE/ngram_tables``); ``q``, ``n_max``: as in specdec's ``ngrammys``; ``slots``: how many
    drafts the chain is chosen among (1: the drafter's first, as before the choice was measured).
    """

    DEFAULTS = {**_ChainProposer.DEFAULTS, "q": 1, "n_max": 4, "corpus": "auto", "bigram": True, "slots": 10}
    NULLABLE = frozenset({"corpus"})

    def __init__(self, vllm_config):
        super().__init__(vllm_config)
        from specdec.drafters.ngrammys import NGrammysDrafter, corpus_slots
        from specdec.policies.acceptance import NodeAcceptance

        o = self.options
        self.slots = int(o["slots"])
        if self.slots < 1:
            raise ValueError(f"slots must be >= 1, got {self.slots}")
        tables = self._tables() if o["bigram"] else None
        if tables is not None:  # extended bigram rows fill the slots context matches leave
            self.slots = min(self.slots, tables.bigram.shape[1])
        corpus = self._corpus(o["corpus"])
        c = corpus_slots(self.slots, corpus is not None)
        self.drafter = NGrammysDrafter(tables, k=self.slots, w=self.k, q=int(o["q"]), n_max=int(o["n_max"]),
                                       strategy="mixed" if tables is not None else "context", verify="chain",
                                       corpus=corpus, c=c)
        self.nodes = NodeAcceptance(self.slots, self.k, int(o["q"]), int(o["n_max"]), corpus=c > 0)

    def _tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.tokenizer_path)

    def _corpus(self, spec):
        from specdec.ngram_corpus import NGramCorpus, shipped_corpus, vocab_fingerprint

        if spec is None:
            return None
        if spec == "auto":
            try:
                tok = self._tokenizer()
            except (OSError, ValueError):  # a model without a tokenizer has no shipped corpus
                return None
            corpus = shipped_corpus(tok)
        else:
            tok = self._tokenizer()
            corpus = NGramCorpus.load(spec)
            made_for = corpus.meta.get("vocab_fingerprint")
            if made_for != vocab_fingerprint(tok):
                raise ValueError(f"the n-gram corpus {spec} was made for another vocabulary than "
                                 f"{self.tokenizer_path}'s tokenizer: make one for this model")
        if corpus is not None and corpus.vocab != self.vocab_size:
            raise ValueError(f"the n-gram corpus has a vocabulary of {corpus.vocab} tokens, the model "
                             f"{self.vocab_size}")
        return corpus

    def _tables(self):
        from transformers import AutoModelForCausalLM

        from specdec.hub import tables_cache_dir
        from specdec.ngram_tables import load_tables

        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32).eval()
        vocab = model.get_output_embeddings().weight.shape[0]
        tables = load_tables(model, tables_cache_dir(), k_max=min(32, vocab), progress=False)
        del model
        if tables.bigram.shape[0] < self.vocab_size:
            raise ValueError(f"the bigram table covers {tables.bigram.shape[0]} tokens, the model {self.vocab_size}")
        return tables

    def chains(self, seq, lens, w):
        from specdec.drafters.ngrammys import best_chain

        state = DecodeState(seq, lens, lens.tolist())
        drafts, source, rank = self.drafter.drafts(state, w)
        if self.slots == 1:
            return drafts[:, 0], source[:, 0], None
        chain, owner, cells, reach = best_chain(state.roots, drafts, source, rank, self.drafter.w,
                                                self.nodes.estimate(drafts.device))
        return chain, source.gather(1, owner[:, None]).squeeze(1), ChainNodes(cells.tolist(), reach.tolist())

    def learn_nodes(self, cells, accepted):
        flat = [c for row in cells for c in row]
        hit = [j < a for row, a in zip(cells, accepted) for j in range(len(row))]
        self.nodes.observe(torch.tensor(flat), torch.tensor(hit))
