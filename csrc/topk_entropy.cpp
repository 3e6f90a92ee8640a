// CPU kernel of specdec::topk_entropy: top-k of softmax(logits / T) with its entropy and
// log-partition, in one pass over V per row (online max, rescaled sums, streaming top-k).
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

namespace specdec {
namespace {

// Logits are processed in chunks: convert and scale into a buffer, chunk max, the (rarely
// taken) top-k insertion test, then the exp sums. The max and exp loops use 4-lane GCC/Clang
// vector types, so they vectorise (SSE, AVX, NEON, ...) without reassociating float reductions.
constexpr int64_t kChunk = 1024;
constexpr int kLanes = 4;  // 16-byte vectors: native on SSE2 and NEON
constexpr int kGroup = 4 * kLanes;  // the loops take 4 independent vectors per step (ILP for the exp)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

typedef float f4 __attribute__((vector_size(4 * kLanes)));
typedef int32_t i4 __attribute__((vector_size(4 * kLanes)));

inline f4 splat(float v) { return f4{} + v; }
inline f4 load(const float* p) {
  f4 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline f4 select(i4 mask, f4 a, f4 b) { return (f4)((mask & (i4)a) | (~mask & (i4)b)); }
inline f4 vmax(f4 a, f4 b) { return select(a > b, a, b); }  // b where a is NaN

// e^x for x <= 0 (Cephes-style range reduction + degree-6 polynomial, ~1 ulp), 0 below -87.
inline f4 exp_nonpos(f4 x) {
  const f4 xc = vmax(x, splat(-87.0f));
  const f4 r = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x / ln 2)
  const f4 g = (xc - r * 0.693359375f) - r * -2.12194440e-4f;
  f4 p = splat(1.9875691500e-4f);
  p = p * g + 1.3981999507e-3f;
  p = p * g + 8.3334519073e-3f;
  p = p * g + 4.1665795894e-2f;
  p = p * g + 1.6666665459e-1f;
  p = p * g + 5.0000001201e-1f;
  const f4 y = p * g * g + g + 1.0f;
  const i4 e = __builtin_convertvector(r, i4);
  const f4 scale = (f4)((e + 127) << 23);
  return select(x >= splat(-87.0f), y * scale, splat(0.0f));
}

template <typename scalar_t>
void topk_entropy_row(const scalar_t* row, int64_t V, int64_t k, float temperature, float* probs, int64_t* ids,
                      float* entropy, float* lse) {
  alignas(64) float buf[kChunk];
  // Top-k so far, sorted descending by value; ties keep the smaller index first.
  std::vector<float> top_v;
  std::vector<int64_t> top_i;
  top_v.reserve(k + 1);
  top_i.reserve(k + 1);
  auto offer = [&](float x, int64_t id) {
    if (static_cast<int64_t>(top_v.size()) == k && !(x > top_v.back())) return;
    const auto pos = std::upper_bound(top_v.begin(), top_v.end(), x, std::greater<float>()) - top_v.begin();
    top_v.insert(top_v.begin() + pos, x);
    top_i.insert(top_i.begin() + pos, id);
    if (static_cast<int64_t>(top_v.size()) > k) {
      top_v.pop_back();
      top_i.pop_back();
    }
  };
  float m = kNegInf;          // running max
  double s0 = 0.0, s1 = 0.0;  // sum e^(x-m), sum e^(x-m)(x-m)
  for (int64_t c0 = 0; c0 < V; c0 += kChunk) {
    const int64_t n = std::min(kChunk, V - c0);
    // Pad to whole groups with -inf, which adds nothing to the sums and never enters the top-k.
    const int64_t n_pad = (n + kGroup - 1) / kGroup * kGroup;
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(row[c0 + i]) / temperature;
    for (int64_t i = n; i < n_pad; ++i) buf[i] = kNegInf;
    f4 mx[4] = {splat(kNegInf), splat(kNegInf), splat(kNegInf), splat(kNegInf)};
    for (int64_t i = 0; i < n_pad; i += kGroup)
      for (int u = 0; u < 4; ++u) mx[u] = vmax(load(buf + i + u * kLanes), mx[u]);
    const f4 lane_max = vmax(vmax(mx[0], mx[1]), vmax(mx[2], mx[3]));
    float cm = kNegInf;
    for (int j = 0; j < kLanes; ++j) cm = std::max(cm, lane_max[j]);
    // Streaming top-k: only values above the current k-th enter (whole lane groups skipped at once).
    for (int64_t i = 0; i < n_pad; i += kGroup) {
      if (static_cast<int64_t>(top_v.size()) == k) {
        const f4 thr = splat(top_v.back());
        const i4 above = (load(buf + i) > thr) | (load(buf + i + kLanes) > thr) | (load(buf + i + 2 * kLanes) > thr) |
                         (load(buf + i + 3 * kLanes) > thr);
        if ((above[0] | above[1] | above[2] | above[3]) == 0) continue;
      }
      for (int64_t j = i; j < std::min(i + kGroup, n); ++j) offer(buf[j], c0 + j);
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
    f4 a0[4] = {}, a1[4] = {};
    const f4 mv = splat(m), floor = splat(-100.0f);
    for (int64_t i = 0; i < n_pad; i += kGroup) {
      for (int u = 0; u < 4; ++u) {
        const f4 t = vmax(load(buf + i + u * kLanes) - mv, floor);  // -inf -> -100, whose e^t is 0
        const f4 e = exp_nonpos(t);
        a0[u] += e;
        a1[u] += e * t;
      }
    }
    const f4 b0 = (a0[0] + a0[1]) + (a0[2] + a0[3]), b1 = (a1[0] + a1[1]) + (a1[2] + a1[3]);
    for (int j = 0; j < kLanes; ++j) {
      s0 += b0[j];
      s1 += b1[j];
    }
  }
  if (m == kNegInf) {  // every logit -inf: softmax undefined, as in the reference
    *lse = kNegInf;
    *entropy = 0.0f;
    for (int64_t j = 0; j < k; ++j) {
      probs[j] = std::numeric_limits<float>::quiet_NaN();
      ids[j] = top_i[j];
    }
    return;
  }
  const double log_s0 = std::log(s0);
  const float l = static_cast<float>(m + log_s0);
  *lse = l;
  *entropy = static_cast<float>(log_s0 - s1 / s0);
  for (int64_t j = 0; j < k; ++j) {
    probs[j] = std::exp(top_v[j] - l);
    ids[j] = top_i[j];
  }
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
  const float t = static_cast<float>(temperature);
  float* p_p = probs.mutable_data_ptr<float>();
  int64_t* i_p = ids.mutable_data_ptr<int64_t>();
  float* e_p = entropy.mutable_data_ptr<float>();
  float* l_p = lse.mutable_data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "topk_entropy", [&] {
    const scalar_t* x_p = x.const_data_ptr<scalar_t>();
    // About 16K logits per task: below that, waking the pool costs more than the row.
    const int64_t grain = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(V, 1));
    at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        topk_entropy_row<scalar_t>(x_p + r * V, V, k, t, p_p + r * k, i_p + r * k, e_p + r, l_p + r);
    });
  });
  return {probs, ids, entropy, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("topk_entropy", &topk_entropy_cpu);
}

}  // namespace specdec
