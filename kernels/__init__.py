"""Triton kernels for CUDA tensors, installed as ``specdec.triton_kernels``: one file per operator
family, each tested against its torch reference in :mod:`specdec.kernels.reference` and chosen by
:mod:`specdec.kernels._dispatch` for CUDA inputs.

- ``tree_attention``: flash-style tree attention over a cached prefix (GQA, packed ancestor mask,
  sliding window, split prefix merged by log-sum-exp).
- ``topk_entropy``: one pass over V per row for top-k, entropy and logsumexp.
- ``kv_compact``: in-place KV compaction of every cache in one launch.
- ``tree_verify``: greedy and sampling acceptance over a draft tree.

Modules are imported lazily (they import triton); ``tests/test_triton_kernels.py`` runs them in
Triton's interpreter on machines without a GPU.
"""
