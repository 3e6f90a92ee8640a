"""Weights as shipped: a model that comes from a GGUF keeps its quantized blocks (``--weights gguf``).

:func:`apply_gguf_weights` swaps every linear layer whose weight the GGUF stores quantized for a
:class:`QuantLinear` over the file's blocks (repacked once, :func:`specdec.kernels.quant.pack_quant_weight`),
the tied LM head included. The swap keeps the module's dense Parameters (same state dict; the embedding
lookup, which reads one row a token, and ``get_output_embeddings().weight`` stay dense) and is checked at
load: the blocks, decoded and put in transformers' row order, must equal the dense weight transformers built
from the same file (bit for bit in fp32, after rounding in bf16/fp16), or the load fails.

Why: a one-row decode step reads every weight once, so its time is the bytes it reads over the memory
bandwidth. SmolLM2-135M's GGUF holds 96.5 MB of Q4_1/Q8_0 blocks; its dense bf16 copy is 269 MB.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from specdec import settings
from specdec.gguf_blocks import AffineCodes, decode_blocks
from specdec.kernels import has_native
from specdec.kernels.quant import TILE_ROWS, QuantWeight, pack_quant_weight, quant_linear
from specdec.linear import (AMX_PACKED_MAX_ROWS, WIDEN_MIN_ROWS, SkinnyLinear, cpu_has_matrix_tiles, cpu_widens_prompts,
                            widened_linear)
from specdec.precompile import ReportsFlags

WEIGHTS = ("auto", "gguf", "dense")

# Rows up to which a CPU product runs the quantized kernel (level with the packed bf16 kernel from 8 to 64 rows on
# a 2-core Xeon); a larger one (a prompt) runs on the dense weights (see QuantLinear).
QUANT_MAX_ROWS = 64

# The same limit for bf16 on a CPU with AMX tiles, where the dense path hands products past a few rows to torch's
# GEMM (oneDNN's tile instructions; --linear auto) and the quantized kernel runs from TILE_ROWS rows on tiles too:
# all 211 weights of SmolLM2-135M over M rows, 2 threads, ms, blocks on tiles / torch's dense bf16 GEMM: 15.7 / 25.9
# at 16 rows, 24.2 / 27.8 at 32, 33.4 / 31.9 at 48, 44.6 / 34.1 at 64 (bench/results/quant_tiles_amx.json; a third
# tile of 16 rows starts at 33). A batch's verification (16 rows of 2 tokens is 32) is where that pays.
AMX_QUANT_MAX_ROWS = 32
# ... and with the tiles switched off (SPECDEC_AMX=0), where the vector kernel's 19.2 ms at 12 rows and 25.0 at 16
# meet torch's 26 (the configuration before the tiles, kept for A/B runs).
AMX_VECTOR_QUANT_MAX_ROWS = 12


def _dense_path_is_tile_gemm(linear: nn.Module, dtype: torch.dtype) -> bool:
    """Whether ``linear``'s dense path hands products past a few rows to torch's AMX GEMM (bf16 on an AMX CPU with
    ``--linear auto``), so its verifications are not batch-invariant anyway; a kernel chosen for batch invariance
    (``--linear packed``) keeps its own rows."""
    dense_rows = linear.max_rows if isinstance(linear, SkinnyLinear) else 0
    return cpu_has_matrix_tiles(dtype) and dense_rows <= AMX_PACKED_MAX_ROWS


def _tiles_switched_on() -> bool:
    return settings.get("SPECDEC_AMX") != "0"


def default_quant_max_rows(linear: nn.Module, dtype: torch.dtype) -> int:
    """Rows up to which ``linear``'s products run the quantized kernel: :data:`AMX_QUANT_MAX_ROWS` where its dense
    path is torch's AMX GEMM (:func:`_dense_path_is_tile_gemm`; :data:`AMX_VECTOR_QUANT_MAX_ROWS` with
    ``SPECDEC_AMX=0``), else :data:`QUANT_MAX_ROWS`."""
    if not _dense_path_is_tile_gemm(linear, dtype):
        return QUANT_MAX_ROWS
    return AMX_QUANT_MAX_ROWS if _tiles_switched_on() else AMX_VECTOR_QUANT_MAX_ROWS


def default_tile_rows(linear: nn.Module, dtype: torch.dtype) -> int:
    """Rows from which ``linear``'s quantized products run on AMX tiles (:func:`specdec.kernels.quant.quant_linear`'s
    ``tile_rows``): :data:`specdec.kernels.quant.TILE_ROWS` where the dense path is torch's AMX GEMM (bit-exact
    batch invariance was not asked for) and ``SPECDEC_AMX`` is not 0, else 0, never."""
    return TILE_ROWS if _dense_path_is_tile_gemm(linear, dtype) and _tiles_switched_on() else 0


class QuantLinear(ReportsFlags, SkinnyLinear):
    """A linear layer whose products run over a GGUF's quantized blocks (:func:`specdec.kernels.quant.quant_linear`).

    CPU products of up to ``quant_max_rows`` rows (decode and verification) stream the packed blocks; larger
    ones (prompts) use the dense weights through the :class:`SkinnyLinear` path (in fp32 the blocks' exact values,
    in bf16 their rounding: a bf16 prompt is encoded with the bf16 model, as before this layer). With gradients, or while
    :func:`dense_weights` is on, the layer is the :class:`SkinnyLinear` it replaced (dense weights, the kernel
    ``--linear`` chose): the bench's ``hf`` baseline runs that way.
    """

    quant_max_rows: int = QUANT_MAX_ROWS
    tile_rows: int = 0  # bf16 products of at least this many rows on AMX tiles (0: never), see quant_linear
    dense: bool = False
    native: bool = False
    widen_prompts: bool = False  # bf16 products of WIDEN_MIN_ROWS rows or more widened to fp32 (cpu_widens_prompts)

    @classmethod
    def from_quant(cls, linear: nn.Linear, qweight: QuantWeight, max_rows: int = QUANT_MAX_ROWS,
                   widen_prompts: bool = True, tile_rows: int = 0) -> "QuantLinear":
        """A QuantLinear sharing ``linear``'s Parameters (ties kept); its dense path is ``linear``'s (a
        :class:`SkinnyLinear`'s kernel and limits, or torch's for a plain ``nn.Linear``). widen_prompts: bf16
        products of ``WIDEN_MIN_ROWS`` rows or more widen to fp32 where this CPU favours it (:func:`cpu_widens_prompts`);
        False keeps them on the dense path's kernel (``--linear packed``: batch-invariant verification to its limit).
        tile_rows: as :func:`specdec.kernels.quant.quant_linear`'s (0: batch-invariant to ``max_rows``)."""
        skinny = isinstance(linear, SkinnyLinear)
        new = cls.from_linear(linear, linear.max_rows if skinny else 0, widen=linear.widen if skinny else False,
                              prepack=linear.prepack if skinny else False)
        new.qweight = qweight
        new.quant_max_rows = max_rows
        new.tile_rows = tile_rows
        new.dense = False  # on the instance, as dense_weights() sets it (a compiled runner checks it before each call)
        new.native = has_native("quant_linear")  # loads specdec._C, which registers torch.ops.specdec.quant_*
        new.widen_prompts = widen_prompts and cpu_widens_prompts(linear.weight.dtype)
        return new

    def extra_repr(self) -> str:
        q = self.qweight
        return (f"{super().extra_repr()}, qtype={q.qtype}, bits={q.bits}, group={q.group}, bytes={q.nbytes}, "
                f"tile_rows={self.tile_rows}")

    def bytes_read(self) -> int:
        return super().bytes_read() if self.dense else self.qweight.nbytes

    def compiled_inputs(self) -> list[torch.Tensor]:
        return super().compiled_inputs() + ([self.qweight.packed] if self.qweight.packed is not None else [])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: ``[..., in_features]`` -> ``[..., out_features]``."""
        q = self.qweight
        if self.dense or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
            return super().forward(x)
        k = self.in_features
        if x.is_cpu and q.packed is not None and self.native and x.dtype in (torch.float32, torch.bfloat16, torch.float16):
            rows = x.numel() // k if k else 0
            if 0 < rows <= self.quant_max_rows and x.shape[-1] == k:
                op = torch.ops.specdec.quant_linear.default
                tiles = (self.tile_rows,) if self.tile_rows else ()
                y = op(x.reshape(rows, k), q.packed, q.n, k, q.bits, q.group, q.has_min, q.f16_scale, self.bias, *tiles)
                return y.view(x.shape[:-1] + (q.n,))
            # A prompt: the dense weights through the kernel --linear chose (in fp32 they are the blocks' exact
            # values; in bf16 their rounding), or widened to fp32 where that is faster. Rebuilding fp32 weights
            # from the blocks for every prompt took 23% of `ar`'s time on a 2-core Xeon (bench/RESULTS.md,
            # Weights as shipped).
            if self.widen_prompts and rows >= WIDEN_MIN_ROWS and x.dtype == torch.bfloat16:
                return widened_linear(x, self.weight, self.bias)
            return super().forward(x)
        if x.device == q.device:
            return quant_linear(x, q, self.bias, tile_rows=self.tile_rows)
        return super().forward(x)


@contextlib.contextmanager
def dense_weights(model: nn.Module):
    """Within the block, every :class:`QuantLinear` of ``model`` computes with its dense weights (the bench's
    ``hf`` baseline: transformers' model as a transformers user has it)."""
    mods = [m for m in model.modules() if isinstance(m, QuantLinear)]
    for m in mods:
        m.dense = True
    try:
        yield
    finally:
        for m in mods:
            m.dense = False


def _tensor_map(model: nn.Module, reader) -> tuple[dict[str, str], object]:
    """``{module name: GGUF tensor name}`` for every linear layer of ``model``, and transformers' tensor
    processor for the file's architecture (it knows the row orders llama.cpp's converter permutes)."""
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                          get_gguf_hf_weights_map, read_field)

    arch = read_field(reader, "general.architecture")[0]
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=model.config.to_dict())
    gguf_to_hf = get_gguf_hf_weights_map(model, processor)
    hf_to_gguf = {hf: g for g, hf in gguf_to_hf.items()}
    present = {t.name for t in reader.tensors}
    out = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear) or isinstance(mod, QuantLinear):
            continue
        key = hf_to_gguf.get(f"{name}.weight")
        if key not in present and mod.weight is model.get_input_embeddings().weight:
            key = hf_to_gguf.get(_param_name(model, model.get_input_embeddings().weight))  # tied LM head
        if key in present:
            out[name] = key
    return out, processor


def _param_name(model: nn.Module, param: torch.Tensor) -> str | None:
    for name, p in model.named_parameters(remove_duplicate=False):
        if p is param:
            return name
    return None


def _row_order(processor, gguf_name: str, n: int) -> torch.Tensor | None:
    """Row ``i`` of transformers' weight is row ``order[i]`` of the GGUF tensor (llama.cpp permutes the q/k
    rows of llama models for its rotary layout); None when the rows are in order."""
    index = np.arange(n, dtype=np.float64)[:, None]
    out = np.asarray(processor.process(weights=index, name=gguf_name).weights).reshape(-1)
    if out.shape != (n,) or not np.array_equal(np.sort(out), np.arange(n)):
        raise ValueError(f"cannot place the rows of GGUF tensor {gguf_name}: the converter's processor does not "
                         "permute rows")
    return None if np.array_equal(out, np.arange(n)) else torch.from_numpy(out.astype(np.int64))


def gguf_codes(model: nn.Module, gguf_path: str | Path) -> dict[str, AffineCodes]:
    """Affine codes of every quantized linear weight of ``model`` in the GGUF file ``gguf_path``, in
    transformers' row order, by module name. Weights the file stores unquantized (F32/F16) are left out."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    tensors = {t.name: t for t in reader.tensors}
    names, processor = _tensor_map(model, reader)
    out = {}
    for mod_name, key in names.items():
        t = tensors[key]
        qtype = t.tensor_type.name
        if qtype in ("F32", "F16", "BF16"):
            continue
        mod = model.get_submodule(mod_name)
        n, k = mod.out_features, mod.in_features
        codes = decode_blocks(qtype, t.data, n, k)
        order = _row_order(processor, key, n)
        out[mod_name] = codes if order is None else codes.rows(order)
    return out


_CODE_FIELDS = ("codes", "scale", "minv", "bits", "group", "scale_fp16", "qtype")


def _codes_cache_path(model: nn.Module, gguf_path: Path) -> Path:
    """Where :func:`cached_gguf_codes` keeps the codes of ``gguf_path`` for ``model``: keyed by the file (path,
    size, modification time), the model (class, config) and the decoder's own source, so that any change to
    one of them decodes afresh."""
    from specdec.hub import cache_dir

    st = gguf_path.stat()
    key = hashlib.sha256()
    from importlib.metadata import version

    for part in (str(gguf_path.resolve()), str(st.st_size), str(st.st_mtime_ns), type(model).__name__,
                 model.config.to_json_string(use_diff=False), version("transformers"),
                 version("gguf")):
        key.update(part.encode() + b"\0")
    for source in (Path(__file__), Path(__file__).with_name("gguf_blocks.py")):
        key.update(source.read_bytes())
    return cache_dir() / "gguf-codes" / f"{gguf_path.stem}-{key.hexdigest()[:20]}.pt"


def cached_gguf_codes(model: nn.Module, gguf_path: str | Path) -> dict[str, AffineCodes]:
    """:func:`gguf_codes`, decoded once per file and model and kept under ``$SPECDEC_CACHE/gguf-codes``.

    Why: reading a GGUF's tensor table with ``gguf.GGUFReader`` (which parses the whole vocabulary first) and
    mapping its names with transformers' ``get_gguf_hf_weights_map`` (which builds llama.cpp's name table once
    per submodule) took 14.5 of the 17 s that SmolLM2-135M took to load on a 2-core Xeon; the cached codes load
    in a fraction of a second. A stale or foreign cache cannot change the model: :func:`apply_gguf_weights`
    checks every weight against the dense one and decodes the file again on a mismatch; an unreadable entry is
    decoded afresh too."""
    gguf_path = Path(gguf_path)
    path = _codes_cache_path(model, gguf_path)
    if path.is_file():
        try:
            saved = torch.load(path, mmap=True, weights_only=True)
            return {name: AffineCodes(**{f: fields[f] for f in _CODE_FIELDS}) for name, fields in saved.items()}
        except Exception:  # noqa: BLE001  (a truncated or older file: decode again below and replace it)
            pass
    found = gguf_codes(model, gguf_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    torch.save({name: {f: getattr(c, f) for f in _CODE_FIELDS} for name, c in found.items()}, tmp)
    os.replace(tmp, path)  # atomic: a concurrent loader sees the old file or the whole new one
    return found


def _mismatch(model: nn.Module, found: dict[str, AffineCodes]) -> str | None:
    """The first module whose decoded weight differs from its dense one (rounded to its dtype), else None."""
    for name, codes in found.items():
        w = model.get_submodule(name).weight
        if not torch.equal(codes.dequantize().to(w.dtype).to(w.device), w.detach()):
            return name
    return None


def apply_gguf_weights(model: nn.Module, gguf_path: str | Path, max_rows: int | None = None,
                       check: bool = True, widen_prompts: bool = True) -> int:
    """Swap the linear layers of ``model`` (loaded from ``gguf_path``) for :class:`QuantLinear` over the file's
    blocks, in place; returns the number swapped.

    max_rows: products of up to this many rows run the quantized kernel (default :func:`default_quant_max_rows`
    per layer), larger ones the dense weights.

    check: require every decoded weight to equal the module's dense weight (rounded to its dtype), so the
    quantized forward computes the very model transformers loaded.

    widen_prompts: as in :meth:`QuantLinear.from_quant`.
    """
    found = cached_gguf_codes(model, gguf_path)
    if check and _mismatch(model, found) is not None:
        _codes_cache_path(model, Path(gguf_path)).unlink(missing_ok=True)  # stale: decode the file itself
        found = cached_gguf_codes(model, gguf_path)
    if not found:
        raise ValueError(f"{gguf_path} has no quantized linear weights for this model: use --weights dense")
    if check and (name := _mismatch(model, found)) is not None:
        raise ValueError(f"GGUF weight for {name} ({found[name].qtype}) differs from the model's dense weight: "
                         f"the model was not loaded from {gguf_path}")
    for name, codes in found.items():
        swap_in_quant(model, name, codes, max_rows, widen_prompts)
    return len(found)


def swap_in_quant(model: nn.Module, name: str, codes: AffineCodes, max_rows: int | None = None,
                  widen_prompts: bool = True) -> None:
    """Replace the linear layer ``name`` of ``model`` by a :class:`QuantLinear` over ``codes`` (packed on the
    layer's device), in place; ``max_rows`` and ``widen_prompts`` as in :func:`apply_gguf_weights`."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    linear = getattr(parent, child)
    qweight = pack_quant_weight(codes, linear.weight.device)
    rows = default_quant_max_rows(linear, linear.weight.dtype) if max_rows is None else max_rows
    tiles = default_tile_rows(linear, linear.weight.dtype)
    setattr(parent, child, QuantLinear.from_quant(linear, qweight, rows, widen_prompts, tiles))
