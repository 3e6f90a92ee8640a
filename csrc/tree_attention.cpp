// CPU kernel of specdec::tree_attention: T tree queries over a cached prefix and over the tree.
//
// Design (the xformers split): per (row b, kv head, block of queries) the G = Hq / Hkv query heads
// sharing the kv head are stacked into one [G * tb, D] matrix, so every K/V row is read once per
// group. Keys are visited in chunks: first the prefix [window start, cache_lens[b]), unmasked
// except for the window's lower edge, then the tree's own T keys under the bit-packed ancestor
// mask, read word by word. An online softmax (running max, sum and fp32 accumulator per query)
// merges the chunks, which is the log-sum-exp merge of the two attentions; no dense [T, S + T]
// mask exists. Scores and P.V are BLAS GEMMs; the softmax is vectorised (see simd.h).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>

#include "simd.h"

// The x86 torch wheels link MKL statically into libtorch_cpu and export its BLAS entry points.
// Weak references use them when present (fp32 GEMM, and bf16/fp16 x bf16/fp16 -> fp32 GEMMs that
// run on AMX/AVX512-BF16 where the CPU has them) without a link-time dependency; where they are
// absent the same products go through at::addmm in fp32.
extern "C" {
void sgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc) __attribute__((weak));
void cblas_gemm_bf16bf16f32(int layout, int ta, int tb, int m, int n, int k, float alpha, const uint16_t* a, int lda,
                            const uint16_t* b, int ldb, float beta, float* c, int ldc) __attribute__((weak));
void cblas_gemm_f16f16f32(int layout, int ta, int tb, int m, int n, int k, float alpha, const uint16_t* a, int lda,
                          const uint16_t* b, int ldb, float beta, float* c, int ldc) __attribute__((weak));
int MKL_Set_Num_Threads_Local(int n) __attribute__((weak));
}

namespace specdec {
namespace {

using simd::kLanes;
using simd::kNegInf;

constexpr int64_t kChunk = 512;     // keys per chunk: the [rows, kChunk] fp32 scores stay in L2
constexpr int64_t kMinRows = 32;    // GEMM rows (heads x queries) worth a task of their own
constexpr int64_t kMaxRows = 256;   // cap on rows per task (buffers)
constexpr int64_t kTasksPerThread = 4;
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;  // CBLAS enums

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// C[M, N] = alpha * A[M, K] . op(B) + beta * C, row-major with leading dimensions; op(B) = B^T
// when b_nk (B stored [N, K]), else B (stored [K, N]).
void gemm(bool b_nk, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B,
          int64_t ldb, float beta, float* C, int64_t ldc) {
  if (sgemm_ != nullptr) {  // column-major: C^T = op(B)^T . A^T
    const int m = N, n = M, k = K, la = ldb, lb = lda, lc = ldc;
    sgemm_(b_nk ? "T" : "N", "N", &m, &n, &k, &alpha, B, &la, A, &lb, &beta, C, &lc);
    return;
  }
  const auto opts = at::TensorOptions().dtype(at::kFloat);
  auto a = at::from_blob(const_cast<float*>(A), {M, K}, {lda, 1}, opts);
  auto b = b_nk ? at::from_blob(const_cast<float*>(B), {N, K}, {ldb, 1}, opts).t()
                : at::from_blob(const_cast<float*>(B), {K, N}, {ldb, 1}, opts);
  auto c = at::from_blob(C, {M, N}, {ldc, 1}, opts);
  at::addmm_out(c, c, a, b, beta, alpha);  // beta = 0 ignores c's contents
}

template <typename half_t>
void gemm(bool b_nk, int64_t M, int64_t N, int64_t K, float alpha, const half_t* A, int64_t lda, const half_t* B,
          int64_t ldb, float beta, float* C, int64_t ldc) {
  auto* fn = std::is_same_v<half_t, at::BFloat16> ? cblas_gemm_bf16bf16f32 : cblas_gemm_f16f16f32;
  fn(kRowMajor, kNoTrans, b_nk ? kTrans : kNoTrans, M, N, K, alpha, reinterpret_cast<const uint16_t*>(A), lda,
     reinterpret_cast<const uint16_t*>(B), ldb, beta, C, ldc);
}

template <typename scalar_t>
bool has_native_gemm() {
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) return cblas_gemm_bf16bf16f32 != nullptr;
  if constexpr (std::is_same_v<scalar_t, at::Half>) return cblas_gemm_f16f16f32 != nullptr;
  return true;
}

struct Strides {
  int64_t b, h, t;  // in elements; the last dimension is contiguous
};

struct Args {
  int64_t B, Hq, Hkv, G, T, D, W, tb, blocks;
  const void *q, *kc, *vc, *kt, *vt;
  Strides sq, skc, svc, skt, svt;
  const int64_t* lens;   // [B]
  const int32_t* mask;   // [B, T, W] or null (causal chain)
  const int64_t* pos;    // [B, T] or null (no window)
  int64_t window;        // 0: none
  float scale;
  void* out;             // [B, Hq, T, D] contiguous
};

// Turns one chunk of scores into probabilities and folds them into the running softmax state.
// S: [M, lds] fp32 scores (n valid columns, padded here with -inf); m, l: [M] running max and sum;
// acc: [M, D] fp32 output accumulator, rescaled to the new max; P: [M, ldp] probabilities for the
// P.V GEMM (may alias S when gemm_t is float).
template <typename gemm_t>
SPECDEC_INLINE void softmax_chunk(float* S, int64_t M, int64_t n, int64_t lds, float* m, float* l, float* acc,
                                  int64_t D, gemm_t* P, int64_t ldp) {
  using namespace simd;
  const int64_t n_pad = round_up(n, kLanes);
  for (int64_t r = 0; r < M; ++r) {
    float* row = S + r * lds;
    gemm_t* prow = P + r * ldp;
    for (int64_t j = n; j < n_pad; ++j) row[j] = kNegInf;
    vf mx = splat(kNegInf);
    for (int64_t j = 0; j < n_pad; j += kLanes) mx = vmax(load(row + j), mx);
    const float cm = hmax(mx);
    if (cm == kNegInf) {  // nothing visible in this chunk
      std::memset(static_cast<void*>(prow), 0, n_pad * sizeof(gemm_t));
      continue;
    }
    const float m_new = std::max(m[r], cm);
    const vf mv = splat(m_new);
    vf s = splat(0.0f);
    for (int64_t j = 0; j < n_pad; j += kLanes) {
      const vf e = exp_nonpos(load(row + j) - mv);
      s += e;
      if constexpr (std::is_same_v<gemm_t, float>) {
        store(prow + j, e);
      } else if constexpr (std::is_same_v<gemm_t, at::BFloat16>) {
        store_bf16(reinterpret_cast<uint16_t*>(prow + j), e);
      } else {
        for (int q = 0; q < kLanes; ++q) prow[j + q] = static_cast<gemm_t>(e[q]);
      }
    }
    const float corr = m[r] == kNegInf ? 0.0f : std::exp(m[r] - m_new);
    l[r] = l[r] * corr + hsum(s);
    if (corr != 1.0f) {
      float* a = acc + r * D;
      for (int64_t d = 0; d < D; ++d) a[d] *= corr;
    }
    m[r] = m_new;
  }
}

// Rows [n, D] of a strided source into a dense gemm_t buffer (a conversion when the types differ).
template <typename gemm_t, typename scalar_t>
SPECDEC_INLINE const gemm_t* rows_as(const scalar_t* src, int64_t stride, int64_t n, int64_t D, gemm_t* buf,
                                     int64_t& ld) {
  if constexpr (std::is_same_v<gemm_t, scalar_t>) {
    ld = stride;
    return src;
  } else {
    for (int64_t i = 0; i < n; ++i)
      for (int64_t d = 0; d < D; ++d) buf[i * D + d] = static_cast<gemm_t>(src[i * stride + d]);
    ld = D;
    return buf;
  }
}

// One task: row b, kv head hk, tree queries [t0, t1) of every head in the group; G * tb = M rows,
// row r = g * tb + i being query head hk * G + g at tree position t0 + i.
template <typename gemm_t>
struct Task {
  int64_t b, hk, t0, tb, M, D, ld;  // ld: row stride of the score and probability buffers
  std::unique_ptr<gemm_t[]> q;           // [M, D] queries
  std::unique_ptr<float[]> S, acc, m, l;  // [M, ld] scores, [M, D] accumulator, [M] running max and sum
  std::unique_ptr<gemm_t[]> P;           // [M, ld] probabilities (null when gemm_t is float: P is S)
  std::unique_ptr<gemm_t[]> kv;          // [2, kChunk, D] converted keys and values, or null
  std::unique_ptr<float[]> bias;         // [ld] additive mask row (0 or -inf) of one query

  Task(const Args& a, int64_t item, bool convert)
      : b(item / (a.Hkv * a.blocks)), hk((item / a.blocks) % a.Hkv), t0((item % a.blocks) * a.tb),
        tb(std::max<int64_t>(0, std::min(a.T, t0 + a.tb) - t0)), M(a.G * tb), D(a.D), ld(kChunk + kLanes),
        q(new gemm_t[M * D]), S(new float[M * ld]), acc(new float[M * D]()), m(new float[M]), l(new float[M]()),
        P(std::is_same_v<gemm_t, float> ? nullptr : new gemm_t[M * ld]),
        kv(convert ? new gemm_t[2 * kChunk * D] : nullptr), bias(new float[ld]) {
    std::fill(m.get(), m.get() + M, kNegInf);
  }
  gemm_t* probs() { return P ? P.get() : reinterpret_cast<gemm_t*>(S.get()); }
  float* row(int64_t g, int64_t i) { return S.get() + (g * tb + i) * ld; }
};

// A run of keys laid out at rows [v0, v1) of kbase/vbase: rows before `split` are prefix keys
// (key position = row), rows from `split` on are tree keys (tree index = row - split). The prefix
// and the tree form one segment when the tree follows the valid prefix in memory (the runtime's
// layout for aligned rows), so each chunk costs one pair of GEMMs instead of two.
template <typename scalar_t>
struct Segment {
  const scalar_t *k, *v;
  int64_t stride_k, stride_v, v0, v1, split;
};

// Hides prefix keys at columns [j0, j0 + n) (positions p0..) below each query's window: query i
// sees keys at positions > pos_i - window.
template <typename gemm_t>
SPECDEC_INLINE void mask_prefix(Task<gemm_t>& w, const Args& a, int64_t p0, int64_t j0, int64_t n) {
  if (!a.pos) return;
  for (int64_t i = 0; i < w.tb; ++i) {
    const int64_t hidden = std::min(n, a.pos[w.b * a.T + w.t0 + i] - a.window + 1 - p0);
    for (int64_t g = 0; hidden > 0 && g < a.G; ++g) std::fill(w.row(g, i) + j0, w.row(g, i) + j0 + hidden, kNegInf);
  }
}

// Hides tree keys at columns [j0, j0 + n) (tree indices c0..) that are not ancestors (or self) of
// each query, or out of its window. Columns past j0 + n may be set to -inf (they are padding).
template <typename gemm_t>
SPECDEC_INLINE void mask_tree(Task<gemm_t>& w, const Args& a, int64_t c0, int64_t j0, int64_t n) {
  using namespace simd;
  const int64_t n_pad = round_up(n, kLanes);
  const int64_t* pos = a.pos ? a.pos + w.b * a.T : nullptr;
  for (int64_t i = 0; i < w.tb; ++i) {
    const int64_t t = w.t0 + i;
    if (!a.mask && !pos) {  // causal chain: the keys after t
      const int64_t from = std::max<int64_t>(0, t + 1 - c0);
      for (int64_t g = 0; from < n && g < a.G; ++g) std::fill(w.row(g, i) + j0 + from, w.row(g, i) + j0 + n, kNegInf);
      continue;
    }
    // One additive row (0 visible, -inf hidden) per query, added to its G heads' rows.
    float* bias = w.bias.get();
    const int32_t* words = a.mask ? a.mask + (w.b * a.T + t) * a.W : nullptr;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t col = c0 + j;
      bool vis = words ? (static_cast<uint32_t>(words[col >> 5]) >> (col & 31)) & 1u : col <= t;
      if (pos) vis = vis && pos[col] > pos[t] - a.window;
      bias[j] = vis ? 0.0f : kNegInf;
    }
    for (int64_t j = n; j < n_pad; ++j) bias[j] = kNegInf;
    for (int64_t g = 0; g < a.G; ++g) {
      float* row = w.row(g, i) + j0;
      for (int64_t j = 0; j < n_pad; j += kLanes) store(row + j, load(row + j) + load(bias + j));
    }
  }
}

// Keys at rows [c0, c0 + n) of a segment: scores, mask, online softmax, acc += P . V.
template <typename scalar_t, typename gemm_t>
SPECDEC_INLINE void chunk(Task<gemm_t>& w, const Args& a, const Segment<scalar_t>& seg, int64_t c0, int64_t n) {
  const int64_t M = w.M, D = w.D, ld = w.ld;
  int64_t ldk, ldv;
  const gemm_t* k = rows_as<gemm_t>(seg.k + c0 * seg.stride_k, seg.stride_k, n, D, w.kv.get(), ldk);
  gemm(true, M, n, D, a.scale, w.q.get(), D, k, ldk, 0.0f, w.S.get(), ld);
  const int64_t n_prefix = std::clamp<int64_t>(seg.split - c0, 0, n);
  if (n_prefix > 0) mask_prefix(w, a, c0, 0, n_prefix);
  if (n_prefix < n) mask_tree(w, a, c0 + n_prefix - seg.split, n_prefix, n - n_prefix);
  softmax_chunk<gemm_t>(w.S.get(), M, n, ld, w.m.get(), w.l.get(), w.acc.get(), D, w.probs(), ld);
  gemm_t* vbuf = w.kv ? w.kv.get() + kChunk * D : nullptr;
  const gemm_t* v = rows_as<gemm_t>(seg.v + c0 * seg.stride_v, seg.stride_v, n, D, vbuf, ldv);
  gemm(false, M, D, n, 1.0f, w.probs(), ld, v, ldv, 1.0f, w.acc.get(), D);
}

template <typename scalar_t, typename gemm_t>
SPECDEC_INLINE void attend_segment(Task<gemm_t>& w, const Args& a, const Segment<scalar_t>& seg) {
  for (int64_t c0 = seg.v0; c0 < seg.v1; c0 += kChunk) chunk(w, a, seg, c0, std::min(kChunk, seg.v1 - c0));
}

// gemm_t is scalar_t when a native GEMM of that type exists (fp32, bf16/fp16 -> fp32 MKL), else
// float (inputs converted per chunk).
template <typename scalar_t, typename gemm_t>
SPECDEC_INLINE void attend_block(const Args& a, int64_t item) {
  Task<gemm_t> w(a, item, !std::is_same_v<gemm_t, scalar_t>);
  if (w.tb == 0) return;
  const int64_t b = w.b, hk = w.hk, t0 = w.t0, tb = w.tb, G = a.G, D = a.D;

  const auto* q = static_cast<const scalar_t*>(a.q);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < tb; ++i) {
      const scalar_t* src = q + b * a.sq.b + (hk * G + g) * a.sq.h + (t0 + i) * a.sq.t;
      gemm_t* dst = w.q.get() + (g * tb + i) * D;
      if constexpr (std::is_same_v<gemm_t, scalar_t>)
        std::memcpy(static_cast<void*>(dst), src, D * sizeof(gemm_t));
      else
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<gemm_t>(src[d]);
    }

  // Prefix keys [lo, L), lo the lowest position any query's window reaches.
  const int64_t L = a.lens[b];
  int64_t lo = 0;
  if (a.pos) {
    lo = L;
    for (int64_t i = 0; i < tb; ++i) lo = std::min(lo, std::max<int64_t>(0, a.pos[b * a.T + t0 + i] - a.window + 1));
  }
  // Tree keys [0, hi), hi one past the last column any query of the block sees.
  int64_t hi = t0 + tb;
  if (a.mask) {
    hi = 0;
    for (int64_t i = 0; i < tb; ++i) {
      const int32_t* words = a.mask + (b * a.T + t0 + i) * a.W;
      for (int64_t k = a.W - 1; k >= 0; --k)
        if (words[k] != 0) {
          hi = std::max<int64_t>(hi, 32 * k + 32 - __builtin_clz(static_cast<uint32_t>(words[k])));
          break;
        }
    }
    hi = std::min(hi, a.T);
  }
  const auto* kc = static_cast<const scalar_t*>(a.kc) + b * a.skc.b + hk * a.skc.h;
  const auto* vc = static_cast<const scalar_t*>(a.vc) + b * a.svc.b + hk * a.svc.h;
  const auto* kt = static_cast<const scalar_t*>(a.kt) + b * a.skt.b + hk * a.skt.h;
  const auto* vt = static_cast<const scalar_t*>(a.vt) + b * a.svt.b + hk * a.svt.h;
  const bool joined = a.skc.t == a.skt.t && a.svc.t == a.svt.t && kc + L * a.skc.t == kt && vc + L * a.svc.t == vt;
  if (joined) {
    attend_segment(w, a, Segment<scalar_t>{kc, vc, a.skc.t, a.svc.t, lo, L + hi, L});
  } else {
    attend_segment(w, a, Segment<scalar_t>{kc, vc, a.skc.t, a.svc.t, lo, L, L});
    attend_segment(w, a, Segment<scalar_t>{kt, vt, a.skt.t, a.svt.t, 0, hi, 0});
  }

  auto* out = static_cast<scalar_t*>(a.out);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < tb; ++i) {
      const int64_t r = g * tb + i;
      const float inv = w.l[r] > 0.0f ? 1.0f / w.l[r] : 0.0f;  // no visible key (not a valid tree): zeros
      scalar_t* dst = out + ((b * a.Hq + hk * G + g) * a.T + t0 + i) * D;
      const float* src = w.acc.get() + r * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(src[d] * inv);
    }
}

template <typename scalar_t, typename gemm_t>
SPECDEC_TARGET_AVX512 void attend_avx512(const Args& a, int64_t item) {
  attend_block<scalar_t, gemm_t>(a, item);
}
template <typename scalar_t, typename gemm_t>
SPECDEC_TARGET_AVX2 void attend_avx2(const Args& a, int64_t item) {
  attend_block<scalar_t, gemm_t>(a, item);
}
template <typename scalar_t, typename gemm_t>
void attend_base(const Args& a, int64_t item) {
  attend_block<scalar_t, gemm_t>(a, item);
}

template <typename scalar_t, typename gemm_t>
void run(const Args& a) {
  using Fn = void (*)(const Args&, int64_t);
  const Fn fn =
      simd::pick<Fn>(attend_avx512<scalar_t, gemm_t>, attend_avx2<scalar_t, gemm_t>, attend_base<scalar_t, gemm_t>);
  at::parallel_for(0, a.B * a.Hkv * a.blocks, 1, [&](int64_t begin, int64_t end) {
    // Each task's GEMMs are small: keep MKL single-threaded in them (an MKL thread team per tiny
    // GEMM, spinning against the pool's threads on a busy machine, made calls up to 100x slower).
    const int prev = MKL_Set_Num_Threads_Local ? MKL_Set_Num_Threads_Local(1) : 0;
    for (int64_t item = begin; item < end; ++item) fn(a, item);
    if (MKL_Set_Num_Threads_Local) MKL_Set_Num_Threads_Local(prev);
  });
}

// Query blocks per (row, kv head): each block's GEMMs at least kMinRows tall (when T allows) and
// at most kMaxRows; among the splits that give every thread at least two tasks, the first whose
// task count is a multiple of the thread count (no straggler), else about kTasksPerThread each.
int64_t query_blocks(int64_t bh, int64_t G, int64_t T, int64_t threads) {
  const int64_t most = std::max<int64_t>(1, T / std::max<int64_t>(1, (kMinRows + G - 1) / G));
  const int64_t least = (T + std::max<int64_t>(1, kMaxRows / G) - 1) / std::max<int64_t>(1, kMaxRows / G);
  int64_t blocks = std::min(most, std::max<int64_t>(1, (kTasksPerThread * threads + bh - 1) / bh));
  for (int64_t n = std::max<int64_t>(1, (2 * threads + bh - 1) / bh); n <= most; ++n)
    if (bh * n % threads == 0) {
      blocks = n;
      break;
    }
  return std::max(blocks, least);
}

Strides strides_of(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

at::Tensor last_dim_contiguous(const at::Tensor& t) { return t.stride(3) == 1 ? t : t.contiguous(); }

at::Tensor tree_attention_cpu(const at::Tensor& q_in, const at::Tensor& k_cache_in, const at::Tensor& v_cache_in,
                              const at::Tensor& cache_lens, const at::Tensor& k_tree_in, const at::Tensor& v_tree_in,
                              const std::optional<at::Tensor>& tree_mask, std::optional<double> scale,
                              const std::optional<at::Tensor>& tree_positions, std::optional<int64_t> window) {
  const char* op = "tree_attention: ";
  for (const at::Tensor* t : {&q_in, &k_cache_in, &v_cache_in, &k_tree_in, &v_tree_in}) {
    TORCH_CHECK(t->dim() == 4, op, "q, k_cache, v_cache, k_tree, v_tree must be 4-D, got shape ", t->sizes());
    TORCH_CHECK(t->device().is_cpu(), op, "tensors must be on the CPU, got ", t->device());
    TORCH_CHECK(t->scalar_type() == q_in.scalar_type(), op, "q, k and v must share a dtype, got ", q_in.scalar_type(),
                " and ", t->scalar_type());
  }
  const auto dtype = q_in.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, op,
              "q must be fp32, fp16 or bf16, got ", dtype);
  const int64_t B = q_in.size(0), Hq = q_in.size(1), T = q_in.size(2), D = q_in.size(3);
  const int64_t Hkv = k_cache_in.size(1), S = k_cache_in.size(2);
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, op, "Hq = ", Hq, " is not a multiple of Hkv = ", Hkv);
  TORCH_CHECK(v_cache_in.sizes() == k_cache_in.sizes() && k_cache_in.size(0) == B && k_cache_in.size(3) == D, op,
              "k_cache and v_cache must be [B, Hkv, S, D] = [", B, ", Hkv, S, ", D, "], got ", k_cache_in.sizes(),
              " and ", v_cache_in.sizes());
  const std::vector<int64_t> tree_shape{B, Hkv, T, D};
  TORCH_CHECK(k_tree_in.sizes() == tree_shape && v_tree_in.sizes() == tree_shape, op,
              "k_tree and v_tree must be [B, Hkv, T, D] = ", at::IntArrayRef(tree_shape), ", got ", k_tree_in.sizes(),
              " and ", v_tree_in.sizes());
  TORCH_CHECK(cache_lens.dim() == 1 && cache_lens.size(0) == B && cache_lens.device().is_cpu() &&
                  (cache_lens.scalar_type() == at::kLong || cache_lens.scalar_type() == at::kInt),
              op, "cache_lens must be a [B] int32/int64 CPU tensor, got ", cache_lens.scalar_type(), " of shape ",
              cache_lens.sizes());
  const auto lens = cache_lens.to(at::kLong).contiguous();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = lens.const_data_ptr<int64_t>()[b];
    TORCH_CHECK(0 <= len && len <= S, op, "cache_lens[", b, "] = ", len, " is outside [0, S = ", S, "]");
  }
  const int64_t W = (T + 31) / 32;
  at::Tensor mask;
  if (tree_mask.has_value()) {
    mask = tree_mask->contiguous();
    TORCH_CHECK(mask.scalar_type() == at::kInt && mask.dim() == 3 && mask.size(0) == B && mask.size(1) == T &&
                    mask.size(2) == W && mask.device().is_cpu(),
                op, "tree_mask must be a [B, T, ceil(T/32)] = [", B, ", ", T, ", ", W, "] int32 CPU tensor, got ",
                mask.scalar_type(), " of shape ", mask.sizes());
  }
  at::Tensor pos;
  if (window.has_value()) {
    TORCH_CHECK(*window >= 1, op, "window must be >= 1, got ", *window);
    TORCH_CHECK(tree_positions.has_value(), op, "tree_positions are required with a sliding window");
    pos = tree_positions->to(at::kLong).contiguous();
    TORCH_CHECK(pos.dim() == 2 && pos.size(0) == B && pos.size(1) == T && pos.device().is_cpu(), op,
                "tree_positions must be [B, T] = [", B, ", ", T, "], got shape ", pos.sizes());
  }
  auto out = at::empty({B, Hq, T, D}, q_in.options());
  if (out.numel() == 0) return out;
  const auto q = last_dim_contiguous(q_in), kc = last_dim_contiguous(k_cache_in), vc = last_dim_contiguous(v_cache_in);
  const auto kt = last_dim_contiguous(k_tree_in), vt = last_dim_contiguous(v_tree_in);

  Args a{};
  a.B = B, a.Hq = Hq, a.Hkv = Hkv, a.G = Hq / Hkv, a.T = T, a.D = D, a.W = W;
  const int64_t blocks = query_blocks(B * Hkv, a.G, T, at::get_num_threads());
  a.tb = (T + blocks - 1) / blocks;
  a.blocks = (T + a.tb - 1) / a.tb;
  a.q = q.const_data_ptr(), a.kc = kc.const_data_ptr(), a.vc = vc.const_data_ptr();
  a.kt = kt.const_data_ptr(), a.vt = vt.const_data_ptr();
  a.sq = strides_of(q), a.skc = strides_of(kc), a.svc = strides_of(vc), a.skt = strides_of(kt), a.svt = strides_of(vt);
  a.lens = lens.const_data_ptr<int64_t>();
  a.mask = mask.defined() ? mask.const_data_ptr<int32_t>() : nullptr;
  a.pos = pos.defined() ? pos.const_data_ptr<int64_t>() : nullptr;
  a.window = window.value_or(0);
  a.scale = static_cast<float>(scale.value_or(1.0 / std::sqrt(static_cast<double>(D))));
  a.out = out.mutable_data_ptr();
  if (dtype == at::kFloat) {
    run<float, float>(a);
  } else if (dtype == at::kBFloat16) {
    has_native_gemm<at::BFloat16>() ? run<at::BFloat16, at::BFloat16>(a) : run<at::BFloat16, float>(a);
  } else {
    has_native_gemm<at::Half>() ? run<at::Half, at::Half>(a) : run<at::Half, float>(a);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("tree_attention", &tree_attention_cpu);
}

}  // namespace specdec
