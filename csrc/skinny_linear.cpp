// CPU kernel of specdec::skinny_linear: y = x . W^T + b for a few rows of x (speculative
// verification: T drafted tokens, T ~ 1-16), the weight streamed from memory once per call.
//
// Why not at::linear: on CPUs without AVX512-BF16/AMX, torch's bf16 GEMM for M > 1 re-reads and
// re-converts the weight once per row (a 16-row bf16 product costs 16 one-row products), and its
// fp32 GEMM takes a slow path for M = 2-3. Verification of a draft tree then costs about T target
// steps and speculation cannot gain. Here each weight row is loaded (and widened to fp32) once and
// dotted with every row of x while it sits in L1.
//
// Batch invariance: every output element is one 8-lane fp32 accumulator over K (in steps of 8),
// summed lane by lane in a fixed order, then the K % 8 tail, then the bias, then one rounding
// to the output dtype. That order does not depend on M or on which rows share a call, so row m
// of a T-row verification equals, bit for bit, the same row computed alone (one-token decoding).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

#include "linear_common.h"
#include "simd.h"

namespace specdec {
namespace {

using simd::kLanes;

constexpr int kUnit = 8;  // weight rows per parallel work unit (a multiple of every blocking's row count)

// 8 fp32 lanes: one ymm register. simd::vf (16 lanes) is two ymm on AVX2, and GCC keeps blocks of
// such accumulators on the stack, which chains every FMA through memory.
constexpr int kW = 8;
typedef simd::Lanes<kW>::f v8;

SPECDEC_INLINE v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <typename w_t>
SPECDEC_INLINE v8 load_w(const w_t* p) {
  if constexpr (std::is_same_v<w_t, float>) return load8(p);
  if constexpr (std::is_same_v<w_t, at::BFloat16>) return simd::load_bf16_n<kW>(reinterpret_cast<const uint16_t*>(p));
  if constexpr (std::is_same_v<w_t, at::Half>) return simd::load_f16_n<kW>(reinterpret_cast<const uint16_t*>(p));
}

// Lanes summed as a tree in a fixed order: (0+4, 1+5, 2+6, 3+7), then pairs, then the last two.
SPECDEC_INLINE float hsum8(v8 v) {
  typedef float v4 __attribute__((vector_size(16)));
  typedef float v2 __attribute__((vector_size(8)));
  const v4 q = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
  const v2 d = __builtin_shufflevector(q, q, 0, 1) + __builtin_shufflevector(q, q, 2, 3);
  return d[0] + d[1];
}

struct Args {
  const float* x;    // [M, K] fp32 (x widened once per call)
  const void* w;     // [N, K] weight dtype
  const float* b;    // [N] fp32 or null
  void* y;           // [M, N] output dtype
  int64_t M, N, K;
};

// y[m0:m0+NM, n0:n0+NN]: NN weight rows against NM rows of x (NN * NM accumulators in registers).
template <typename w_t, int NN, int NM>
SPECDEC_INLINE void micro(const Args& a, int64_t n0, int64_t m0) {
  const int64_t K = a.K, kv = K / kW * kW;
  const w_t* w[NN];
  const float* x[NM];
  for (int i = 0; i < NN; ++i) w[i] = static_cast<const w_t*>(a.w) + (n0 + i) * K;
  for (int j = 0; j < NM; ++j) x[j] = a.x + (m0 + j) * K;
  v8 acc[NN][NM] = {};
  // The NN rows are one contiguous span; while it is consumed, the next block's span is prefetched
  // at the same pace (rows of ~1 KB are too short for the hardware stream prefetcher to ramp up).
  constexpr int64_t kStepBytes = NN * kW * static_cast<int64_t>(sizeof(w_t));
  const char* next = reinterpret_cast<const char*>(w[0] + NN * K);
  for (int64_t k = 0; k < kv; k += kW) {
    for (int64_t p = 0; p < kStepBytes; p += 64) __builtin_prefetch(next + k / kW * kStepBytes + p);
    v8 wv[NN];
#pragma GCC unroll 8
    for (int i = 0; i < NN; ++i) wv[i] = load_w(w[i] + k);
#pragma GCC unroll 4
    for (int j = 0; j < NM; ++j) {
      const v8 xv = load8(x[j] + k);
#pragma GCC unroll 8
      for (int i = 0; i < NN; ++i) acc[i][j] += wv[i] * xv;
    }
  }
  for (int i = 0; i < NN; ++i) {
    for (int j = 0; j < NM; ++j) {
      float s = hsum8(acc[i][j]);
      for (int64_t k = kv; k < K; ++k) s += x[j][k] * static_cast<float>(w[i][k]);
      if (a.b != nullptr) s += a.b[n0 + i];
      static_cast<w_t*>(a.y)[(m0 + j) * a.N + n0 + i] = static_cast<w_t>(s);
    }
  }
}

// Weight rows [n0, n0 + NN) against all M rows of x, MB rows at a time.
template <typename w_t, int NN, int MB>
SPECDEC_INLINE void block(const Args& a, int64_t n0) {
  int64_t m = 0;
  for (; m + MB <= a.M; m += MB) micro<w_t, NN, MB>(a, n0, m);
  const int64_t r = a.M - m;
  if constexpr (MB > 3) if (r == 3) return micro<w_t, NN, 3>(a, n0, m);
  if constexpr (MB > 2) if (r == 2) return micro<w_t, NN, 2>(a, n0, m);
  if constexpr (MB > 1) if (r == 1) return micro<w_t, NN, 1>(a, n0, m);
}

template <typename w_t, int NN, int MB>
SPECDEC_INLINE void rows_blocked(const Args& a, int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
  for (; n + NN <= n_end; n += NN) block<w_t, NN, MB>(a, n);
  for (; n < n_end; ++n) block<w_t, 1, MB>(a, n);
}

// Weight rows [n_begin, n_end) against all M rows of x. The register blocking follows M: at one or
// two rows the product is a pure weight stream, and more rows streamed side by side keep more
// loads in flight; from four rows on, each widened weight vector is reused across four rows of x.
// Every blocking computes each output element the same way (batch invariance holds across them).
template <typename w_t>
SPECDEC_INLINE void rows_impl(const Args& a, int64_t n_begin, int64_t n_end) {
  if (a.M == 1)
    rows_blocked<w_t, 8, 1>(a, n_begin, n_end);
  else if (a.M <= 3)
    rows_blocked<w_t, 4, 2>(a, n_begin, n_end);
  else
    rows_blocked<w_t, 2, 4>(a, n_begin, n_end);
}

template <typename w_t>
SPECDEC_TARGET_AVX512 void rows_avx512(const Args& a, int64_t begin, int64_t end) {
  rows_impl<w_t>(a, begin, end);
}
template <typename w_t>
SPECDEC_TARGET_AVX2 void rows_avx2(const Args& a, int64_t begin, int64_t end) {
  rows_impl<w_t>(a, begin, end);
}
template <typename w_t>
void rows_base(const Args& a, int64_t begin, int64_t end) {
  rows_impl<w_t>(a, begin, end);
}

at::Tensor skinny_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const auto dtype = linear::check_dtypes("skinny_linear", x, weight);
  TORCH_CHECK(weight.dim() == 2, "skinny_linear: weight must be [N, K], got shape ", weight.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "skinny_linear: x has K = ", K, " columns but weight is ", weight.sizes());
  const at::Tensor b = linear::bias_fp32("skinny_linear", bias, N, dtype);
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const auto xc = x.contiguous();
  const float* xf = linear::rows_fp32(xc);
  const auto w = weight.contiguous();
  Args a{xf, w.const_data_ptr(), b.defined() ? b.const_data_ptr<float>() : nullptr, y.mutable_data_ptr(), M, N, K};
  linear::dispatch_weight_dtype(dtype, [&](auto tag) {
    using scalar_t = decltype(tag);
    using Fn = void (*)(const Args&, int64_t, int64_t);
    const Fn fn = simd::pick<Fn>(rows_avx512<scalar_t>, rows_avx2<scalar_t>, rows_base<scalar_t>);
    // Tasks of at least ~64K weight elements (in whole micro-kernel blocks): below that, waking
    // the pool costs more than the work.
    const int64_t blocks = (N + kUnit - 1) / kUnit;
    const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(K * kUnit, 1));
    at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
      fn(a, begin * kUnit, std::min(end * kUnit, N));
    });
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("skinny_linear", &skinny_linear_cpu);
}

}  // namespace specdec
