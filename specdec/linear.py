"""Linear layers for CPU targets that verify drafts: :class:`SkinnyLinear` and :func:`use_skinny_linear`.

A speculative step runs the target over T drafted tokens (T ~ 2-32). On CPUs without bf16 matrix
instructions torch's bf16 GEMM for more than one row re-reads the weights once per row, so the step
costs about T one-token steps, and its fp32 GEMM takes a slow path for 2-3 rows; speculation then
cannot gain. :func:`specdec.kernels.skinny_linear` streams the weights once for all rows and is
batch-invariant (a row's result does not depend on which other rows share the call), so verifying T
tokens agrees bit for bit with one-token decoding through every linear layer. On a CPU with AMX tiles
``--linear auto`` gives bf16 products over :data:`AMX_PACKED_MAX_ROWS` rows to torch's GEMM, which is
faster there and not batch-invariant: a wide verification may then round differently from one-token steps
in bf16 (never in fp32); ``--linear packed`` keeps the kernel, and bit-exact bf16, up to 64 rows (1024 on a CPU
with AVX-512-BF16 and no AMX, where the kernel's pair dot products beat torch's GEMM up to there). On an Intel CPU of
that kind a GGUF model's products of :data:`WIDEN_MIN_ROWS` rows or more widen to fp32 under ``auto``
(:func:`cpu_widens_prompts`): not batch-invariant either, and ``packed`` keeps them.

Prefill has the opposite problem: a bf16/fp16 product over many rows on such a CPU is 3-6x slower
than widening the weights to fp32 and calling the fp32 GEMM, so those calls are widened (where the
CPU has native bf16 matrix instructions, torch's own kernel is kept).

With ``prepack`` (the default of ``--linear packed`` and ``auto``) each weight is also kept prepacked
in column panels (:func:`specdec.kernels.pack_linear_weight`) for :func:`specdec.kernels.packed_linear`,
whose outer-product kernel is 2-3x faster than ``skinny_linear`` from four rows on and beats torch's
fp32 GEMM up to a few hundred rows on an AVX2 CPU, so prompts go through it too. The packed copy
costs one more copy of the weights in memory; it is rebuilt when the weight changes.

The swap replaces modules the way transformers' quantizers do (same parameters, same state dict);
no model code is changed. Calls with more rows than ``max_rows`` (prefill), with gradients, or off
the CPU go to ``nn.Linear.forward`` (widened as above).
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from specdec import settings
from specdec.cpuinfo import cpu_is_intel
from specdec.kernels import has_native, native_ops, pack_linear_weight

LINEAR_KERNELS = ("auto", "packed", "skinny", "torch")


@functools.lru_cache(maxsize=None)
def _op(name: str = "skinny_linear"):
    """``torch.ops.specdec.<name>.default``; raises where the compiled extension is missing."""
    ops = native_ops()
    if ops is None or not hasattr(ops, name):
        raise RuntimeError("SkinnyLinear needs the compiled extension specdec._C (pip install --no-build-isolation -e .)")
    return getattr(ops, name).default


_HALF_GEMM_FEATURES = {
    torch.bfloat16: ("_is_avx512_bf16_supported", "_is_amx_tile_supported"),
    torch.float16: ("_is_amx_fp16_supported",),
}


@functools.lru_cache(maxsize=None)
def cpu_has_half_gemm(dtype: torch.dtype) -> bool:
    """Whether this CPU has matrix instructions for ``dtype`` (bf16: AVX-512 BF16 or AMX; fp16: AMX-FP16),
    for which torch's half-precision GEMM is fast; without them it is a slow fallback."""
    cpu = torch.cpu
    return any(getattr(cpu, name, lambda: False)() for name in _HALF_GEMM_FEATURES.get(dtype, ()))


def widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x . W^T + b`` for half-precision CPU tensors through the fp32 GEMM, rounded back to ``x``'s dtype.

    x: ``[..., K]``; weight: ``[N,K]``; bias: ``[N]`` or None -> ``[..., N]``. Widening costs one pass
    over the weights, repaid from a few dozen rows on: :class:`SkinnyLinear` uses it for every call over
    ``max_rows`` rows (a prompt, or a verification wider than ``max_rows`` tokens).
    """
    out = nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return out.to(x.dtype)


@functools.lru_cache(maxsize=None)
def cpu_widens_prompts(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` products over many rows (prompts) run fastest widened to fp32 (:func:`widened_linear`)
    where the half-precision instructions this CPU has are AVX-512-BF16 pair dot products, not AMX tiles, on an
    Intel CPU: there they run no faster than its fp32 FMAs, which torch's fp32 GEMM drives better than the packed
    kernel. Intel Xeon (AVX-512-BF16, no AMX exposed), 2 threads, all 211 weights of SmolLM2-135M over M rows, ms,
    packed kernel / widened: 128.3 / 146.3 at 64, 250.5 / 212.0 at 128, 490.5 / 363.7 at 256, 969.7 / 661.3 at 512
    (bench/results/prompt_linears_widened_xeon_2t.json, ``bench.profile model-linears --kernels packed,widened``);
    torch's own bf16 GEMM ran at 100 GFLOPS there, its fp32 GEMM at 195-255. On an AMD Zen 4 the pair dot
    products beat torch's bf16 GEMM to 1024 rows (:func:`cpu_has_bf16_dot`; the widened GEMM was not measured
    there), so nothing changes on other CPUs. Read by :class:`specdec.gguf_weights.QuantLinear` for the products
    of :data:`WIDEN_MIN_ROWS` rows or more (unless ``--linear packed`` asked for batch invariance); the dense path's
    limits (and so the bench's ``hf`` baseline) stay as they are."""
    return cpu_has_half_gemm(dtype) and not cpu_has_matrix_tiles(dtype) and cpu_is_intel()


# Rows from which :func:`cpu_widens_prompts` widens: the packed kernel still won at 64 rows, the widened GEMM at 128.
WIDEN_MIN_ROWS = 128


@functools.lru_cache(maxsize=None)
def cpu_has_matrix_tiles(dtype: torch.dtype) -> bool:
    """Whether this CPU has AMX tiles for ``dtype`` (bf16 only: the one dtype measured), on which torch's
    GEMM (oneDNN) beats :func:`specdec.kernels.packed_linear` from a handful of rows on."""
    return dtype == torch.bfloat16 and bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


# Rows up to which packed_linear beats torch's bf16 GEMM on an AMX CPU: all 211 weights of SmolLM2-135M
# (256 MiB, streamed from DRAM) over M rows, Xeon with AMX, torch 2.13. One thread: packed 44.0 ms against
# torch's 48.6 at 8 rows, 65.7 against 52.5 at 12, 83.0 against 53.0 at 16; two threads: 25.5 against 30.1 at 8,
# 30.3 against 27.6 at 9 (bench/results/model_linears_amx_{1t,2t}.json, `bench.profile model-linears
# --kernels packed,torch`).
AMX_PACKED_MAX_ROWS = 8


# Rows up to which packed_linear's bf16 pair dot products take a product on a CPU without AMX tiles.
BF16_DOT_MAX_ROWS = 1024


@functools.lru_cache(maxsize=None)
def cpu_has_bf16_dot() -> bool:
    """Whether packed_linear's bf16 products use AVX-512-BF16 pair dot products (``VDPBF16PS``,
    csrc/packed_linear.cpp), unless ``SPECDEC_BF16_DOT=0`` keeps them on the kernel's fp32 path, with the row
    limits that path had (64 without AMX tiles; an A/B switch). All 211 weights of SmolLM2-135M over M rows,
    AMD EPYC Zen 4, one thread, ms, this path / torch's GEMM (bench/results/model_linears_zen4_dot_1t.json):
    28.9 / 52.9 at 16 rows, 87.4 / 110.7 at 64, 317.4 / 340.9 at 256 (the fp32 path, model_linears_zen4_1t.json:
    49.2 at 16, 168.2 at 64), and 652.2 / 691.4 at 512, 1309.3 / 1366.9 at 1024
    (model_linears_zen4_dot_long_1t.json), so there the kernel keeps products of up to :data:`BF16_DOT_MAX_ROWS`
    rows, prompts included."""
    if settings.get("SPECDEC_BF16_DOT") == "0":
        return False
    return bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())


def default_max_rows(dtype: torch.dtype, prepack: bool = False, tiles: bool = False) -> int:
    """Rows up to which the skinny or packed kernel is used on CPU. Measured on an AVX2 CPU, 2 threads:

    - ``skinny_linear``: torch's fp32 GEMM catches up at about 16 rows. For bf16 it beats torch's bf16
      fallback at any size and the widened fp32 GEMM (:func:`widened_linear`) up to about 64 rows.
    - ``packed_linear`` (prepack): faster than torch's fp32 GEMM and the widened one at every size
      measured up to 256 rows (a [1536, 576] product over 256 rows: 2.4 ms against 2.6 ms fp32 and
      2.9 ms widened bf16). Past that the kernel, which streams all rows of x once per panel, is not
      blocked for cache, so 256 is its limit there (the bf16 pair-dot path below still wins at 1024 rows).

    With AVX-512-BF16 but no AMX tiles (:func:`cpu_has_bf16_dot`; measured on an AMD Zen 4) the packed
    kernel's bf16 products beat torch's GEMM up to 1024 rows (:data:`BF16_DOT_MAX_ROWS`). With ``tiles`` and
    AMX tiles for ``dtype`` (:func:`cpu_has_matrix_tiles`), torch's GEMM wins from 9 rows on:
    :data:`AMX_PACKED_MAX_ROWS` (measured before the pair dot products, which also run on such CPUs; not measured
    since). Otherwise, on a CPU with
    half-precision matrix instructions (:func:`cpu_has_half_gemm`), both kernels keep 64 rows: bf16 on an AMX
    CPU without ``tiles`` or with ``SPECDEC_BF16_DOT=0``, and fp16, which was not measured."""
    if prepack and tiles and cpu_has_matrix_tiles(dtype):
        return AMX_PACKED_MAX_ROWS
    if prepack and not cpu_has_half_gemm(dtype):
        return 256
    if prepack and dtype == torch.bfloat16 and cpu_has_bf16_dot() and not cpu_has_matrix_tiles(dtype):
        return BF16_DOT_MAX_ROWS
    return 16 if dtype == torch.float32 else 64


class SkinnyLinear(nn.Linear):
    """``nn.Linear`` whose CPU products over at most ``max_rows`` rows use :func:`specdec.kernels.skinny_linear`,
    or with ``prepack`` :func:`specdec.kernels.packed_linear` over a packed copy of the weight; with
    ``widen``, half-precision CPU products over more rows use :func:`widened_linear`."""

    max_rows: int = 16
    widen: bool = False
    prepack: bool = False

    @classmethod
    def from_linear(cls, linear: nn.Linear, max_rows: int, widen: bool | None = None,
                    prepack: bool = False) -> "SkinnyLinear":
        """A SkinnyLinear sharing ``linear``'s weight and bias Parameters (ties are kept).

        widen: run half-precision products over more than ``max_rows`` rows through
        :func:`widened_linear` (default: where the CPU lacks bf16/fp16 matrix instructions).
        prepack: use :func:`specdec.kernels.packed_linear` (the packed weight is built here for CPU
        weights, else on first use)."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        new.weight = linear.weight
        new.bias = linear.bias
        new.max_rows = max_rows
        new.widen = (not cpu_has_half_gemm(linear.weight.dtype)) if widen is None else widen
        new.prepack = prepack
        new.repack()
        if prepack and linear.weight.device.type == "cpu":
            new.packed_weight()  # now, not in the first forward
        new.train(linear.training)
        return new

    def packed_weight(self) -> torch.Tensor:
        """The weight packed for :func:`specdec.kernels.packed_linear`: ``[ceil(N / 16), K, 16]``.

        A plain attribute, not a buffer (``module.to(dtype)`` would convert it without re-packing, and
        the bf16 layout differs). It is rebuilt when the weight is replaced, converted or moved
        (``.to``), loaded (``load_state_dict``) or updated in place through the Parameter (its version
        counter). Updates through ``weight.data`` bypass the version counter: call :meth:`repack` after them."""
        w = self.weight
        version = None if w.is_inference() else w._version  # inference tensors have no version counter
        src = self._packed_src  # keeps the packed storage alive, so its address cannot be reused
        if src is None or src.data_ptr() != w.data_ptr() or src.dtype != w.dtype or self._packed_version != version:
            self._packed = pack_linear_weight(w)
            self._packed_src, self._packed_version = w.detach(), version
        return self._packed

    def bytes_read(self) -> int:
        """Bytes of weights one product reads (the dense weight as held)."""
        return self.weight.numel() * self.weight.element_size()

    def compiled_inputs(self) -> list[torch.Tensor]:
        """The tensors a compiled forward reads as they are (kept static and up to date by :func:`refresh_packed`)."""
        return [self.packed_weight()] if self.prepack and self.weight.device.type == "cpu" else []

    def repack(self) -> None:
        """Drop the packed weight; the next CPU product rebuilds it."""
        self._packed = self._packed_src = self._packed_version = None

    def _apply(self, fn, recurse=True):
        self.repack()  # .to / .half / .cuda: nothing stale or duplicated survives a conversion
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs):
        self.repack()
        return super()._load_from_state_dict(*args, **kwargs)

    def __getstate__(self):
        return {**self.__dict__, "_packed": None, "_packed_src": None, "_packed_version": None}  # not pickled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: ``[..., in_features]`` -> ``[..., out_features]``."""
        # Called ~200 times per target step: the checks are the cheap ones, and the operator is called
        # directly (skinny_linear's argument checks cost more than the kernel at one row).
        k = self.in_features
        if (x.is_cpu and x.dtype == self.weight.dtype
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
            if 0 < x.numel() <= self.max_rows * k and x.shape[-1] == k > 0:
                shape = x.shape[:-1] + (self.out_features,)
                # Traced by torch.compile (ModelRunner(compile=True)): the op is looked up directly (the cached
                # lookup does not trace) and the packed weight is used as is (no data_ptr check; the runner
                # refreshes it, refresh_packed, before compiled forwards).
                traced = torch.compiler.is_compiling()
                name = "packed_linear" if self.prepack else "skinny_linear"
                op = getattr(torch.ops.specdec, name).default if traced else _op(name)
                if self.prepack:
                    packed = self._packed if traced else self.packed_weight()
                    return op(x.reshape(-1, k), packed, self.out_features, self.bias).view(shape)
                return op(x.reshape(-1, k), self.weight, self.bias).view(shape)
            if self.widen and x.dtype in (torch.bfloat16, torch.float16):
                return widened_linear(x, self.weight, self.bias)
        return super().forward(x)


def refresh_packed(model: nn.Module) -> None:
    """Bring every prepacked :class:`SkinnyLinear` of ``model`` up to date with its weight (a compiled
    forward reads the packed copies as they are; eager forwards check them on each call)."""
    for m in model.modules():
        if isinstance(m, SkinnyLinear):
            # Static under torch.compile(dynamic=True): a panel count that happens to equal some dynamic
            # size (the cache length) would otherwise be unified with it into one symbol.
            for t in m.compiled_inputs():
                torch._dynamo.mark_static(t)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of weights one forward of ``model`` reads through its linear layers, as the layers hold them
    (quantized blocks for :class:`specdec.gguf_weights.QuantLinear`, dense weights otherwise; the embedding,
    read a row a token, is left out). Times target forwards over seconds, it is the memory bandwidth a decode
    achieved (gpt-fast's measure)."""
    return sum(m.bytes_read() if isinstance(m, SkinnyLinear) else m.weight.numel() * m.weight.element_size()
               for m in model.modules() if isinstance(m, nn.Linear))


def use_skinny_linear(model: nn.Module, max_rows: int | None = None, prepack: bool = False,
                      tiles: bool = False) -> int:
    """Replace every ``nn.Linear`` of ``model`` in place by a :class:`SkinnyLinear` sharing its parameters.

    max_rows: largest product sent to the kernel (default :func:`default_max_rows` of the weights'
    dtype, kernel and ``tiles``: on an AMX CPU, hand bf16 products over 8 rows to torch, as ``--linear auto``
    does). prepack: use the packed kernel (:func:`specdec.kernels.packed_linear`).
    Returns the number of layers replaced.
    """
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                rows = max_rows if max_rows is not None else default_max_rows(child.weight.dtype, prepack, tiles)
                setattr(parent, name, SkinnyLinear.from_linear(child, rows, prepack=prepack))
                count += 1
    return count


def apply_linear_kernel(model: nn.Module, kernel: str, device: str) -> bool:
    """Apply the ``--linear`` choice: ``packed`` (:func:`specdec.kernels.packed_linear` over prepacked
    weights), ``skinny`` (:func:`specdec.kernels.skinny_linear` over the weights as stored), ``torch``
    (leave as is) or ``auto`` (packed on CPU when the compiled extension is built, and on an AMX CPU only
    up to :data:`AMX_PACKED_MAX_ROWS` rows, where it beats torch's GEMM). ``packed`` and ``skinny`` keep
    their kernel up to the limit of a CPU without AMX. Returns whether a specdec kernel was installed."""
    if kernel not in LINEAR_KERNELS:
        raise ValueError(f"unknown linear kernel {kernel!r}: use one of {', '.join(LINEAR_KERNELS)}")
    if kernel == "torch":
        return False
    tiles = kernel == "auto"
    if kernel == "auto":
        if torch.device(device).type != "cpu" or not (has_native("packed_linear") or has_native("skinny_linear")):
            return False
        kernel = "packed" if has_native("packed_linear") else "skinny"  # an older build has skinny only
    prepack = kernel == "packed"
    _op("packed_linear" if prepack else "skinny_linear")  # fail here, not in the first forward, without the extension
    use_skinny_linear(model, prepack=prepack, tiles=tiles)
    return True
