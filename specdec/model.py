"""The model runner: a transformers causal LM with a preallocated KV cache and tree verification.

Nothing of the model is forked: tree attention is plugged in through transformers'
``AttentionInterface`` (an attention function named ``"specdec"``) and a ``Cache`` subclass that
writes into preallocated buffers. Per-step metadata (committed lengths, the tree's ancestor
mask and positions) reaches the attention function as a forward kwarg.

Layout of the cache, per row ``b``: positions ``[0, lengths[b])`` hold committed tokens. A forward
writes its ``T`` tokens at the common offset ``write_pos = max(lengths)``; :meth:`ModelRunner.commit`
then moves the accepted nodes to ``lengths[b] ...`` with one KV-compaction call over all layers.

The nodes written past ``write_pos`` and not yet committed form the *pending region* (``N`` nodes). A
draft model grows a tree in it level by level (:meth:`ModelRunner.forward_pending`): each forward writes
its ``F`` new frontier nodes after the ``N - F`` already there and attends over the committed prefix
and over the pending nodes its packed ``[B,F,ceil(N/32)]`` mask shows, without recomputing them;
:meth:`ModelRunner.commit_pending` then keeps the accepted path with one compaction and drops the rest.
:meth:`ModelRunner.forward_tree` is the one-forward case (a fresh region of ``N = T`` nodes).

Attention over that layout has two implementations (``ModelRunner(attention=...)``, default from
``$SPECDEC_ATTN``): ``"kernel"`` calls :func:`specdec.kernels.tree_attention` with the whole cache
view ``[0, write_pos + N)`` as the prefix (keys at or past ``lengths[b]`` are never visible there) and
the pending region ``[write_pos, write_pos + N)`` as its tree operands, so no dense mask is built (but for
wide trees on AVX-512 CPUs, below);
``"sdpa"`` builds one dense ``[B,1,T,write_pos+N]`` mask per forward and calls SDPA (the fallback where
no tree-attention kernel is built). Prompts on an empty cache are plain causal attention: on CPUs where torch
runs AVX-512 kernels they take causal SDPA on either path (:data:`PROMPT_ATTENTION`), and there forwards of at
least :data:`WIDE_TREE_SDPA` tokens take SDPA with the dense mask too (torch's flash kernel, on AMX in bf16).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from specdec import kernels, precompile, settings
from specdec.kernels.reference import tree_attention_mask
from specdec.tree import DraftTree

ATTN_IMPL = "specdec"
ATTENTIONS = ("kernel", "sdpa")


def default_attention(device: torch.device) -> str:
    """``$SPECDEC_ATTN`` if set, else ``"kernel"`` where a tree-attention kernel exists for ``device``
    (the torch reference would be slower than the dense-mask SDPA path), else ``"sdpa"``."""
    env = settings.get("SPECDEC_ATTN")
    if env:
        if env not in ATTENTIONS:
            raise ValueError(f"SPECDEC_ATTN={env!r}; expected one of {ATTENTIONS}")
        return env
    return "kernel" if device.type != "cpu" or kernels.has_native("tree_attention") else "sdpa"


def model_label(model: PreTrainedModel) -> str:
    """``model`` in messages: its class, and the name or folder it was loaded from where it has one."""
    path = getattr(model, "name_or_path", "")
    return f"{type(model).__name__} ({path})" if path else type(model).__name__


# How a prompt on an empty cache attends: "sdpa" (causal SDPA, its flash kernel) or "kernel" (the same path as a
# verification); bench.profile prefill times one against the other. "sdpa" applies on CPUs where torch's kernels
# run with AVX-512 (measured there); elsewhere, on CPUs without it and on GPUs, prompts keep the kernel.
PROMPT_ATTENTION = "sdpa"


# Read once at import: a call inside a compiled forward would break its graph (it returns a string).
_CPU_AVX512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def _prompt_sdpa(device_type: str) -> bool:
    return device_type == "cpu" and _CPU_AVX512


def _wide_tree_sdpa(env: str | None) -> int | None:
    value = int(env or 8)
    if value < 0:
        raise ValueError(f"SPECDEC_WIDE_TREE_SDPA={env!r}: a number of tokens, or 0 for never")
    return value or None


# On CPUs where torch runs AVX-512 kernels (:func:`_prompt_sdpa`), a forward of at least this many tokens per row (a wide tree or a long chain) attends through
# SDPA with the dense mask instead of the kernel: torch's flash kernel (AMX tiles in bf16) overtakes the
# kernel from about 8 queries on. SDPA's time over the kernel's, random trees over 400 cached tokens, Xeon,
# one thread (`python -m bench.kernels --only tree_sdpa`): bf16 0.82 at T = 8, 0.43 at 16, 0.34 at 32, and
# 0.91 for 16 rows at T = 8; fp32 0.94, 0.59, 0.54 and 1.05. Prompts on an empty cache are not trees: they keep
# PROMPT_ATTENTION's choice (the kernel skips keys below a sliding window, where a dense mask would cost T^2).
# None (``$SPECDEC_WIDE_TREE_SDPA=0``): always the kernel.
WIDE_TREE_SDPA: int | None = _wide_tree_sdpa(settings.get("SPECDEC_WIDE_TREE_SDPA"))


def route_attention(preferred: str, device: torch.device, tokens: int, prompt: bool) -> tuple[str, bool]:
    """How one forward attends: ``(attention, native)``, the one place a forward's route is decided.

    preferred: the runner's setting (:func:`default_attention`); tokens: the forward's tokens per row;
    prompt: a prompt on an empty cache. A wide tree or chain on an AVX-512 CPU takes ``"sdpa"``
    (:data:`WIDE_TREE_SDPA`); native: whether the ``"kernel"`` route runs the compiled extension's kernel
    (else :func:`specdec.kernels.tree_attention` picks Triton or the torch reference). Within the forward,
    each layer of a prompt may still take causal SDPA (:data:`PROMPT_ATTENTION`: it depends on the layer's
    sliding window)."""
    attention = preferred
    if (attention == "kernel" and WIDE_TREE_SDPA is not None and tokens >= WIDE_TREE_SDPA and not prompt
            and _prompt_sdpa(device.type)):
        attention = "sdpa"
    native = attention == "kernel" and kernels.choose("tree_attention", device, None, ("cpu",), triton=True) == "native"
    return attention, native


# A ragged batch's prompts are encoded row by row when that computes fewer positions than one padded forward,
# counting a row as at least this many (below it a forward's cost is the weights' read, not the tokens).
ROW_PREFILL_MIN = 64


# torch._dynamo's recompile limit while compiled runners exist (at least; its default is 8): see ModelRunner.
RECOMPILE_LIMIT = 64


@dataclass
class TreeAttentionMeta:
    """What the attention function needs for one forward.

    cache_lens: ``[B]`` committed lengths; prefix_len: start of the pending region, ``write_pos`` (keys
    before it are the prefix, keys from it on the ``N`` pending nodes, the ``T`` queries last);
    tree_mask: packed ``[B,T,ceil(N/32)]`` or None (causal); positions: ``[B,T]`` the queries' absolute
    positions; key_positions: ``[B,N]`` every pending node's position, or None when ``N == T`` (a tree
    run in one forward: they are ``positions``);
    aligned: every row's committed length equals ``prefix_len`` (known on the host);
    attention: ``"kernel"`` or ``"sdpa"`` (see the module docstring); native: :func:`specdec.kernels.tree_attention`
    would dispatch to the compiled kernel, resolved once per forward so that the layers call it directly (the
    wrapper's checks and dispatch cost ~40 us per layer at batch 1). A flag, not the op itself: a compiled
    forward's saved guards must pickle (:mod:`specdec.precompile`).
    Dense masks (``"sdpa"``, and wide trees' route on ``"kernel"``) are built once per forward and per window
    size, then shared by all layers.
    """

    cache_lens: torch.Tensor
    prefix_len: int
    tree_mask: torch.Tensor | None
    positions: torch.Tensor
    aligned: bool = False
    attention: str = "sdpa"
    native: bool = False  # call torch.ops.specdec.tree_attention directly (the dispatcher would pick it)
    key_positions: torch.Tensor | None = None
    _dense: dict = field(default_factory=dict)

    @property
    def pending_positions(self) -> torch.Tensor:
        """``[B,N]`` positions of every pending node (the queries last)."""
        return self.positions if self.key_positions is None else self.key_positions

    def all_visible(self, window: int | None) -> bool:
        """One token per row, nothing else pending, rows aligned, window not reached: every key is visible."""
        return (self.key_positions is None and self.positions.shape[1] == 1 and self.aligned
                and (window is None or self.prefix_len < window))

    def is_prompt(self, window: int | None) -> bool:
        """The forward encodes prompts on an empty cache (nothing committed or pending before its tokens,
        no tree) and every query's causal keys lie in the window: plain causal attention over its own tokens."""
        return (self.prefix_len == 0 and self.tree_mask is None and self.key_positions is None
                and (window is None or self.positions.shape[1] <= window))

    def model_mask(self) -> torch.Tensor | None:
        """The ``attention_mask`` handed to the model: a 4-D mask, which transformers passes through
        instead of building its own, or None when every key is visible. The kernel path never reads
        it, so it gets a broadcast view of one element."""
        if self.all_visible(None):
            return None
        if self.attention == "sdpa":
            return self.dense(None)
        b, t = self.positions.shape
        n = self.pending_positions.shape[1]
        return torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.positions.device).expand(b, 1, t, self.prefix_len + n)

    def dense(self, window: int | None) -> torch.Tensor | None:
        """``[B,1,T,prefix_len+N] bool`` visibility, or None when every key is visible (one token per
        row, rows aligned, window not reached): SDPA then takes its faster unmasked path."""
        if self.all_visible(window):
            return None
        if window not in self._dense:
            t, keys = self.positions.shape[1], self.pending_positions
            self._dense[window] = tree_attention_mask(
                self.cache_lens, self.prefix_len, self.tree_mask, t, keys, window, keys.shape[1])
        return self._dense[window]


def _native_tree_attention():
    """The compiled extension's tree attention (registered when ``specdec._C`` loaded: ``meta.native`` says so)."""
    return torch.ops.specdec.tree_attention


def specdec_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention function registered as ``"specdec"``: tree attention when a ``specdec_meta`` kwarg
    is present, transformers' SDPA path otherwise (so ``model.generate`` keeps working).

    query: ``[B,Hq,T,D]``; key/value: ``[B,Hkv,prefix_len+N,D]`` (cache view). Returns ``[B,T,Hq,D]``.
    """
    meta: TreeAttentionMeta | None = kwargs.get("specdec_meta")
    if meta is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    window = kwargs.get("sliding_window")
    t = query.shape[2]
    if PROMPT_ATTENTION == "sdpa" and meta.is_prompt(window) and key.shape[2] == t and _prompt_sdpa(query.device.type):
        # A prompt on an empty cache is plain causal attention: SDPA's flash kernel (no mask tensor) is
        # 1.6-2.8x the tree kernel there (64 to 1,000 tokens, CPU, fp32 and bf16; bench.profile prefill).
        out = torch.nn.functional.scaled_dot_product_attention(
            # A constant, not the symbolic t > 1 of a compiled forward (a draft's catch-up on an empty cache),
            # which SDPA refuses (a graph break).
            query, key, value, is_causal=True if t > 1 else False, scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2).contiguous(), None
    # On the CPU the kernel beats SDPA for few queries, one token included (0.05 against 0.065 ms per layer
    # in fp32 and 0.49 ms in bf16 at a 400-token context, AVX2), and at every size without AVX-512 (wide trees
    # there come with meta.attention "sdpa": route_attention); elsewhere a one-token step with every key
    # visible is SDPA's unmasked (flash) path.
    if meta.attention == "kernel" and (query.device.type == "cpu" or not meta.all_visible(window)):
        p = meta.prefix_len
        # The whole cache view serves as the prefix: keys at or past cache_lens (<= p) are never visible.
        # The pending region [p, p + N) is the tree operand; the queries are its last T nodes.
        attend = _native_tree_attention() if meta.native else kernels.tree_attention
        out = attend(query, key, value, meta.cache_lens, key[:, :, p:], value[:, :, p:], meta.tree_mask, scaling,
                     meta.pending_positions if window is not None else None, window)
        return out.transpose(1, 2).contiguous(), None
    mask = meta.dense(window)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    """Make ``"specdec"`` a transformers attention implementation (idempotent). :class:`ModelRunner`
    calls it; importing this module registers nothing."""
    AttentionInterface.register(ATTN_IMPL, specdec_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPL, sdpa_mask)


class _PreallocatedLayer(CacheLayerMixin):
    """One layer's keys/values in a ``[B,H,capacity,D]`` buffer, written after the owner's pending region."""

    def __init__(self, owner: "PreallocatedCache", layer_idx: int):
        super().__init__()
        self.owner = owner
        self.layer_idx = layer_idx

    def lazy_initialization(self, key_states, value_states):
        self.keys, self.values = self.owner.allocate(self.layer_idx, key_states)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.owner.write_pos + self.owner.pending
        end = start + key_states.shape[2]
        self.keys[:, :, start:end].copy_(key_states)
        self.values[:, :, start:end].copy_(value_states)
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length):
        return self.owner.write_pos + self.owner.pending + query_length, 0

    def get_seq_length(self):
        return self.owner.write_pos + self.owner.pending

    def get_max_length(self):
        return self.owner.capacity


class PreallocatedCache(Cache):
    """A transformers ``Cache`` over preallocated buffers with per-row committed ``lengths [B]``."""

    def __init__(self, num_layers: int, batch_size: int, capacity: int, device: torch.device, pool: dict):
        super().__init__(layers=[_PreallocatedLayer(self, i) for i in range(num_layers)])
        self.capacity = capacity
        with torch.inference_mode():  # as every tensor of a forward is (one kind: see ModelRunner._run)
            self.lengths = torch.zeros(batch_size, dtype=torch.int64, device=device)
        self.lengths_host = [0] * batch_size  # host mirror of lengths (the runner keeps both)
        self.write_pos = 0  # max(lengths_host): where the pending region starts
        self.pending = 0  # uncommitted nodes at [write_pos, write_pos + pending); the next forward writes after them
        self.pending_positions: torch.Tensor | None = None  # [B, pending] their positions
        self.pool = pool

    def allocate(self, layer_idx: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B,H,capacity,D]`` key and value buffers for one layer, reused across generations.

        Buffers are zero-filled when first made: masked-out slots are multiplied by a zero weight,
        and uninitialised memory could hold NaN, which would poison that product.
        """
        b, h, _, d = like.shape
        old = self.pool.get(layer_idx)
        if old is not None:
            k, v = old
            if (k.shape[0], k.shape[1], k.shape[3]) == (b, h, d) and k.shape[2] >= self.capacity \
                    and k.dtype == like.dtype and k.device == like.device:
                return k, v
        shape = (b, h, self.capacity, d)
        k = torch.zeros(shape, dtype=like.dtype, device=like.device)
        v = torch.zeros(shape, dtype=like.dtype, device=like.device)
        for t in (k, v):  # heads and head size are static under torch.compile; only the capacity varies
            torch._dynamo.mark_static(t, 1)
            torch._dynamo.mark_static(t, 3)
        self.pool[layer_idx] = (k, v)
        return k, v

    def drop(self) -> None:
        """Let go of the buffers (a runner replacing this cache calls it). The layers point back at their cache,
        so a dropped cache is a reference cycle that only a full garbage collection frees: its buffers (a
        step-cost calibration's, 99 MiB at 16 rows of SmolLM2 in fp32) stayed resident through the generation
        that followed. Buffers the pool keeps for reuse live on there; the dropped cache lets go of the pool (a
        one-row cache of a ragged prefill holds views of every layer's batch buffers in its own, which kept them
        alive after the runner released them: the soak's runs started 1.6 GB apart)."""
        for layer in self.layers:
            layer.keys = layer.values = None
            layer.is_initialized = False
        self.pool = {}

    def buffers(self) -> list[torch.Tensor]:
        """Every initialised layer's key and value buffers."""
        out = []
        for layer in self.layers:
            if layer.is_initialized:
                out += [layer.keys, layer.values]
        return out


def _inference(x: torch.Tensor) -> torch.Tensor:
    """``x``, or a copy of it made in inference mode if it is an ordinary tensor."""
    if x.is_inference():
        return x
    with torch.inference_mode():
        return x.clone()


class ModelRunner:
    """Runs a causal LM over draft trees with a preallocated cache.

    State: ``lengths [B]`` committed KV per row, on the device and mirrored on the host
    (:attr:`lengths_host`), and the write position ``max(lengths)``: the runner is their only owner, so
    callers hand it what a step accepted and never track lengths of their own. The caller keeps the
    tokens; the runner keeps KV. Past ``write_pos`` lie :attr:`pending` uncommitted nodes (see the module
    docstring): those of the last :meth:`forward_tree`, or of a tree grown with :meth:`forward_pending`.
    """

    def __init__(self, model: PreTrainedModel, attention: str | None = None, compile: bool | str = False,
                 compile_options: dict | None = None):
        """attention: ``"kernel"`` or ``"sdpa"`` (default: :func:`default_attention`).

        compile: run verification forwards (every forward but the prompt's) through ``torch.compile`` of
        the model, which fuses transformers' small ops (norms, rotary, activations, residuals) and drops the
        per-module Python between them; the prompt, whose products are large, stays eager. The model object
        itself is not changed: other callers (``model.generate``) stay eager. The first forward of each kind
        (one token, a chain, a tree) compiles; :meth:`warm_up` does that up front. ``"saved"``: run the graphs
        an earlier process compiled and saved (:mod:`specdec.precompile`), the other forwards eagerly; nothing
        compiles and :meth:`warm_up` does nothing.

        compile_options: inductor's options for it (default :func:`specdec.compile_passes.compile_options` for the
        model's device: the quantized products that share an input run as one call, a C++ wrapper on the CPU;
        ``{}`` for none, an A/B run's other arm).
        """
        if getattr(model.config, "is_encoder_decoder", False):
            raise ValueError("specdec supports decoder-only models")
        register_attention()
        if model.config._attn_implementation != ATTN_IMPL:
            model.set_attn_implementation(ATTN_IMPL)
        self.model = model
        self.config = model.config.get_text_config()
        self.max_positions = getattr(self.config, "max_position_embeddings", None) or 2**31
        self.device = model.device
        self.attention = attention or default_attention(self.device)
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention={self.attention!r}; expected one of {ATTENTIONS}")
        self._pool: dict = {}
        self._compiled = None
        self.compile_options: dict | None = None  # the inductor options of the compiled forward, if any
        if compile == "saved" and not precompile.enabled():
            compile = False  # SPECDEC_PRECOMPILE=0: nothing is loaded
        if compile:  # reset() below brings the packed weights up to date
            # transformers' forward wrapper is one code object for every model class, so the graphs of the target
            # and of the drafts (each kind of forward, with and without hidden states, one row and several) share
            # dynamo's per-code-object limit, past which it runs further kinds eagerly.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
            # dynamic: the tree size, the cache view's length and the write offset vary from call to call.
            # The bound forward is compiled, not the module: module hooks added later (the bench's call
            # counter) would otherwise force a recompile. They do not run for compiled calls, which
            # ``compiled_calls`` counts instead.
            from specdec.compile_passes import compile_options as default_options

            device_type = next(model.parameters()).device.type
            options = default_options(device_type) if compile_options is None else dict(compile_options)
            self.compile_options = options
            if compile == "saved":  # only what an earlier process saved; other forwards run eagerly
                self._compiled = precompile.PrecompiledForward(model, options, capture=False)
            elif precompile.enabled():  # graphs saved by an earlier process load in seconds
                self._compiled = precompile.PrecompiledForward(model, options)
            else:
                self._compiled = torch.compile(model.forward, dynamic=True, options=options)
        self.compiled_calls = 0
        self.reset(1, 0)

    def cache_bytes(self) -> int:
        """Bytes of the KV buffers this runner holds between calls (reused or freed by the next reset)."""
        return sum(t.numel() * t.element_size() for kv in self._pool.values() for t in kv)

    @property
    def compiled(self) -> bool:
        return self._compiled is not None

    def compile_events(self) -> tuple[int, float, int]:
        """Since this runner was built: graphs compiled in the calls that needed them (no saved graph covered
        the call), the seconds those compiles took, and the times a changed model dropped the graphs. All 0
        unless the runner holds saved graphs (:class:`specdec.precompile.PrecompiledForward`)."""
        c = self._compiled
        return (getattr(c, "captured", 0), getattr(c, "capture_seconds", 0.0), getattr(c, "dropped", 0))

    def reset(self, batch_size: int, capacity: int) -> None:
        """Drop all state: ``batch_size`` empty rows with room for ``capacity`` positions each.

        Cache buffers of an earlier call are reused where they fit (same rows, at least this capacity) and
        otherwise freed here, before any new one is allocated, so old and new never coexist."""
        if any(k.shape[0] != batch_size or k.shape[2] < capacity for k, _ in self._pool.values()):
            self._pool.clear()
        self.batch_size = batch_size
        if getattr(self, "cache", None) is not None:
            self.cache.drop()
        self.cache = PreallocatedCache(self.config.num_hidden_layers, batch_size, capacity, self.device, self._pool)
        if self._compiled is not None and self.device.type == "cpu":
            from specdec.linear import refresh_packed

            refresh_packed(self.model)  # weights changed since the last generation are repacked here
        if hasattr(self._compiled, "check_model"):
            self._compiled.check_model()  # saved graphs do not guard the model's tensors: a changed model drops them

    def release(self) -> None:
        """Free the cache buffers held for reuse (the next :meth:`reset` allocates its own): what a throwaway
        run, such as a step-cost calibration, would otherwise leave sized for itself."""
        self._pool.clear()
        self.reset(self.batch_size, 0)

    def warm_up(self, extra_inputs: Callable[[int], dict] | None = None,
                return_hidden: bool | tuple[bool, ...] = False, catch_up: bool = False) -> None:
        """Compile now (``compile=True``; otherwise nothing to do): one forward of each kind a single-row
        decode loop runs, a single token, a chain, a tree, a chain and a tree of at least
        :data:`WIDE_TREE_SDPA` nodes (their attention route) and a tree past 32 nodes (a wider packed mask), on
        a throwaway context. Drops all state.

        extra_inputs: ``extra_inputs(t) -> dict``, the model inputs beside ``t`` tokens that the decode loop
        passes (a feature-conditioned draft's ``target_hidden``: :func:`specdec.draft_models.warm_up_inputs`
        makes them); implies ``catch_up``.
        catch_up: the context is read by a chain through :meth:`forward_tree` on an empty cache, compiled, as a
        drafter's first catch-up reads a short prompt (:data:`specdec.drafters.draft_model.CATCH_UP_ALL_LOGITS`),
        instead of by :meth:`prefill` (eager): a draft's runner needs that graph, a target's does not.
        return_hidden: compile the forwards that return the last hidden state (``True``), those that do not
        (``False``), or both (``(False, True)``): they are separate graphs, and a feature-conditioned draft's
        forwards, and the target's beside one, return it.

        A failure raises a ``RuntimeError`` that names the model, chained to the compile's own exception.
        """
        if self._compiled is None or not getattr(self._compiled, "capture", True):
            return
        try:
            for hidden in (return_hidden,) if isinstance(return_hidden, bool) else return_hidden:
                self._warm_up(extra_inputs, hidden, catch_up or extra_inputs is not None)
        except Exception as exc:
            self.reset(1, 0)
            raise RuntimeError(f"compiling the decode forwards of {model_label(self.model)} failed: {exc!r}") from exc

    def _warm_up(self, extra_inputs: Callable[[int], dict] | None, return_hidden: bool, catch_up: bool) -> None:
        # Sizes that equal no other dynamic size: symbols with equal values when first traced are unified
        # (a tree size equal to the cache capacity less its offset would specialise the graph to that).
        extra = extra_inputs or (lambda t: None)
        ids = torch.zeros(1, 20, dtype=torch.int64, device=self.device)
        n = ids.shape[1]
        self.reset(1, 97)
        if not catch_up:
            self.prefill(ids, torch.tensor([n], device=self.device), return_hidden)
        else:
            if return_hidden or extra_inputs is not None:
                # One eager forward first: transformers installs its output-capturing hooks on a model's first
                # forward that returns hidden states, under a lock that would break a compiled graph.
                with torch.inference_mode():
                    self._run(ids, torch.arange(n, device=self.device)[None], None, logits_to_keep=1,
                              return_hidden=return_hidden, extra_inputs=extra(n))
            # Then the context as a drafter's first catch-up reads it: a chain on an empty cache, compiled, in
            # both forms decoding meets: the forward allocates the cache's buffers (a runner's first generation,
            # or one longer than any before), or it reuses larger ones kept from an earlier generation (a
            # capacity below the buffers': sizes equal when traced would be unified, and the graph specialised).
            self._pool.clear()
            for capacity in (97, 89):
                self.reset(1, capacity)
                self.forward_tree(DraftTree.chain(ids[:, 0], ids[:, 1:]), return_hidden, extra(n))
            self.commit(torch.arange(n, device=self.device)[None], torch.tensor([n], device=self.device), True, [n])
        root = ids[:, 0]
        trees = (DraftTree.chain(root), DraftTree.chain(root, ids[:, :4]),
                 DraftTree.from_chains(root, [[[1, 2], [3, 4, 5]]]),
                 DraftTree.chain(root, ids[:, :12]), DraftTree.from_chains(root, [[[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]]),
                 DraftTree.from_chains(root, [[[i, i + 1, i + 2] for i in range(1, 34, 3)]]))  # > 32 nodes: a wider mask
        from tqdm import tqdm

        # Minutes the first time on a CPU (seconds per graph from inductor's cache after): a bar, not a silent wait.
        desc = f"compiling {type(self.model).__name__}" + (" (hidden states)" if return_hidden else "")
        for tree in tqdm(trees, desc=desc, unit="graph", leave=False):
            self.forward_tree(tree, return_hidden, extra(tree.size))
        self.reset(1, 0)

    def use_eager(self) -> None:
        """Run every forward eagerly from now on (a runner whose compile failed). Drops all state."""
        self._compiled = None
        self.compile_options = None
        self.reset(1, 0)

    @property
    def lengths(self) -> torch.Tensor:
        """``[B] int64`` committed KV per row (device)."""
        return self.cache.lengths

    @property
    def lengths_host(self) -> list[int]:
        """Committed KV per row, on the host (no device sync)."""
        return self.cache.lengths_host

    @property
    def pending(self) -> int:
        """Uncommitted nodes written past ``write_pos`` (the pending region's size ``N``)."""
        return self.cache.pending

    def _set_lengths_host(self, lengths: list[int]) -> None:
        self.cache.lengths_host = lengths
        self.cache.write_pos = max(lengths, default=0)

    def _run(self, input_ids, positions, tree_mask, logits_to_keep=0, return_hidden=False, extra_inputs=None,
             compiled=False, key_positions=None):
        """One forward of ``T`` new nodes, written after the pending region. key_positions: ``[B,N]`` the
        positions of every pending node, these included, when nodes are already pending (else None)."""
        t = input_ids.shape[1]
        end = self.cache.write_pos + self.cache.pending + t
        if end > self.cache.capacity:
            raise ValueError(f"{end} positions exceed the cache capacity {self.cache.capacity}")
        if t == 1 and key_positions is None:
            tree_mask = None  # a lone root sees the prefix and itself, as causal attention does
        forward = self.model
        if compiled and self._compiled is not None:
            forward = self._compiled
            self.compiled_calls += 1
            # A compiled graph is specialised on whether its inputs are inference tensors; callers make
            # them either way, so they are all made inference tensors here (a copy of a few ints; extra
            # inputs, such as a feature-conditioned draft's target states, are inference tensors in decoding).
            input_ids, positions = _inference(input_ids), _inference(positions)
            tree_mask = None if tree_mask is None else _inference(tree_mask)
            key_positions = None if key_positions is None else _inference(key_positions)
            if extra_inputs:
                extra_inputs = {k: _inference(v) if isinstance(v, torch.Tensor) else v for k, v in extra_inputs.items()}
        prompt = self.cache.write_pos + self.cache.pending == 0 and tree_mask is None
        attention, native = route_attention(self.attention, self.device, t, prompt)
        meta = TreeAttentionMeta(self.cache.lengths, self.cache.write_pos, tree_mask, positions, self.batch_size == 1,
                                 attention, native, key_positions)
        out = forward(
            input_ids=input_ids,
            position_ids=positions,
            past_key_values=self.cache,
            attention_mask=meta.model_mask(),  # a 4-D mask (or None for one token) spares transformers' mask building
            use_cache=True,
            logits_to_keep=logits_to_keep,
            output_hidden_states=return_hidden,
            specdec_meta=meta,
            **(extra_inputs or {}),
        )
        hidden = out.hidden_states[-1] if return_hidden else None
        return out.logits, hidden

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, prompt_lens: torch.Tensor, return_hidden: bool = False):
        """Encode right-padded prompts. input_ids: ``[B,L]``; prompt_lens: ``[B]``.

        Commits every prompt token's KV. Returns logits ``[B,V]`` at each row's last prompt token,
        and when asked the last hidden state at every prompt position ``[B,L,H]`` (columns past a
        row's prompt length are padding), which feature-conditioned drafters read.
        """
        b, l = input_ids.shape
        if b != self.batch_size:
            raise ValueError(f"prefill of {b} rows on a runner reset for {self.batch_size}")
        lens = prompt_lens.tolist()
        self.drop_pending()
        if b == 1 or len(set(lens)) == 1:
            positions = torch.arange(l, device=self.device).expand(b, l)
            logits, hidden = self._run(input_ids, positions, None, logits_to_keep=1, return_hidden=return_hidden)
            self.cache.lengths.copy_(prompt_lens)
            self._set_lengths_host(lens)
            return logits[:, -1], hidden
        # Ragged rows: logits are wanted at a different column per row. Encode all but each row's
        # last token (logits of one column only), then the last tokens as one-node trees.
        heads = [n - 1 for n in lens]
        head = max(heads)
        hidden = None
        if head > 0:
            if sum(max(n, ROW_PREFILL_MIN) for n in heads) < b * head:
                hidden = self._encode_rows(input_ids, heads, return_hidden)
            else:
                positions = torch.arange(head, device=self.device).expand(b, head)
                _, hidden = self._run(input_ids[:, :head], positions, None, logits_to_keep=1,
                                      return_hidden=return_hidden)
        self.cache.lengths.copy_(prompt_lens - 1)
        self._set_lengths_host(heads)
        rows = torch.arange(b, device=self.device)
        last_tokens = DraftTree.chain(input_ids[rows, prompt_lens - 1])
        logits, last_hidden = self.forward_tree(last_tokens, return_hidden)
        self.commit(torch.zeros(b, 1, dtype=torch.int64, device=self.device), torch.ones_like(prompt_lens), True,
                    [1] * b)
        if return_hidden:
            full = last_hidden.new_zeros(b, l, last_hidden.shape[-1])
            if hidden is not None:
                full[:, :head] = hidden
            full[rows, prompt_lens - 1] = last_hidden[:, 0]
            hidden = full
        return logits[:, 0], hidden

    def _encode_rows(self, input_ids: torch.Tensor, heads: list[int], return_hidden: bool):
        """Encode row ``i``'s first ``heads[i]`` tokens into its cache row, one row per forward (a padded
        ``[B, max(heads)]`` forward computes every row at the longest row's length, and its attention at
        that length squared). Each forward runs on a one-row cache whose buffers are views of the batch's.
        input_ids: ``[B,L]``. Returns the last hidden state ``[B,max(heads),H]`` (padding past each row's
        head is zero) when ``return_hidden``, else None."""
        b, head = input_ids.shape[0], max(heads)
        cache, batch = self.cache, self.batch_size
        if not cache.layers[0].is_initialized and len(self._pool) == len(cache.layers) \
                and all(k.shape[0] == b for k, _ in self._pool.values()):  # last generation's buffers, if they fit
            for j, layer in enumerate(cache.layers):
                layer.keys, layer.values = cache.allocate(j, self._pool[j][0])
                layer.is_initialized = True
        hidden = None
        try:
            for i, n in enumerate(heads):
                if n == 0:
                    continue
                ready = cache.layers[0].is_initialized
                pool = {j: (layer.keys[i:i + 1], layer.values[i:i + 1]) for j, layer in enumerate(cache.layers)} \
                    if ready else {}
                row = PreallocatedCache(len(cache.layers), 1, cache.capacity, self.device, pool)
                self.cache, self.batch_size = row, 1
                positions = torch.arange(n, device=self.device)[None]
                _, h = self._run(input_ids[i:i + 1, :n], positions, None, logits_to_keep=1, return_hidden=return_hidden)
                if not ready:  # this row's forward sized the layers: make the batch buffers, and move the row in
                    for j, (layer, own) in enumerate(zip(cache.layers, row.layers)):
                        k, v = cache.allocate(j, own.keys.expand(b, -1, -1, -1))
                        k[i:i + 1, :, :n].copy_(own.keys[:, :, :n])
                        v[i:i + 1, :, :n].copy_(own.values[:, :, :n])
                        layer.keys, layer.values, layer.is_initialized = k, v, True
                if h is not None:
                    if hidden is None:
                        hidden = h.new_zeros(b, head, h.shape[-1])
                    hidden[i, :n] = h[0]
                row.drop()  # the first row's own buffers go now, not at the next garbage collection
        finally:
            self.cache, self.batch_size = cache, batch
        return hidden

    @torch.inference_mode()
    def forward_tree(self, tree: DraftTree, return_hidden: bool = False, extra_inputs: dict | None = None,
                     logits_at: list[int] | None = None):
        """Run the model over a draft tree. Returns logits ``[B,T,V]`` and the last hidden state
        ``[B,T,H]`` (None unless ``return_hidden``).

        The tree's KV is written at ``write_pos`` as a fresh pending region of ``T`` nodes (whatever was
        pending is dropped first); call :meth:`commit` (or :meth:`commit_pending`) with the accepted path,
        or grow the tree further with :meth:`forward_pending`.
        ``extra_inputs``: further per-node model inputs, e.g. ``{"target_hidden": [B,T,H]}`` for a
        feature-conditioned draft.
        ``logits_at``: only these node columns' logits, ``[B,len(logits_at),V]``, for a prompt-sized forward
        that needs a few (a draft catching up on a prompt); it runs eager, as a prefill does, so the compiled
        graphs stay those of decoding.
        """
        positions = tree.positions(self.cache.lengths)
        self.drop_pending()
        keep = 0 if logits_at is None else torch.tensor(logits_at, device=self.device)
        out = self._run(tree.tokens, positions, tree.mask, keep, return_hidden=return_hidden,
                        extra_inputs=extra_inputs, compiled=logits_at is None)
        self.cache.pending, self.cache.pending_positions = tree.size, positions
        return out

    @torch.inference_mode()
    def forward_pending(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                        return_hidden: bool = False, extra_inputs: dict | None = None):
        """Run ``F`` new frontier nodes over the committed prefix and the pending region, then add them to it.

        The ``N - F`` = :attr:`pending` nodes written by earlier forwards of this region are attended over
        from the cache, not recomputed. Node ``j`` of the region (``j < N``, in the order written) is
        the new node ``j - (N - F)`` of this call when ``j >= N - F``.

        Args:
            tokens: ``[B,F]`` int64 token ids of the new nodes.
            positions: ``[B,F]`` int64 absolute positions (committed length plus depth, as
                :meth:`DraftTree.positions` gives them).
            mask: ``[B,F,ceil(N/32)]`` int32 packed: bit ``j`` of row ``i`` set iff new node ``i`` sees
                pending node ``j`` (its ancestors and itself); or None, a causal chain (new node ``i`` sees
                every earlier pending node and itself). Every node sees its row's committed prefix. Rows
                with fewer new nodes pad them (any token and position) and no real node's row sets a
                padding node's bit; a padding node's own row may be empty (it sees the committed prefix
                only) or show itself: its logits are meaningless but finite. With ``N == 1`` the node
                always sees itself.
            return_hidden: also return the last hidden state.
            extra_inputs: further per-node model inputs (as in :meth:`forward_tree`).
        Returns:
            logits ``[B,F,V]`` and the last hidden state ``[B,F,H]`` (None unless ``return_hidden``).
        """
        b, f = tokens.shape
        n = self.cache.pending + f
        if mask is not None and tuple(mask.shape) != (b, f, (n + 31) // 32):
            raise ValueError(f"mask must be [B, F, ceil(N/32)] = [{b}, {f}, {(n + 31) // 32}] with N = {n} "
                             f"pending nodes, got {list(mask.shape)}")
        if tuple(positions.shape) != (b, f):
            raise ValueError(f"positions must be [B, F] = [{b}, {f}], got {list(positions.shape)}")
        keys = None if self.cache.pending == 0 else torch.cat([self.cache.pending_positions, positions], dim=1)
        out = self._run(tokens, positions, mask, return_hidden=return_hidden, extra_inputs=extra_inputs,
                        compiled=True, key_positions=keys)
        self.cache.pending, self.cache.pending_positions = n, positions if keys is None else keys
        return out

    @torch.inference_mode()
    def commit_pending(self, path: torch.Tensor, path_len: torch.Tensor, counts: list[int] | None = None) -> None:
        """Keep the KV of each row's accepted path through the pending region and drop the rest.

        path: ``[B,P]`` int64 indices into the pending region, ascending (root to leaf), -1 padded;
        path_len: ``[B]`` int64; counts: ``path_len`` on the host if the caller has it. One
        KV-compaction call moves the path to ``lengths[b] ...`` (nothing moves where it is in place).
        """
        if self.cache.pending == 0:
            raise ValueError("nothing is pending: run forward_tree or forward_pending first")
        self.commit(path, path_len, False, counts)

    def drop_pending(self) -> None:
        """Forget the pending region (no data moves); the committed prefix is untouched."""
        self.cache.pending, self.cache.pending_positions = 0, None

    @torch.inference_mode()
    def commit(self, path: torch.Tensor, path_len: torch.Tensor, is_chain: bool,
               counts: list[int] | None = None) -> None:
        """Keep the accepted nodes' KV. path: ``[B,T]`` node indices into the pending region (-1 padded);
        path_len: ``[B]``. Whatever else was pending is dropped.

        ``counts``: ``path_len`` on the host, which callers usually have already (else it is read back).
        Where every row's committed KV ends at ``write_pos`` (one row, or batch rows of equal length) and
        the accepted path is nodes ``0, 1, 2, ...`` (a chain, or a tree's first branch: trees number
        their first chain first), the accepted KV is already in place and nothing moves.
        """
        counts = path_len.tolist() if counts is None else counts
        rows_aligned = all(n == self.cache.write_pos for n in self.cache.lengths_host)
        in_place = rows_aligned and is_chain
        if rows_aligned and not is_chain:
            ar = torch.arange(path.shape[1], device=path.device)
            in_place = bool(((path == ar) | (ar >= path_len[:, None])).all())
        if not in_place:
            src = self.cache.write_pos + path.clamp(min=0)
            kernels.kv_compact(self.cache.buffers(), src, self.cache.lengths, path_len.long())
        self.cache.lengths += path_len.long()
        self._set_lengths_host([n + c for n, c in zip(self.cache.lengths_host, counts)])
        self.drop_pending()

    @torch.inference_mode()
    def keep_rows(self, rows: list[int]) -> None:
        """Keep only the batch rows ``rows`` (ascending indices), in that order: finished rows leave the batch,
        so later forwards compute ``len(rows)`` rows. Each kept row's committed KV moves down in place, row
        ``rows[j]`` to ``j`` from the first row that moves on (a source is never a row written before it: no
        temporary); the buffers stay allocated at their full batch for the next :meth:`reset`. Nothing may be
        pending."""
        if self.cache.pending:
            raise ValueError("keep_rows with nodes pending: commit or drop them first")
        if not rows or sorted(set(rows)) != list(rows) or rows[-1] >= self.batch_size:
            raise ValueError(f"rows must be ascending batch indices below {self.batch_size}, got {rows}")
        if len(rows) == self.batch_size:
            return
        n, lengths = len(rows), self.cache.lengths_host
        first = next((j for j, r in enumerate(rows) if r != j), n)
        for layer in self.cache.layers:
            if layer.is_initialized:
                for buf in (layer.keys, layer.values):
                    for j in range(first, n):
                        m = lengths[rows[j]]  # its committed KV; past it nothing is visible
                        buf[j, :, :m].copy_(buf[rows[j], :, :m])
                layer.keys, layer.values = layer.keys[:n], layer.values[:n]
                for t in (layer.keys, layer.values):  # as allocate() marks the buffers (see there)
                    torch._dynamo.mark_static(t, 1)
                    torch._dynamo.mark_static(t, 3)
        self.cache.lengths = self.cache.lengths[:n].clone() if first == n else \
            self.cache.lengths.index_select(0, torch.tensor(rows, dtype=torch.int64, device=self.device))
        self._set_lengths_host([self.cache.lengths_host[r] for r in rows])
        self.batch_size = n

    @torch.inference_mode()
    def rollback(self, lengths: list[int]) -> None:
        """Forget KV past ``lengths`` (host ints, one per row; no data moves)."""
        kept = [min(n, m) for n, m in zip(self.cache.lengths_host, lengths)]
        self.cache.lengths.copy_(torch.tensor(kept, dtype=torch.int64))
        self._set_lengths_host(kept)
        self.drop_pending()
