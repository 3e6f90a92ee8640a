"""Tiny GGUF files written with the ``gguf`` package: a tiny random model's linear weights quantized block by block
(as llama.cpp's converter stores them, q/k rows of llama models permuted), and the model as transformers would
load it from them (the dense weights replaced by their dequantized values)."""
from __future__ import annotations

import copy
import functools
import tempfile
from pathlib import Path

import gguf
import numpy as np
import torch
from torch import nn

from tests.conftest import tiny_model

# Block types by layer: gguf can quantize these; the K-quants decode through the same kernels (tests/test_quant_linear.py).
QTYPES = {"q_proj": "Q4_1", "k_proj": "Q4_0", "v_proj": "Q8_0", "o_proj": "Q5_0", "gate_proj": "Q4_1",
          "up_proj": "Q5_1", "down_proj": "Q4_1", "lm_head": "Q8_0"}
GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "gemma3": "gemma3"}


def _permute(w: np.ndarray, n_head: int, n_kv: int) -> np.ndarray:
    """llama.cpp's converter's row order for llama's q/k weights (transformers' loader undoes it)."""
    n = n_kv if n_kv != n_head else n_head
    return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@functools.lru_cache(maxsize=None)
def tiny_gguf(arch: str, seed: int = 0) -> tuple[nn.Module, Path]:
    """``(model, path)``: a tiny ``arch`` model with dequantized weights and the GGUF file holding its blocks."""
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    model = copy.deepcopy(tiny_model(arch, seed=seed))
    hf_to_gguf = {hf: g for g, hf in get_gguf_hf_weights_map(model, TensorProcessor()).items()}
    path = Path(tempfile.mkdtemp(prefix="specdec-gguf-")) / f"tiny-{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), GGUF_ARCH[arch])
    cfg = model.config
    with torch.no_grad():
        for name, mod in model.named_modules():
            if type(mod) is not nn.Linear:
                continue
            qtype = gguf.GGMLQuantizationType[QTYPES[name.rsplit(".", 1)[-1]]]
            w = mod.weight.detach().numpy().astype(np.float32)
            key = hf_to_gguf.get(f"{name}.weight")
            if key is None and mod.weight is model.get_input_embeddings().weight:
                key = "token_embd.weight"
            stored = w
            if arch == "llama" and name.endswith("q_proj"):
                stored = _permute(w, cfg.num_attention_heads, cfg.num_attention_heads)
            elif arch == "llama" and name.endswith("k_proj"):
                stored = _permute(w, cfg.num_attention_heads, cfg.num_key_value_heads)
            raw = gguf.quantize(stored, qtype)
            writer.add_tensor(key, raw, raw_dtype=qtype)
            deq = gguf.dequantize(raw, qtype).reshape(w.shape)
            if arch == "llama" and name.endswith(("q_proj", "k_proj")):  # back to transformers' row order
                heads = cfg.num_attention_heads if name.endswith("q_proj") else cfg.num_key_value_heads
                deq = deq.reshape(heads, deq.shape[0] // heads // 2, 2, -1).swapaxes(2, 1).reshape(w.shape)
            mod.weight.copy_(torch.from_numpy(deq))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model, path
