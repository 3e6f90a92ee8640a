"""The Python entry points: :class:`SpecDecoder` (load once, generate many) and :func:`generate`."""
from __future__ import annotations

import contextlib
import copy
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel

from specdec import memory, methods
from specdec.decoding import DecodeResult, DecodeStats, autoregressive_generate, speculative_generate
from specdec.draft_models import is_feature_draft, warm_up_inputs
from specdec.draft_weights import DRAFT_WEIGHTS, quantize_draft
from specdec.draft_worker import ConcurrentDraft, InlineDraft, ProcessDraft
from specdec.hub import DEFAULT_MODEL, DRAFTS, cache_dir, load_model, tables_cache_dir
from specdec.model import ModelRunner
from specdec.ngram_corpus import NGramCorpus, shipped_corpus, vocab_fingerprint
from specdec.ngram_tables import NGramTables, load_tables
from specdec.prompts import encode_prompt
from specdec.policies import DraftGovernor, StepCost
from specdec.verify import SamplingConfig
from specdec.warmup import BackgroundCompile, compile_mode, use_persistent_cache


@dataclass
class GenerateOutput:
    text: str | None
    tokens: list[int]
    stats: DecodeStats


def eos_ids(model: PreTrainedModel, tokenizer=None) -> set[int]:
    """The ids that end generation, as transformers' ``generate`` sees them."""
    eos = model.generation_config.eos_token_id
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}


def check_same_vocab(target: PreTrainedModel, draft: PreTrainedModel, target_tok=None, draft_tok=None) -> None:
    """Raise unless target and draft share one vocabulary (same ids for the same strings, same logit width)."""
    vt = target.get_output_embeddings().weight.shape[0]
    vd = draft.get_output_embeddings().weight.shape[0]
    if vt != vd:
        raise ValueError(f"draft vocabulary ({vd} logits) differs from the target's ({vt}): a same-tokenizer draft is required")
    if target_tok is not None and draft_tok is not None and target_tok.get_vocab() != draft_tok.get_vocab():
        raise ValueError("draft tokenizer differs from the target's: a same-tokenizer draft is required")


def warm_up(runner: ModelRunner, beside_feature_draft: bool = False, draft: bool = False) -> None:
    """Compile ``runner`` (:meth:`ModelRunner.warm_up`) for the forwards that decoding runs on it: a
    feature-conditioned draft's take zero target states beside the tokens and return hidden states; a
    target's return them too where ``beside_feature_draft`` (sd with such a draft reads them), and not
    for the other methods; a ``draft``'s include its drafter's catch-up of a short prompt (compiled, unlike
    a target's prefill: without it each fresh cache compiled that graph inside the first generation on a
    short prompt, 13-39 s on the embedded draft); a reduced-vocabulary draft runs in its reduced-logits mode,
    as its drafter runs it. A failure raises, naming the model."""
    model = runner.model
    # A reduced-vocabulary draft is run in the mode its drafter runs it in (DraftModelDrafter).
    with model.reduced_logits() if getattr(model, "draft_vocab", None) is not None else contextlib.nullcontext():
        if is_feature_draft(model):
            runner.warm_up(warm_up_inputs(model), return_hidden=True)
        else:
            runner.warm_up(return_hidden=(False, True) if beside_feature_draft else False, catch_up=draft)


def check_inductor_overrides(overrides: dict | None) -> dict | None:
    """A caller's inductor options as a new dict (None stays None), checked against ``torch._inductor.config``: a
    name that is no option raises ``ValueError``, a value of another type than the option's default (a bool for a
    bool, an int for an int, an int or float for a float, a string for a string) raises ``TypeError``. Not checked:
    a None value (some options take it), and options whose default is None or of another type (tuples, callables),
    whose type the config does not record; inductor rejects those when it compiles."""
    if overrides is None:
        return None
    if not isinstance(overrides, dict):
        raise TypeError(f"compile_options must be a dict of inductor options, got {type(overrides).__name__}")
    import torch._inductor.config as inductor_config

    known = inductor_config.get_config_copy()
    unknown = [k for k in overrides if k not in known]
    if unknown:
        raise ValueError(f"compile_options: no inductor option named {', '.join(map(repr, unknown))} "
                         "(torch._inductor.config names, dotted for nested ones, e.g. 'cpp_wrapper', 'cpp.threads')")
    for name, value in overrides.items():
        default = known[name]
        if value is None or default is None:
            continue
        kinds = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}.get(type(default))
        if kinds and (not isinstance(value, kinds) or (isinstance(value, bool) and type(default) is not bool)):
            raise TypeError(f"compile_options: {name!r} takes {type(default).__name__} values (default {default!r}), "
                            f"got {value!r}")
    return dict(overrides)


def inductor_options(device_type: str, overrides: dict | None) -> dict:
    """specdec's inductor options for ``device_type`` (:func:`specdec.compile_passes.compile_options`) with a
    caller's ``overrides`` set over them, checked by :func:`check_inductor_overrides`."""
    from specdec.compile_passes import compile_options

    return {**compile_options(device_type), **(check_inductor_overrides(overrides) or {})}


def runner_options(model: torch.nn.Module, overrides: dict | None) -> dict:
    """The inductor options of ``model``'s runner: :func:`inductor_options` for the device its parameters are on (a
    draft on another device than the target gets that device's defaults, not the target's)."""
    return inductor_options(next(model.parameters()).device.type, overrides)


class SpecDecoder:
    """A target model (and optional draft) ready for speculative generation.

    ``model``/``draft``: a name (``smollm2``, ``gemma3-270m``), a local folder, or a loaded
    ``PreTrainedModel`` (then pass ``tokenizer`` to work with text). ``corpus``: the n-gram corpus ngrammys
    drafts from besides the context (:mod:`specdec.ngram_corpus`): ``auto`` (a shipped one built for this
    tokenizer's vocabulary, if any), None, a file written by ``specdec ngram-corpus``, or an ``NGramCorpus``. ``draft`` may be a list: the first
    is the default, ``sd``'s ``draft=NAME`` option picks another (loaded ones are ``draft0``, ...). ``linear``: kernel of the linear
    layers of models loaded by name (``auto``, ``packed``, ``skinny``, ``torch``; see :mod:`specdec.linear`); a
    loaded model is used as given. ``weights``: ``auto`` (default: a model from a GGUF file computes with the
    file's quantized blocks as stored, :mod:`specdec.gguf_weights`), ``gguf`` or ``dense``. ``draft_weights``:
    ``dense`` (default), ``q8`` or ``q4``, the drafts' linear layers as 8-bit or 4-bit blocks, swapped in place
    (:mod:`specdec.draft_weights`; output stays the target's). ``compile``: whether the runners of target and drafts run their decode
    forwards through ``torch.compile`` (:class:`ModelRunner`): ``"auto"`` (the default, from
    ``$SPECDEC_COMPILE``) decodes eagerly while the graphs compile in the background and switches to
    them between generations once ready; ``"on"``/``True`` compiles here, before returning;
    ``"off"``/``False`` stays eager (see :mod:`specdec.warmup`). :meth:`wait_compiled` blocks until ready.
    A model whose compile fails is named with the error: ``"on"`` raises; ``"auto"`` warns and runs that model
    eagerly, the others compiled. ``compile_options``: inductor options (``torch._inductor.config`` names, dotted
    for nested ones) set over specdec's own (:func:`specdec.compile_passes.compile_options`), for every compiled
    runner; e.g. ``{"cpp_wrapper": False}`` compiles a graph in about half the time for a slower step on the CPU.
    """

    def __init__(self, model: str | PreTrainedModel = DEFAULT_MODEL,
                 draft: str | PreTrainedModel | list | None = None,
                 dtype: str = "fp32", tokenizer=None, device: str = "cpu", linear: str = "auto",
                 corpus: "str | NGramCorpus | None" = "auto", compile: bool | str | None = None,
                 weights: str = "auto", draft_weights: str = "dense", compile_options: dict | None = None):
        if draft_weights not in DRAFT_WEIGHTS:
            raise ValueError(f"draft_weights must be one of {', '.join(DRAFT_WEIGHTS)}, got {draft_weights!r}")
        mode = compile_mode(compile)
        overrides = check_inductor_overrides(compile_options)  # before minutes of loading
        if overrides and mode == "off":
            warnings.warn("compile_options are ignored: compile is off", RuntimeWarning, stacklevel=2)
        runner_compile = {"on": True, "saved": "saved"}.get(mode, False)
        if mode != "off":
            use_persistent_cache(cache_dir() / "inductor")
        if isinstance(model, PreTrainedModel):
            self.model, self.tokenizer = model.eval(), tokenizer
        else:
            self.model, self.tokenizer = load_model(model, dtype, device, linear, weights)
        self.compile_options = overrides  # the caller's; each runner merges them over its own device's defaults
        # Drafts by name; the first is the default. A method option ``draft=NAME`` picks another.
        self.drafts: dict[str, tuple[PreTrainedModel, ModelRunner]] = {}
        for i, d in enumerate(draft if isinstance(draft, (list, tuple)) else [] if draft is None else [draft]):
            if isinstance(d, PreTrainedModel):
                name, dm, draft_tok = f"draft{i}", d.eval(), None
            else:
                name, (dm, draft_tok) = d, load_model(d, dtype, device, linear, weights)
            check_same_vocab(self.model, dm, self.tokenizer, draft_tok)
            width = self.model.config.get_text_config().hidden_size
            if is_feature_draft(dm) and dm.config.hidden_size != width:
                raise ValueError(f"feature-conditioned draft {name!r} reads hidden states of width "
                                 f"{dm.config.hidden_size}, the target's are {width}: it was made for another target")
            if name in self.drafts:
                raise ValueError(f"draft {name!r} given twice")
            if draft_weights != "dense":
                if isinstance(d, PreTrainedModel):  # the caller's module (perhaps the target itself) stays as given
                    dm = copy.deepcopy(dm)
                quantize_draft(dm, widen_prompts=linear != "packed", kind=draft_weights)
            self.drafts[name] = (dm, ModelRunner(dm, compile=runner_compile, compile_options=runner_options(dm, overrides)))
        self.draft, self.draft_runner = next(iter(self.drafts.values()), (None, None))
        self.runner = ModelRunner(self.model, compile=runner_compile, compile_options=runner_options(self.model, overrides))
        target, features = self.model, any(is_feature_draft(m) for m, _ in self.drafts.values())

        def warm(runner: ModelRunner) -> None:
            warm_up(runner, beside_feature_draft=features and runner.model is target, draft=runner.model is not target)

        for runner in [self.runner] + [r for _, r in self.drafts.values()]:
            warm(runner)
        models = [self.model] + [m for m, _ in self.drafts.values()]
        self._compiling = BackgroundCompile(
            lambda: [ModelRunner(m, compile=True, compile_options=runner_options(m, overrides)) for m in models], warm) \
            if mode == "auto" else None
        self.eos = eos_ids(self.model, self.tokenizer)
        self._step_cost: StepCost | None = None
        self._learned: dict = {}  # what methods learn across calls (dec.learned): one model, one workload
        self._draft_seconds: dict[str, float] = {}
        self._workers: dict = {}  # draft backends that run beside the target (PEARL), per kind and draft
        self._references: dict[tuple[int, ...], list[int]] = {}  # the oracle's greedy reference runs
        self._reference_len: dict[tuple[int, ...], int] = {}  # the max_new_tokens each was run for
        self._ngram_tables: NGramTables | None = None
        if isinstance(corpus, Path) or (isinstance(corpus, str) and corpus != "auto"):
            corpus = NGramCorpus.load(corpus)
        elif corpus is not None and not isinstance(corpus, (str, NGramCorpus)):
            raise TypeError(f"corpus must be 'auto', None, a file path or an NGramCorpus, got {type(corpus).__name__}")
        if isinstance(corpus, NGramCorpus):
            vocab = self.model.get_output_embeddings().weight.shape[0]
            if corpus.vocab > vocab:
                raise ValueError(f"the n-gram corpus was built for a vocabulary of {corpus.vocab} ids; the model has {vocab}")
            fp = corpus.meta.get("vocab_fingerprint")
            if fp is not None and self.tokenizer is not None and fp != vocab_fingerprint(self.tokenizer):
                raise ValueError("the n-gram corpus was built with another tokenizer's vocabulary")
        self._corpus = corpus  # "auto" is resolved on first use

    @property
    def compiled(self) -> bool:
        """Whether decoding runs through the compiled graphs now."""
        return self.runner.compiled

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """With ``compile="auto"``, wait (up to ``timeout`` seconds) for the background compile and switch
        to it; returns :attr:`compiled`. Benchmarks call this so that every timed run takes one path."""
        if self._compiling is not None:
            self._compiling.wait(timeout)
            self._use_compiled()
        return self.compiled

    def _use_compiled(self) -> None:
        """Switch to the compiled runners if the background compile has finished (between generations)."""
        if self._compiling is None or not self._compiling.done:
            return
        runners, self._compiling = self._compiling.result(), None
        if runners is None:  # it failed (and said so): stay eager
            return
        self.runner, drafts = runners[0], runners[1:]
        self.drafts = {name: (m, r) for (name, (m, _)), r in zip(self.drafts.items(), drafts)}
        self.draft, self.draft_runner = next(iter(self.drafts.values()), (None, None))
        self._step_cost = None  # compiled steps cost less: measure again
        self._draft_seconds = {}

    def draft_backend(self, name: str, kind: str = "process") -> tuple[ConcurrentDraft, int | None]:
        """A backend that drafts with draft ``name`` beside the target (PEARL), and the core it keeps to
        (None: none). ``process``: a worker process, started on first use and kept for later calls (a new one
        replaces a worker that died); ``inline``: in this process."""
        model, _ = self.get_draft(name)
        if kind == "inline":
            if ("inline", name) not in self._workers:
                self._workers[("inline", name)] = InlineDraft(model)
            return self._workers[("inline", name)], None
        worker = self._workers.get(("process", name))
        if worker is None or not worker.alive:
            worker = self._workers[("process", name)] = ProcessDraft(model)
        return worker, worker.core

    def close(self) -> None:
        """Stop the draft worker processes this decoder started (also done when it is collected or the
        interpreter exits)."""
        for worker in self._workers.values():
            worker.close()
        self._workers.clear()

    def get_draft(self, name: str | None = None) -> tuple[PreTrainedModel, ModelRunner]:
        """The draft model and its runner: the default one, or the one loaded as ``name``."""
        if not self.drafts:
            raise ValueError("no draft model loaded (--draft)")
        if name is None:
            return self.draft, self.draft_runner
        name = str(name)  # method options parse all-digit values as ints
        if name not in self.drafts:
            raise ValueError(f"draft {name!r} is not loaded; loaded: {', '.join(self.drafts)}")
        return self.drafts[name]

    def ngram_tables(self) -> NGramTables:
        """The target's unigram and bigram tables (computed once per model, then read from disk)."""
        if self._ngram_tables is None:
            vocab = self.model.get_output_embeddings().weight.shape[0]
            self._ngram_tables = load_tables(self.model, tables_cache_dir(), k_max=min(32, vocab))
        return self._ngram_tables

    def ngram_corpus(self) -> NGramCorpus | None:
        """The n-gram corpus ngrammys drafts from (``auto``: the shipped one for this tokenizer's vocabulary)."""
        if isinstance(self._corpus, str):
            self._corpus = shipped_corpus(self.tokenizer) if self.tokenizer is not None else None
        return self._corpus

    def step_cost(self) -> StepCost:
        """The target's measured step cost per tree size (calibrated on first use, about 30 forwards)."""
        if self._step_cost is None:
            self._step_cost = StepCost.calibrate(self.runner)
        return self._step_cost

    def draft_names(self) -> list[str]:
        """The loaded drafts' names, the default first."""
        return list(self.drafts)

    def draft_seconds(self, name: str | None = None) -> float:
        """Seconds of one draft forward (one token), measured on first use per draft."""
        name = name or self.draft_names()[0]
        if name not in self._draft_seconds:
            model, runner = self.get_draft(name)
            # a feature-conditioned draft reads a target hidden state beside each token
            self._draft_seconds[name] = StepCost.calibrate(runner, sizes=(1,), extra_inputs=warm_up_inputs(model))(1)
        return self._draft_seconds[name]

    def disco_path(self, name: str) -> Path:
        """The DISCO classifier shipped with draft ``name`` (``disco/disco.pt`` in its folder, beside ``disco/summary.json``)."""
        if name not in DRAFTS:
            raise ValueError(f"no DISCO classifier ships with draft {name!r}: train one with `specdec train-disco` "
                             f"and pass it as disco=PATH (--disco PATH)")
        return DRAFTS[name] / "disco" / "disco.pt"

    def reference_tokens(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        """The target's own greedy continuation of ``prompt`` (``ar``, this decoder's dtype), memoised:
        the reference the ``oracle`` schedule follows."""
        key = tuple(prompt)
        if self._reference_len.get(key, -1) < max_new_tokens:  # a run may end early, at an EOS
            self._references[key] = self.generate_ids([list(prompt)], "ar", max_new_tokens).tokens[0]
            self._reference_len[key] = max_new_tokens
        return self._references[key]

    def references(self) -> dict[tuple[int, ...], list[int]]:
        """Every reference run so far (prompt tuple -> new tokens)."""
        return self._references

    def reset_learned(self) -> None:
        """Forget what methods learned across calls (acceptance tables, DISCO calibration), for a fair start."""
        self._learned.clear()

    def learned(self, key: tuple, make):
        """The state stored under ``key`` (acceptance tables, phrase pools, calibrations), made by ``make()`` on
        first use: methods learn across calls (one decoder, one workload), one store per method and option set."""
        if key not in self._learned:
            self._learned[key] = make()
        return self._learned[key]

    def encode(self, prompt: str, chat: bool = True) -> list[int]:
        """Token ids of ``prompt``, through the chat template when ``chat`` and the tokenizer has one."""
        return encode_prompt(self.tokenizer, prompt, chat)

    def generate_ids(self, prompts: list[list[int]], method: str = "pld", max_new_tokens: int = 128,
                     sampling: SamplingConfig = SamplingConfig(), *, max_memory: int | str | None = None,
                     chunk: bool = True, governor: DraftGovernor | None = None, **options) -> DecodeResult:
        """Generate from token-id prompts ``[[int]]`` (a ragged batch) with a registered method
        (:mod:`specdec.methods`; ``specdec generate --help`` lists each method's options and defaults).

        ``options``: the method's options by name, as values or strings (``draft_length=2`` or
        ``draft_length="2"``); unknown names and bad values raise ``ValueError``.

        Memory: before allocating, the call's need beyond the loaded weights is estimated
        (:mod:`specdec.memory`: the KV caches, sized for the method's largest tree, and the largest transient
        buffers) and compared with ``max_memory`` (bytes, or a string such as ``"2GiB"``; default: 90% of what
        the device has free, counting the caches this decoder already holds as free). A batch that needs more
        runs as consecutive chunks that fit, one after another (rows are independent: the outputs are the
        same; ``stats.chunks`` says how many); ``chunk=False`` raises :class:`specdec.memory.MemoryLimitError`
        instead, naming the estimate, the limit and the largest batch that fits.

        Governor: a method of the shared decode loop stops drafting while steps without a draft emit more tokens
        per second (:class:`specdec.policies.DraftGovernor`, one per method and option set, learning across calls;
        option ``govern=0`` turns it off); ``governor`` replaces that one for this call.
        """
        spec = methods.get(method)
        opts = spec.parse(options)
        self._use_compiled()
        if spec.needs_draft and self.draft_runner is None:
            raise ValueError(f"method {method!r} needs a draft model (--draft)")
        vocab = self.model.get_output_embeddings().weight.shape[0]
        for p in prompts:
            if any(not 0 <= t < vocab for t in p):
                raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        if not prompts or any(len(p) == 0 for p in prompts) or max_new_tokens < 1:  # the loops' own errors
            return autoregressive_generate(self.runner, prompts, max_new_tokens, sampling, self.eos)
        built = None
        if spec.build is not None:
            if spec.prepare is not None:
                spec.prepare(self, opts, prompts, max_new_tokens, sampling)
            built = spec.build(self, opts, sampling)
        shape = self._call_shape(spec, opts, built, max_new_tokens, sampling)
        parts, need = self._fit(shape, [len(p) for p in prompts], max_memory, chunk)
        result = None
        for start, end in parts:
            rows = prompts[start:end]
            if built is not None and built.policy is not None:  # a batch's steps have their own costs
                built.policy.prepare_batch(self.runner, len(rows))
            if governor is None and isinstance(opts, methods.GovernedOptions) and opts.govern:
                options = {**built.governor, "explore": opts.explore}  # the method's own, and the probe budget
                governor = self.learned(("governor", method, opts), lambda: DraftGovernor(**options))
            if built is None:
                res = autoregressive_generate(self.runner, rows, max_new_tokens, sampling, self.eos)
            elif built.loop is not None:
                res = built.loop.generate(self.runner, rows, max_new_tokens, sampling, self.eos, governor)
            else:
                res = speculative_generate(self.runner, built.drafter, rows, max_new_tokens, sampling, self.eos,
                                           built.policy, governor)
            res.stats.memory_estimate = need[(start, end)]
            if result is None:
                result = res
            else:
                result.tokens += res.tokens
                result.stats.merge(res.stats)
        return result

    def estimate_memory(self, prompts: list[list[int]], method: str = "pld", max_new_tokens: int = 128,
                        sampling: SamplingConfig = SamplingConfig(), **options) -> "memory.MemoryEstimate":
        """What :meth:`generate_ids` with these arguments is estimated to need beyond the loaded weights, for
        the whole batch in one generation (:func:`specdec.memory.estimate`)."""
        spec = methods.get(method)
        opts = spec.parse(options)
        built = spec.build(self, opts, sampling) if spec.build is not None else None
        shape = self._call_shape(spec, opts, built, max_new_tokens, sampling)
        return memory.estimate(shape, [len(p) for p in prompts])

    def _call_shape(self, spec, opts, built: "methods.Built | None", max_new_tokens: int,
                    sampling: SamplingConfig) -> "memory.CallShape":
        return memory.CallShape(
            self.model, self.get_draft(getattr(opts, "draft", None))[0] if spec.needs_draft else None,
            0 if built is None else built.margin(max_new_tokens), max_new_tokens,
            memory.sampling_copies(sampling), built is not None and built.needs_hidden,
            None if built is None else built.draft_nodes)

    def _fit(self, shape: "memory.CallShape", lens: list[int], max_memory, chunk: bool):
        """The row ranges to run (one, or chunks that fit) and each one's estimated bytes."""
        if max_memory is not None:
            limit = memory.parse_bytes(max_memory)
        else:  # caches this decoder holds are reused or freed before the call allocates
            held = sum(r.cache_bytes() for r in [self.runner] + [r for _, r in self.drafts.values()])
            limit = int(0.9 * (memory.available_bytes(self.runner.device) + held))
        whole = memory.estimate(shape, lens)
        if whole.total <= limit:
            return [(0, len(lens))], {(0, len(lens)): whole.total}
        parts = memory.chunks(lens, lambda l: memory.estimate(shape, l), limit)
        if not chunk:
            most = max(e - s for s, e in parts)
            raise memory.MemoryLimitError(
                f"{len(lens)} rows need about {whole}, more than the {limit / memory.GIB:.2f} GiB this call may use "
                f"({'max_memory' if max_memory is not None else '90% of the free memory'}); the largest batch of "
                f"these prompts that fits is {most} rows. Pass chunk=True to run it in {len(parts)} chunks, or "
                "lower the batch, prompt length or max_new_tokens")
        return parts, {(s, e): memory.estimate(shape, lens[s:e]).total for s, e in parts}

    def generate(self, prompt: str, method: str = "pld", max_new_tokens: int = 128, chat: bool = True,
                 temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                 seed: int | None = None, **options) -> GenerateOutput:
        """Generate a completion of a text prompt; returns text, new token ids and statistics."""
        ids = self.encode(prompt, chat)
        res = self.generate_ids([ids], method, max_new_tokens, SamplingConfig(temperature, top_k, top_p, seed), **options)
        toks = res.tokens[0]
        return GenerateOutput(self.tokenizer.decode(toks, skip_special_tokens=True), toks, res.stats)


_LOADED: dict = {}


def generate(prompt: str, model: str = DEFAULT_MODEL, method: str = "pld", draft: str | None = None,
             dtype: str = "fp32", **kwargs) -> GenerateOutput:
    """One-call generation: loads (and caches) the models, then :meth:`SpecDecoder.generate`."""
    key = (model, draft, dtype)
    if key not in _LOADED:
        _LOADED[key] = SpecDecoder(model, draft, dtype)
    return _LOADED[key].generate(prompt, method=method, **kwargs)


def _hf_sampling(sampling: SamplingConfig) -> dict:
    if sampling.greedy:
        return dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    if sampling.seed is not None:
        torch.manual_seed(sampling.seed)
    return dict(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or 0, top_p=sampling.top_p or 1.0)


@torch.inference_mode()
def hf_generate(model: PreTrainedModel, prompt: list[int], max_new_tokens: int, sampling: SamplingConfig,
                **kwargs) -> list[int]:
    """transformers' own ``generate`` on one prompt (the reference), returning the new token ids."""
    ids = torch.tensor([prompt], device=model.device)
    gen = _hf_sampling(sampling)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         pad_token_id=model.generation_config.pad_token_id or 0, **gen, **kwargs)
    return out[0, len(prompt):].tolist()


@torch.inference_mode()
def hf_generate_batch(model: PreTrainedModel, prompts: list[list[int]], max_new_tokens: int,
                      sampling: SamplingConfig) -> list[list[int]]:
    """transformers' own ``generate`` on a ragged batch of prompts, left-padded under an attention mask as a
    transformers user batches them: the new token ids per prompt, each cut after its first EOS (transformers pads
    the rows that finished early)."""
    pad = model.generation_config.pad_token_id or 0
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=pad,
                         **_hf_sampling(sampling))
    eos = model.generation_config.eos_token_id
    eos = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
    rows = []
    for row in out[:, width:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:end])
    return rows
