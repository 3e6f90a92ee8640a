// CPU kernel of specdec::topk_entropy: top-k of softmax(logits / T) with its entropy and
// log-partition, in one pass over V per row (online max, rescaled sums, streaming top-k),
// vectorised for the widest ISA the CPU has (see simd.h).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <tuple>
#include <vector>

#include "simd.h"

namespace specdec {
namespace {

using simd::kNegInf;

// Logits are processed in chunks that stay in L1: convert and scale into a buffer (with the
// chunk max in the same pass), the top-k insertion test (skipped for the whole chunk when its max
// does not beat the current k-th value, the common case), then the exp sums. The loops take four
// independent L-lane vectors per step (ILP for the exp) and are compiled per ISA (simd.h): L = 16
// on AVX-512, 8 elsewhere. On AVX2, 16-lane generic vectors (two registers each) made GCC lower the
// loops to scalar code with spills: 270 us per 49k-logit row, slower than torch's softmax + topk.
constexpr int64_t kChunk = 1024;

// L logits as fp32, divided by the temperature (a true division, as the reference; skipped at 1).
template <int L, typename scalar_t>
SPECDEC_INLINE typename simd::Lanes<L>::f load_scaled(const scalar_t* x, float temperature) {
  typedef typename simd::Lanes<L>::f V;
  V v;
  if constexpr (std::is_same_v<scalar_t, float>) {
    v = simd::load<V>(x);
  } else if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    v = simd::load_bf16_n<L>(reinterpret_cast<const uint16_t*>(x));
  } else if constexpr (std::is_same_v<scalar_t, at::Half>) {
    v = simd::load_f16_n<L>(reinterpret_cast<const uint16_t*>(x));
  } else {
    for (int j = 0; j < L; ++j) v[j] = static_cast<float>(x[j]);
  }
  return temperature == 1.0f ? v : v / temperature;
}

// Top-k so far, sorted descending by value; ties keep the smaller index first.
struct TopK {
  int64_t k;
  std::vector<float> v;
  std::vector<int64_t> i;
  bool full() const { return static_cast<int64_t>(v.size()) == k; }
  float threshold() const { return full() ? v.back() : kNegInf; }
  void offer(float x, int64_t id) {
    if (full() && !(x > v.back())) return;
    const auto pos = std::upper_bound(v.begin(), v.end(), x, std::greater<float>()) - v.begin();
    v.insert(v.begin() + pos, x);
    i.insert(i.begin() + pos, id);
    if (static_cast<int64_t>(v.size()) > k) {
      v.pop_back();
      i.pop_back();
    }
  }
};

template <typename scalar_t, int L>
SPECDEC_INLINE void topk_entropy_row(const scalar_t* row, int64_t V, int64_t k, float temperature, float* probs,
                                     int64_t* ids, float* entropy, float* lse) {
  using namespace simd;
  using vf = typename Lanes<L>::f;
  constexpr int64_t kGroup = 4 * L;
  alignas(64) float buf[kChunk];
  TopK top{k, {}, {}};
  top.v.reserve(k + 1);
  top.i.reserve(k + 1);
  float m = kNegInf;          // running max
  double s0 = 0.0, s1 = 0.0;  // sum e^(x-m), sum e^(x-m)(x-m)
  for (int64_t c0 = 0; c0 < V; c0 += kChunk) {
    const int64_t n = std::min(kChunk, V - c0), n_vec = n / L * L;
    // Pad to whole groups with -inf, which adds nothing to the sums and never enters the top-k.
    const int64_t n_pad = (n + kGroup - 1) / kGroup * kGroup;
    vf mx = splat<vf>(kNegInf);
    for (int64_t i = 0; i < n_vec; i += L) {
      const vf x = load_scaled<L>(row + c0 + i, temperature);
      store(buf + i, x);
      mx = vmax(x, mx);
    }
    for (int64_t i = n_vec; i < n; ++i) buf[i] = static_cast<float>(row[c0 + i]) / temperature;
    for (int64_t i = n; i < n_pad; ++i) buf[i] = kNegInf;
    for (int64_t i = n_vec; i < n_pad; i += L) mx = vmax(load<vf>(buf + i), mx);
    const float cm = hmax(mx);
    // Streaming top-k: only values above the current k-th enter.
    if (!top.full() || cm > top.threshold()) {
      for (int64_t i = 0; i < n_pad; i += L) {
        if (top.full() && !any(load<vf>(buf + i) > splat<vf>(top.threshold()))) continue;
        for (int64_t j = i; j < std::min(i + L, n); ++j) top.offer(buf[j], c0 + j);
      }
    }
    if (cm == kNegInf) continue;  // all -inf: contributes nothing
    if (cm > m) {
      if (m != kNegInf) {
        const double d = static_cast<double>(m) - cm, f = std::exp(d);
        s1 = f * (s1 + d * s0);
        s0 = f * s0;
      }
      m = cm;
    }
    vf a0[4] = {}, a1[4] = {};
    const vf mv = splat<vf>(m), floor = splat<vf>(-100.0f);
    for (int64_t i = 0; i < n_pad; i += kGroup) {
      for (int u = 0; u < 4; ++u) {
        const vf t = vmax(load<vf>(buf + i + u * L) - mv, floor);  // -inf -> -100, whose e^t is 0
        const vf e = simd::exp_nonpos_v(t);
        a0[u] += e;
        a1[u] += e * t;
      }
    }
    s0 += hsum((a0[0] + a0[1]) + (a0[2] + a0[3]));
    s1 += hsum((a1[0] + a1[1]) + (a1[2] + a1[3]));
  }
  if (m == kNegInf) {  // every logit -inf: softmax undefined, as in the reference
    *lse = kNegInf;
    *entropy = 0.0f;
    for (int64_t j = 0; j < k; ++j) {
      probs[j] = std::numeric_limits<float>::quiet_NaN();
      ids[j] = top.i[j];
    }
    return;
  }
  const double log_s0 = std::log(s0), l = m + log_s0;
  *lse = static_cast<float>(l);
  *entropy = static_cast<float>(log_s0 - s1 / s0);
  for (int64_t j = 0; j < k; ++j) {
    probs[j] = static_cast<float>(std::exp(top.v[j] - l));  // in double: not limited by ulp(lse)
    ids[j] = top.i[j];
  }
}

struct Rows {
  const void* x;
  int64_t V, k;
  float temperature;
  float *probs, *entropy, *lse;
  int64_t* ids;
};

template <typename scalar_t, int L>
SPECDEC_INLINE void rows_impl(const Rows& r, int64_t begin, int64_t end) {
  const auto* x = static_cast<const scalar_t*>(r.x);
  for (int64_t i = begin; i < end; ++i)
    topk_entropy_row<scalar_t, L>(x + i * r.V, r.V, r.k, r.temperature, r.probs + i * r.k, r.ids + i * r.k,
                               r.entropy + i, r.lse + i);
}
template <typename scalar_t>
SPECDEC_TARGET_AVX512 void rows_avx512(const Rows& r, int64_t begin, int64_t end) {
  rows_impl<scalar_t, 16>(r, begin, end);
}
template <typename scalar_t>
SPECDEC_TARGET_AVX2 void rows_avx2(const Rows& r, int64_t begin, int64_t end) {
  rows_impl<scalar_t, 8>(r, begin, end);
}
template <typename scalar_t>
void rows_base(const Rows& r, int64_t begin, int64_t end) {
  rows_impl<scalar_t, 8>(r, begin, end);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> topk_entropy_cpu(const at::Tensor& logits, int64_t k,
                                                                            double temperature) {
  TORCH_CHECK(logits.dim() == 2, "topk_entropy: logits must be [N, V], got shape ", logits.sizes());
  TORCH_CHECK(logits.device().is_cpu(), "topk_entropy: logits must be a CPU tensor, got ", logits.device());
  const auto dtype = logits.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kDouble,
              "topk_entropy: logits must be fp32, fp16, bf16 or fp64, got ", dtype);
  const int64_t N = logits.size(0), V = logits.size(1);
  TORCH_CHECK(1 <= k && k <= V, "topk_entropy: k must be in [1, V = ", V, "], got ", k);
  TORCH_CHECK(temperature > 0, "topk_entropy: temperature must be > 0, got ", temperature);
  const auto opts = logits.options().dtype(at::kFloat);
  auto probs = at::empty({N, k}, opts);
  auto ids = at::empty({N, k}, opts.dtype(at::kLong));
  auto entropy = at::empty({N}, opts);
  auto lse = at::empty({N}, opts);
  const auto x = logits.contiguous();
  Rows r{x.const_data_ptr(), V, k, static_cast<float>(temperature), probs.mutable_data_ptr<float>(),
         entropy.mutable_data_ptr<float>(), lse.mutable_data_ptr<float>(), ids.mutable_data_ptr<int64_t>()};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "topk_entropy", [&] {
    using Fn = void (*)(const Rows&, int64_t, int64_t);
    const Fn fn = simd::pick<Fn>(rows_avx512<scalar_t>, rows_avx2<scalar_t>, rows_base<scalar_t>);
    // About 16K logits per task: below that, waking the pool costs more than the row.
    const int64_t grain = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(V, 1));
    at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) { fn(r, begin, end); });
  });
  return {probs, ids, entropy, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("topk_entropy", &topk_entropy_cpu);
}

}  // namespace specdec
