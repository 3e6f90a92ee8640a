// Argument checks shared by the CPU and CUDA kernels of specdec::ngram_match (devices are checked by each).
#pragma once
#include <ATen/core/Tensor.h>

namespace specdec {

inline void check_ngram_match_args(const at::Tensor& tokens, const at::Tensor& lengths, int64_t n_min, int64_t n_max,
                                   int64_t k, int64_t w) {
  TORCH_CHECK(tokens.dim() == 2, "ngram_match: tokens must be [B, L], got shape ", tokens.sizes());
  TORCH_CHECK(tokens.scalar_type() == at::kLong, "ngram_match: tokens must be int64, got ", tokens.scalar_type());
  TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == tokens.size(0), "ngram_match: lengths must be [B] with B = ",
              tokens.size(0), ", got shape ", lengths.sizes());
  TORCH_CHECK(!at::isFloatingType(lengths.scalar_type()) && !at::isComplexType(lengths.scalar_type()) &&
                  lengths.scalar_type() != at::kBool,
              "ngram_match: lengths must be an integer tensor, got ", lengths.scalar_type());
  TORCH_CHECK(1 <= n_min && n_min <= n_max, "ngram_match: need 1 <= n_min <= n_max, got ", n_min, ", ", n_max);
  TORCH_CHECK(k >= 1 && w >= 1, "ngram_match: k and w must be >= 1, got k = ", k, ", w = ", w);
}

}  // namespace specdec
