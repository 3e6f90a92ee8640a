"""Memory a generation call needs, what the process may use, and batch chunks that fit.

A call allocates, beside the weights already loaded: the target's preallocated KV cache (every row's prompt, new
tokens and the largest draft tree the method can propose), the draft's cache, and transient buffers, the largest
of which are the prompt forward's activations (one row's where ragged prompts are encoded row by row), a decode
step's logits with the verification's fp32 copies of them, and the draft's own widest forwards; before them, a
batch's step-cost calibration runs on a cache of its own. :func:`estimate` adds these up from the model configs;
:func:`chunks` splits a batch into consecutive runs of rows that fit a limit (rows are independent, so outputs
do not change). The one measured factor, a forward's bytes per token, comes from single forwards, not from the
generations' peaks that check the estimate (``python -m bench.memory``; bench/RESULTS.md, "Memory").
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import torch

GIB = 2**30


class MemoryLimitError(MemoryError):
    """A call does not fit the memory it may use (and chunking is off, or one row alone is too large)."""

# Transient bytes per token of a prompt-sized forward, per (hidden + intermediate) element: the MLP's gate, up and
# product rows and the attention's rows live at once. Measured on single padded forwards of SmolLM2-135M and its
# draft (16 x 128 and 4 x 512 tokens): 12.0-13.2 bytes in fp32, 7.7-8.8 in bf16
# (`python -m bench.memory --forwards 16x128,4x512 --draft smollm2-draft`; bench/RESULTS.md, Memory).
FORWARD_BYTES = {4: 14.0, 2: 9.0}
# fp32 copies of a step's logits ([B,T,V] each) the verifier makes beyond widening half-precision logits:
# greedy none (the argmax reads the widened logits); sampling the processed logits and their softmax, and
# with top-p the sort's values, order (int64, two) and cumulative sums.
GREEDY_COPIES = 0.0
SAMPLING_COPIES = 2.0
TOP_P_COPIES = 4.0


def parse_bytes(value: int | float | str) -> int:
    """``value`` in bytes: a number, or a string such as ``"512MiB"`` (powers of 1024 with ``i``) or ``"2.5GB"``,
    ``"8G"`` (powers of 1000 without)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"a memory size must be > 0, got {value}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?)[bB]?\s*", str(value))
    if not m:
        raise ValueError(f"cannot read {value!r} as a memory size (e.g. 512MiB, 2.5GB, 8G)")
    scale = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}[m.group(2).lower()]
    base = 1024 if m.group(3) else 1000
    out = int(float(m.group(1)) * base ** scale)
    if out <= 0:
        raise ValueError(f"a memory size must be > 0, got {value!r}")
    return out


def available_bytes(device: torch.device | str) -> int:
    """What a call may still allocate on ``device``: free device memory on a GPU; on the CPU the kernel's
    MemAvailable, or less where a cgroup (container) limit leaves less."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    if avail is None:
        import psutil

        avail = int(psutil.virtual_memory().available)
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2**60:
            avail = min(avail, int(limit) - usage)
        break
    return max(0, avail)


def _dims(config) -> tuple[int, int, int, int, int, int]:
    """layers, KV heads, head size, hidden size, MLP size and vocabulary of a (text) config."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    inter = getattr(c, "intermediate_size", None) or 4 * c.hidden_size
    return c.num_hidden_layers, kv, head_dim, c.hidden_size, inter, c.vocab_size


def kv_cache_bytes(config, rows: int, capacity: int, dtype: torch.dtype) -> int:
    """Keys and values of every layer for ``rows`` rows of ``capacity`` positions (the runner preallocates
    all of it, sliding-window layers included)."""
    layers, kv, head_dim, *_ = _dims(config)
    return 2 * layers * rows * kv * capacity * head_dim * torch.empty(0, dtype=dtype).element_size()


@dataclass
class MemoryEstimate:
    """Bytes a call needs beyond the loaded weights, by part."""

    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def __str__(self) -> str:
        inner = ", ".join(f"{k} {v / GIB:.2f}" for k, v in self.parts.items() if v)
        return f"{self.total / GIB:.2f} GiB ({inner})"


@dataclass
class CallShape:
    """What a call's memory depends on besides its rows: the models, the largest draft tree (nodes, root
    included; 0 for autoregressive decoding, which keeps no margin), whether the drafter reads the target's
    hidden states, and the draft model's own widest tree."""

    target: torch.nn.Module
    draft: torch.nn.Module | None
    tree_nodes: int
    max_new_tokens: int
    sampling_copies: float
    needs_hidden: bool = False
    # Nodes the draft model's own forwards grow past the longest sequence (a tree or lookahead window in its
    # pending region; 0 for a chain); None: as many as the target's tree (a method running its own loop).
    draft_nodes: int | None = None


def estimate(shape: CallShape, prompt_lens: list[int]) -> MemoryEstimate:
    """The memory a call over prompts of ``prompt_lens`` tokens needs (see the module docstring): its caches plus
    the largest transient of its phases, or the first phase, a batch step-cost calibration, where that is larger."""
    b, longest = len(prompt_lens), max(prompt_lens)
    seq = longest + shape.max_new_tokens + 1
    cfg, dtype = shape.target.config, shape.target.dtype
    size, per_token = _forward_bytes(shape.target)
    layers, _, _, hidden, inter, vocab = _dims(cfg)
    parts = {"target KV": kv_cache_bytes(cfg, b, seq + shape.tree_nodes, dtype)}
    draft_nodes = shape.tree_nodes if shape.draft_nodes is None else shape.draft_nodes
    if shape.draft is not None:
        from specdec.drafters.draft_model import DRAFT_CACHE_SLACK

        parts["draft KV"] = kv_cache_bytes(shape.draft.config, b, seq + draft_nodes + DRAFT_CACHE_SLACK,
                                           shape.draft.dtype)
    # Ragged prompts are encoded one row per forward where padding would waste work (ModelRunner.prefill).
    rows = 1 if _rowwise_prefill(prompt_lens) else b
    prefill = int(per_token * rows * longest)
    if shape.needs_hidden:  # every layer's hidden states of the prompt (output_hidden_states), and the last one's
        prefill += (layers + 1) * rows * longest * hidden * size + b * longest * hidden * size
    t = max(1, shape.tree_nodes)  # tokens per step (autoregressive decoding keeps no tree margin)
    logits = b * t * vocab
    copies = shape.sampling_copies + (0 if size == 4 else 1)  # half-precision logits are widened once
    step = logits * size + int(copies * logits * 4) + int(per_token * b * t)
    transient = max(prefill, step, _draft_transient(shape.draft, b, longest, max(t, draft_nodes)))
    if shape.tree_nodes and b > 1:  # before the call's caches exist: StepCost.ensure_batch's own run
        transient = max(transient, _calibration_bytes(shape.target, b, per_token) - sum(parts.values()))
    parts["transient"] = transient
    return MemoryEstimate(parts)


def _forward_bytes(model: torch.nn.Module) -> tuple[int, float]:
    """``model``'s bytes per element and a prompt forward's transient bytes per token (:data:`FORWARD_BYTES`)."""
    _, _, _, hidden, inter, _ = _dims(model.config)
    size = torch.empty(0, dtype=model.dtype).element_size()
    return size, FORWARD_BYTES.get(size, FORWARD_BYTES[2]) * (hidden + inter)


def _rowwise_prefill(prompt_lens: list[int]) -> bool:
    """Whether :meth:`specdec.model.ModelRunner.prefill` encodes these prompts one row per forward."""
    from specdec.model import ROW_PREFILL_MIN

    heads = [n - 1 for n in prompt_lens]
    if len(set(prompt_lens)) == 1 or max(heads) == 0:
        return False
    return sum(max(n, ROW_PREFILL_MIN) for n in heads) < len(heads) * max(heads)


def _calibration_bytes(target: torch.nn.Module, b: int, per_token: float) -> int:
    """A batch step-cost calibration's peak (:meth:`specdec.policies.StepCost.ensure_batch`): its own cache over
    a short context and that context's padded prompt forward, at ``min(b, MAX_CALIBRATION_ROWS)`` rows."""
    from specdec.policies.cost import StepCost

    rows, context = min(b, StepCost.MAX_CALIBRATION_ROWS), 128
    capacity = context + max(StepCost.BATCH_SIZES) + 1
    return kv_cache_bytes(target.config, rows, capacity, target.dtype) + int(per_token * rows * context)


def _draft_transient(draft: torch.nn.Module | None, b: int, longest: int, t: int) -> int:
    """The larger of the draft's two widest forwards, counted as the target's are: catching up on the prompts
    (``b x longest`` tokens, logits at each row's last token only) and a step over at most ``t`` nodes (its
    logits, over the reduced vocabulary where the draft has one, and their fp32 copy)."""
    if draft is None:
        return 0
    vocab = getattr(draft.config, "draft_vocab_size", None) or _dims(draft.config)[5]
    size, per_token = _forward_bytes(draft)
    prompt = per_token * b * longest + b * min(b, longest) * vocab * size
    step = per_token * b * t + b * t * vocab * (size + 4)
    return int(max(prompt, step))


def sampling_copies(sampling) -> float:
    """fp32 ``[B,T,V]`` copies the verifier holds under ``sampling`` (a :class:`SamplingConfig`)."""
    if sampling.greedy:
        return GREEDY_COPIES
    return SAMPLING_COPIES + (TOP_P_COPIES if sampling.top_p is not None and sampling.top_p < 1.0 else 0.0)


def chunks(prompt_lens: list[int], need, limit: int) -> list[tuple[int, int]]:
    """Consecutive ``[start, end)`` runs of rows whose ``need(lens).total`` fits ``limit`` bytes, each as long
    as it can be (``need`` grows with rows). Raises :class:`MemoryLimitError` when one row alone does not fit."""
    out, start = [], 0
    while start < len(prompt_lens):
        one = need(prompt_lens[start:start + 1])
        if one.total > limit:
            raise MemoryLimitError(f"one row needs about {one} but {limit / GIB:.2f} GiB may be used: shorten the "
                              "prompt or max_new_tokens, or raise max_memory")
        lo, hi = start + 1, len(prompt_lens)  # the longest run from ``start`` that fits: binary search
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if need(prompt_lens[start:mid]).total <= limit:
                lo = mid
            else:
                hi = mid - 1
        out.append((start, lo))
        start = lo
    return out
