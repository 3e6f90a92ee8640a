// CPU kernel of specdec::tree_verify_greedy: greedy acceptance over a draft tree, argmax fused
// with the acceptance walk.
//
// Parents precede children, so one forward sweep decides every node: node i is accepted iff it is
// valid, its parent is accepted and its token is the target's argmax at the parent. The argmax
// of a node's logits is only needed when the node is accepted (its children are tested against
// it, or it ends the path), so it is computed lazily: a row reads V logits per accepted node
// instead of T * V.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "simd.h"

namespace specdec {
namespace {

constexpr int64_t kChunk = 1024;

// torch.argmax on CPU: the first maximum, and the first NaN if there is one.
template <typename scalar_t>
SPECDEC_INLINE int64_t argmax_row(const scalar_t* x, int64_t V) {
  using namespace simd;
  if constexpr (std::is_same_v<scalar_t, double>) {  // rare: plain loop, no rounding to fp32
    int64_t best_i = 0;
    for (int64_t i = 0; i < V; ++i) {
      if (std::isnan(x[i])) return i;
      if (x[i] > x[best_i]) best_i = i;
    }
    return best_i;
  }
  // 8-lane vectors: 16-lane generic vectors were lowered to scalar code with spills in the AVX2 clone.
  typedef Lanes<8>::f v8;
  typedef Lanes<8>::i v8i;
  alignas(64) float buf[kChunk];
  float best = kNegInf;
  int64_t best_i = 0;
  bool found = false;  // an all -inf row still returns index 0
  for (int64_t c0 = 0; c0 < V; c0 += kChunk) {
    const int64_t n = std::min(kChunk, V - c0), n_full = n / 16 * 16;
    const float* p;
    if constexpr (std::is_same_v<scalar_t, float>) {
      p = x + c0;
    } else {
      const auto* h = reinterpret_cast<const uint16_t*>(x + c0);
      for (int64_t i = 0; i < n_full; i += 8)
        store(buf + i, std::is_same_v<scalar_t, at::BFloat16> ? load_bf16_n<8>(h + i) : load_f16_n<8>(h + i));
      for (int64_t i = n_full; i < n; ++i) buf[i] = static_cast<float>(x[c0 + i]);
      p = buf;
    }
    v8 mx0 = splat<v8>(kNegInf), mx1 = mx0;
    v8i nan = v8i{};
    for (int64_t i = 0; i < n_full; i += 16) {
      const v8 a = load<v8>(p + i), b = load<v8>(p + i + 8);
      mx0 = vmax(a, mx0);  // NaN lanes keep the old maximum; the NaN mask catches them
      mx1 = vmax(b, mx1);
      nan |= (a != a) | (b != b);
    }
    float cm = hmax(vmax(mx0, mx1));
    bool has_nan = any(nan);
    for (int64_t i = n_full; i < n; ++i) {
      cm = std::max(cm, p[i]);
      has_nan |= std::isnan(p[i]);
    }
    if (has_nan) {
      for (int64_t i = 0; i < n; ++i)
        if (std::isnan(p[i])) return c0 + i;
    }
    if (cm > best || (!found && cm == best)) {
      for (int64_t i = 0; i < n; ++i)
        if (p[i] == cm) {
          best_i = c0 + i;
          break;
        }
      best = cm;
      found = true;
    }
  }
  return best_i;
}

struct Row {
  const int64_t* tokens;   // [T]
  const int64_t* parents;  // [T]
  const bool* valid;       // [T] or null
  const void* logits;      // row of [T, V] with node stride lstride
  int64_t lstride;
  int64_t* path;           // [T]
  int32_t* length;
  int64_t* next;
};

// The target's argmax at node i, computed on first use.
template <typename scalar_t>
SPECDEC_INLINE int64_t argmax_at(const Row& r, std::vector<int64_t>& pred, int64_t i, int64_t V) {
  if (pred[i] < 0) pred[i] = argmax_row(static_cast<const scalar_t*>(r.logits) + i * r.lstride, V);
  return pred[i];
}

template <typename scalar_t>
SPECDEC_INLINE void verify_row(const Row& r, int64_t T, int64_t V) {
  std::vector<int64_t> pred(T, -1), depth(T, 0);
  std::vector<char> acc(T, 0);
  acc[0] = r.valid ? r.valid[0] : 1;
  int64_t last = acc[0] ? 0 : -1;
  for (int64_t i = 1; i < T; ++i) {
    const int64_t parent = r.parents[i], p = std::max<int64_t>(parent, 0);
    depth[i] = parent >= 0 ? depth[parent] + 1 : 0;
    acc[i] = acc[p] && (!r.valid || r.valid[i]) && r.tokens[i] == argmax_at<scalar_t>(r, pred, p, V);
    // Deepest accepted node; ties go to the lowest index.
    if (acc[i] && (last < 0 || depth[i] > depth[last])) last = i;
  }
  if (last < 0) last = 0;  // nothing accepted, not even the root: the root alone
  const int64_t len = depth[last] + 1;
  int64_t node = last;
  for (int64_t k = len - 1; k >= 0; --k) {
    r.path[k] = node;
    node = std::max<int64_t>(r.parents[node], 0);
  }
  *r.length = static_cast<int32_t>(len);
  *r.next = argmax_at<scalar_t>(r, pred, last, V);
}

template <typename scalar_t>
SPECDEC_TARGET_AVX512 void verify_avx512(const Row& r, int64_t T, int64_t V) {
  verify_row<scalar_t>(r, T, V);
}
template <typename scalar_t>
SPECDEC_TARGET_AVX2 void verify_avx2(const Row& r, int64_t T, int64_t V) {
  verify_row<scalar_t>(r, T, V);
}
template <typename scalar_t>
void verify_base(const Row& r, int64_t T, int64_t V) {
  verify_row<scalar_t>(r, T, V);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> tree_verify_greedy_cpu(const at::Tensor& tokens,
                                                                      const at::Tensor& parents,
                                                                      const at::Tensor& logits,
                                                                      const std::optional<at::Tensor>& valid) {
  const char* op = "tree_verify_greedy: ";
  TORCH_CHECK(tokens.dim() == 2 && parents.sizes() == tokens.sizes(), op, "tokens and parents must be [B, T], got ",
              tokens.sizes(), " and ", parents.sizes());
  TORCH_CHECK(tokens.scalar_type() == at::kLong && parents.scalar_type() == at::kLong, op,
              "tokens and parents must be int64, got ", tokens.scalar_type(), " and ", parents.scalar_type());
  const int64_t B = tokens.size(0), T = tokens.size(1);
  TORCH_CHECK(T >= 1, op, "a tree has at least its root (T >= 1)");
  TORCH_CHECK(logits.dim() == 3 && logits.size(0) == B && logits.size(1) == T && logits.size(2) >= 1, op,
              "target_logits must be [B, T, V] = [", B, ", ", T, ", V], got ", logits.sizes());
  const auto dtype = logits.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kDouble, op,
              "target_logits must be fp32, fp16, bf16 or fp64, got ", dtype);
  TORCH_CHECK(tokens.device().is_cpu() && parents.device().is_cpu() && logits.device().is_cpu(), op,
              "tensors must be on the CPU");
  at::Tensor val;
  if (valid.has_value()) {
    val = valid->contiguous();
    TORCH_CHECK(val.scalar_type() == at::kBool && val.sizes() == tokens.sizes() && val.device().is_cpu(), op,
                "valid must be a [B, T] bool CPU tensor, got ", val.scalar_type(), " of shape ", val.sizes());
  }
  const auto tok = tokens.contiguous(), par = parents.contiguous();
  const int64_t* par_p = par.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 1; i < T; ++i) {
      const int64_t p = par_p[b * T + i];
      TORCH_CHECK(-1 <= p && p < i, op, "parents[", b, ", ", i, "] = ", p, ": a parent must precede its child");
    }
  // Rows of V logits are read in place; only the vocabulary axis needs to be contiguous.
  const auto lg = logits.stride(2) == 1 ? logits : logits.contiguous();
  auto path = at::full({B, T}, -1, tokens.options());
  auto length = at::empty({B}, tokens.options().dtype(at::kInt));
  auto next = at::empty({B}, tokens.options());
  const int64_t V = lg.size(2);
  auto launch = [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    using Fn = void (*)(const Row&, int64_t, int64_t);
    const Fn fn = simd::pick<Fn>(verify_avx512<scalar_t>, verify_avx2<scalar_t>, verify_base<scalar_t>);
    const auto* base = lg.const_data_ptr<scalar_t>();
    at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        Row r{tok.const_data_ptr<int64_t>() + b * T,
              par_p + b * T,
              val.defined() ? val.const_data_ptr<bool>() + b * T : nullptr,
              base + b * lg.stride(0),
              lg.stride(1),
              path.mutable_data_ptr<int64_t>() + b * T,
              length.mutable_data_ptr<int32_t>() + b,
              next.mutable_data_ptr<int64_t>() + b};
        fn(r, T, V);
      }
    });
  };
  switch (dtype) {
    case at::kFloat: launch(static_cast<float*>(nullptr)); break;
    case at::kBFloat16: launch(static_cast<at::BFloat16*>(nullptr)); break;
    case at::kHalf: launch(static_cast<at::Half*>(nullptr)); break;
    default: launch(static_cast<double*>(nullptr)); break;
  }
  return {path, length, next};
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("tree_verify_greedy", &tree_verify_greedy_cpu);
}

}  // namespace specdec
