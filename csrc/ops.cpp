// Schemas of the specdec operators (torch.ops.specdec.*) and the Python module specdec._C.
// Importing specdec._C loads this library, which runs the registrations; kernels live in one
// file per operator and register themselves per backend with TORCH_LIBRARY_IMPL.
#include <Python.h>

#include <torch/library.h>

extern "C" {
// A module with no methods: its only job is to make `import specdec._C` load the registrations.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(specdec, m) {
  m.set_python_module("specdec.kernels._fake");
  m.def("kv_compact(Tensor(a!)[] caches, Tensor src, Tensor dst_start, Tensor counts) -> ()");
  m.def("ngram_match(Tensor tokens, Tensor lengths, int n_min, int n_max, int k, int w) -> "
        "(Tensor drafts, Tensor draft_lens, Tensor counts, Tensor match_n)");
  m.def("topk_entropy(Tensor logits, int k, float temperature) -> "
        "(Tensor probs, Tensor ids, Tensor entropy, Tensor lse)");
  m.def("tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_lens, Tensor k_tree, Tensor v_tree, "
        "Tensor? tree_mask, float? scale=None, Tensor? tree_positions=None, int? window=None) -> Tensor");
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, int n, Tensor? bias=None) -> Tensor");
  m.def("quant_linear(Tensor x, Tensor packed, int n, int k, int bits, int group, bool has_min, bool f16_scale, "
        "Tensor? bias=None, int tile_rows=0) -> Tensor");
  m.def("quant_linear_group(Tensor x, Tensor[] packed, int[] n, int k, int bits, int group, bool has_min, "
        "bool f16_scale, Tensor?[] bias, int tile_rows=0) -> Tensor");
  m.def("quant_dequantize(Tensor packed, int n, int k, int bits, int group, bool has_min, bool f16_scale) -> Tensor");
  m.def("tree_verify_greedy(Tensor tokens, Tensor parents, Tensor target_logits, Tensor? valid=None) -> "
        "(Tensor path, Tensor length, Tensor next_token)");
  m.def("draft_tree(Tensor root, Tensor drafts, bool merge=True, Tensor? accept=None, Tensor? keep=None) -> "
        "(Tensor tokens, Tensor parents, Tensor valid, Tensor depth, Tensor mask, Tensor chain, Tensor slot, "
        "Tensor reach)");
}
