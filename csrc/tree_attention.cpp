// CPU kernel of specdec::tree_attention: T tree queries over a cached prefix and over the N >= T pending
// tree nodes, of which the queries are the last T (N == T: one verification tree; N > T: a tree grown
// level by level, the earlier levels' KV already cached).
//
// Design (the xformers split): per (row b, kv head, block of queries) the G = Hq / Hkv query heads
// sharing the kv head are stacked into one [G * tb, D] matrix, so every K/V row is read once per
// group. Keys are visited in chunks: first the prefix [window start, cache_lens[b]), unmasked
// except for the window's lower edge, then the N pending keys under the bit-packed [T, ceil(N/32)]
// mask, read word by word. An online softmax (running max, sum and fp32 accumulator per query)
// merges the chunks, which is the log-sum-exp merge of the two attentions; no dense [T, S + T]
// mask exists.
//
// Scores and P.V are small register-blocked GEMMs (the 6 x 16 outer-product micro-kernel of
// panel_gemm.h), not BLAS calls: at verification sizes (tens of rows, hundreds of keys, D=64)
// a BLAS call spends more in dispatch and packing than in FMAs, and on CPUs without bf16 matrix
// units MKL's bf16 GEMM is a slow emulation. Each chunk's keys are transposed once into fp32 panels
// of 16 keys, and values are read in place (fp32, or one row block) or widened once into panels.
// Tasks of few rows (decode steps, small trees) skip the panels: on AVX-512 through 16-lane paths ("Few rows"
// below), on AVX2 through 8-lane ones ("Few rows on AVX2"). The path is chosen per task by its row count, so a
// query rounds alike in every call whose task holding it takes the same path: up to 32 rows (a chain of up to 10
// tokens of SmolLM2's 3 query heads a kv head), whatever else the call holds; past that, the split of the queries
// into tasks (which depends on the thread count) can move it between the paths.
// Every product accumulates in fp32, probabilities included.
//
// Key splits (flash-decoding): a decode step has few tasks (one row, one query: one per kv head, 3 for
// SmolLM2), which two threads share 2:1. In calls of at most kSplitMaxTasks (row, kv head) pairs the keys
// are cut at fixed rows, every kSplitKeys (a multiple of the chunk) from the cache's start, into ranges
// run as tasks of their own; each leaves its running max, sum and unnormalized accumulator, and a merge
// pass combines them in order (the log-sum-exp merge as between chunks). The cuts depend on the batch
// and the key rows only, never on the thread count or the number of queries: a one-token step rounds as
// the same query inside a verified chain of the same batch (whose tasks take the same path, above). Wider batches already give every thread
// work, and there the merge costs more than it balances (5-11%, 4-16 rows, Xeon, two threads).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <vector>

#include "panel_gemm.h"
#include "simd.h"

namespace specdec {
namespace {

using simd::kLanes;
using simd::kNegInf;

constexpr int64_t kChunk = 256;     // keys per chunk: their fp32 panels (kChunk x D) stay in L2
constexpr int64_t kMinRows = 12;    // rows (heads x queries) worth a task of their own (two row blocks)
constexpr int64_t kMaxRows = 256;   // cap on rows per task (buffers)
constexpr int64_t kTasksPerThread = 4;
constexpr int64_t kSplitKeys = 512;   // key rows per split (a multiple of kChunk: the same chunk boundaries)
constexpr int64_t kSplitMaxTasks = 3;  // calls of at most this many (row, kv head) pairs split their keys
// Tasks of at most this many rows (query heads x queries) take the direct paths on AVX-512. In a sweep of
// 8, 16, 32 and 64 (processes alternating, 1-64 queries at one row and 16 rows, Xeon, two threads;
// bench/results/tree_attention_direct_rows_sweep.jsonl) 32 was as fast as or faster than 8 and 16 throughout.
constexpr int64_t kDirectRows = 32;

// The row limit of the direct paths for this call: $SPECDEC_ATTENTION_DIRECT_ROWS where set, on any CPU
// (0: always panels; A/B runs, and tests on CPUs without AVX-512), else kDirectRows on AVX-512 and 0 elsewhere
// (16-lane vectors are two registers each on AVX2, and the 16 score accumulators would spill).
int64_t direct_row_limit() {
  const char* env = std::getenv("SPECDEC_ATTENTION_DIRECT_ROWS");
  if (env && *env) return std::atoll(env);
  return simd::best_isa() == simd::Isa::kAvx512 ? kDirectRows : 0;
}
// The same for the 8-lane direct paths: $SPECDEC_ATTENTION_DIRECT8_ROWS where set (0: off), else kDirect8Rows on
// AVX2 without AVX-512 (where the 16-lane paths are the faster) and 0 elsewhere.
int64_t direct8_row_limit();
using panel::kPanel;
using panel::v8;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Eight elements widened to fp32.
template <typename T>
SPECDEC_INLINE v8 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    v8 v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    return simd::load_bf16_n<8>(reinterpret_cast<const uint16_t*>(p));
  } else {
    return simd::load_f16_n<8>(reinterpret_cast<const uint16_t*>(p));
  }
}
SPECDEC_INLINE void store8(float* p, v8 v) { std::memcpy(p, &v, sizeof(v)); }

// r[i][d] -> r[d][i] for an 8 x 8 block (the unpack / shuffle / 128-bit permute ladder).
SPECDEC_INLINE void transpose8(v8* r) {
  const v8 t0 = __builtin_shufflevector(r[0], r[1], 0, 8, 1, 9, 4, 12, 5, 13);
  const v8 t1 = __builtin_shufflevector(r[0], r[1], 2, 10, 3, 11, 6, 14, 7, 15);
  const v8 t2 = __builtin_shufflevector(r[2], r[3], 0, 8, 1, 9, 4, 12, 5, 13);
  const v8 t3 = __builtin_shufflevector(r[2], r[3], 2, 10, 3, 11, 6, 14, 7, 15);
  const v8 t4 = __builtin_shufflevector(r[4], r[5], 0, 8, 1, 9, 4, 12, 5, 13);
  const v8 t5 = __builtin_shufflevector(r[4], r[5], 2, 10, 3, 11, 6, 14, 7, 15);
  const v8 t6 = __builtin_shufflevector(r[6], r[7], 0, 8, 1, 9, 4, 12, 5, 13);
  const v8 t7 = __builtin_shufflevector(r[6], r[7], 2, 10, 3, 11, 6, 14, 7, 15);
  const v8 u0 = __builtin_shufflevector(t0, t2, 0, 1, 8, 9, 4, 5, 12, 13);
  const v8 u1 = __builtin_shufflevector(t0, t2, 2, 3, 10, 11, 6, 7, 14, 15);
  const v8 u2 = __builtin_shufflevector(t1, t3, 0, 1, 8, 9, 4, 5, 12, 13);
  const v8 u3 = __builtin_shufflevector(t1, t3, 2, 3, 10, 11, 6, 7, 14, 15);
  const v8 u4 = __builtin_shufflevector(t4, t6, 0, 1, 8, 9, 4, 5, 12, 13);
  const v8 u5 = __builtin_shufflevector(t4, t6, 2, 3, 10, 11, 6, 7, 14, 15);
  const v8 u6 = __builtin_shufflevector(t5, t7, 0, 1, 8, 9, 4, 5, 12, 13);
  const v8 u7 = __builtin_shufflevector(t5, t7, 2, 3, 10, 11, 6, 7, 14, 15);
  r[0] = __builtin_shufflevector(u0, u4, 0, 1, 2, 3, 8, 9, 10, 11);
  r[4] = __builtin_shufflevector(u0, u4, 4, 5, 6, 7, 12, 13, 14, 15);
  r[1] = __builtin_shufflevector(u1, u5, 0, 1, 2, 3, 8, 9, 10, 11);
  r[5] = __builtin_shufflevector(u1, u5, 4, 5, 6, 7, 12, 13, 14, 15);
  r[2] = __builtin_shufflevector(u2, u6, 0, 1, 2, 3, 8, 9, 10, 11);
  r[6] = __builtin_shufflevector(u2, u6, 4, 5, 6, 7, 12, 13, 14, 15);
  r[3] = __builtin_shufflevector(u3, u7, 0, 1, 2, 3, 8, 9, 10, 11);
  r[7] = __builtin_shufflevector(u3, u7, 4, 5, 6, 7, 12, 13, 14, 15);
}

// kp[p, d, s] = k[(16 p + s) * stride + d] widened, 0 for keys >= n: a chunk's keys as fp32 panels
// of 16 keys with one 16-wide step per head dimension (the B operand of the scores micro-kernel).
template <typename scalar_t>
SPECDEC_INLINE void pack_keys(const scalar_t* k, int64_t stride, int64_t n, int64_t D, float* kp) {
  const int64_t n_pad = round_up(n, kPanel);
  for (int64_t j0 = 0; j0 < n_pad; j0 += 8) {
    float* dst = kp + (j0 / kPanel) * D * kPanel + j0 % kPanel;
    const int64_t rows = std::clamp<int64_t>(n - j0, 0, 8);
    int64_t d0 = 0;
    if (rows == 8) {
      for (; d0 + 8 <= D; d0 += 8) {
        v8 r[8];
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) r[i] = load8(k + (j0 + i) * stride + d0);
        transpose8(r);
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) store8(dst + (d0 + i) * kPanel, r[i]);
      }
    }
    for (; d0 < D; ++d0)
      for (int64_t i = 0; i < 8; ++i)
        dst[d0 * kPanel + i] = i < rows ? static_cast<float>(k[(j0 + i) * stride + d0]) : 0.0f;
  }
}

// vp[p, j, s] = v[j * stride + 16 p + s] widened, 0 past D: a chunk's values as fp32 panels of 16
// head dims (the B operand of the P.V micro-kernel), so that every row block reads them without
// widening them again.
template <typename scalar_t>
SPECDEC_INLINE void pack_values(const scalar_t* v, int64_t stride, int64_t n, int64_t D, float* vp) {
  const int64_t P = (D + kPanel - 1) / kPanel;
  for (int64_t p = 0; p < P; ++p) {
    const int64_t d0 = p * kPanel;
    float* dst = vp + p * n * kPanel;
    if (d0 + kPanel <= D) {
      for (int64_t j = 0; j < n; ++j) {
        store8(dst + j * kPanel, load8(v + j * stride + d0));
        store8(dst + j * kPanel + 8, load8(v + j * stride + d0 + 8));
      }
    } else {
      for (int64_t j = 0; j < n; ++j)
        for (int64_t s = 0; s < kPanel; ++s)
          dst[j * kPanel + s] = d0 + s < D ? static_cast<float>(v[j * stride + d0 + s]) : 0.0f;
    }
  }
}

enum class Epilogue { kScale, kAdd };  // out = scale * x.B, or out += x.B

// The B operand of a small GEMM for panel::gemm: column 16 p + c at step k is
// w[p * step_p + k * step_k + c] (16 contiguous elements per panel step), and its fp32 output
// out[m, 16 p + c] with row stride ldo (always whole panels: the buffers are padded to them).
template <typename w_t, Epilogue E>
struct PanelsOp {
  const w_t* w;
  int64_t step_k, step_p;
  float* out;
  int64_t ldo;
  float scale;

  SPECDEC_INLINE void load(int64_t p, int64_t k, v8& lo, v8& hi) const {
    const w_t* src = w + p * step_p + k * step_k;
    lo = load8(src);
    hi = load8(src + 8);
  }
  SPECDEC_INLINE void store(int64_t m, int64_t p, v8 lo, v8 hi) const {
    float* o = out + m * ldo + p * kPanel;
    if constexpr (E == Epilogue::kScale) {
      store8(o, lo * scale);
      store8(o + 8, hi * scale);
    } else {
      store8(o, load8(o) + lo);
      store8(o + 8, load8(o + 8) + hi);
    }
  }
};

// out[M, 16 P] (=, +=) x[M, K] . B over P panels. Wide register blocks up to three rows: fp32 panel
// steps fold into the FMAs as memory operands, so 3 x 2 x 2 accumulators fit.
template <Epilogue E, typename w_t>
SPECDEC_INLINE void small_gemm(const float* x, int64_t ldx, int64_t M, int64_t K, const w_t* w, int64_t step_k,
                               int64_t step_p, int64_t P, float* out, int64_t ldo, float scale) {
  panel::gemm<3>(PanelsOp<w_t, E>{w, step_k, step_p, out, ldo, scale}, x, ldx, M, K, 0, P);
}

struct Strides {
  int64_t b, h, t;  // in elements; the last dimension is contiguous
};

struct Args {
  int64_t B, Hq, Hkv, G, T, D, W, tb, blocks;
  int64_t N, off;        // pending keys; query t is pending node off + t (off = N - T)
  const void *q, *kc, *vc, *kt, *vt;
  Strides sq, skc, svc, skt, svt;
  const int64_t* lens;   // [B]
  const int32_t* mask;   // [B, T, W = ceil(N / 32)] or null (causal chain)
  const int64_t* pos;    // [B, N] or null (no window)
  int64_t window;        // 0: none
  float scale;
  int64_t direct_rows;   // tasks of at most this many rows take the direct paths (0: never)
  int64_t direct8_rows;  // ... the 8-lane direct paths, first (0: never)
  int64_t split_keys;    // key rows per split (0: none)
  int64_t splits;        // key ranges per (row, kv head, query block): enough for the longest row; 1: none
  float* part;           // splits > 1: [B * Hkv * blocks, splits, G * tb, 2 + D] running max, sum, accumulator
  void* out;             // [B, Hq, T, D] contiguous
};

// Turns one chunk of scores into probabilities, in place, and folds them into the running softmax
// state. S: [M, lds] fp32 scores (n valid columns, padded here with -inf); m, l: [M] running max and
// sum; acc: [M, ldacc] fp32 output accumulator (D columns used), rescaled to the new max.
SPECDEC_INLINE void softmax_chunk(float* S, int64_t M, int64_t n, int64_t lds, float* m, float* l, float* acc,
                                  int64_t D, int64_t ldacc) {
  // 8-lane vectors: 16-lane temporaries of the exponential spill on AVX2's 16 registers.
  const int64_t n_pad = round_up(n, kLanes);
  const v8 neg_inf = v8{} + kNegInf;
  for (int64_t r = 0; r < M; ++r) {
    float* row = S + r * lds;
    for (int64_t j = n; j < n_pad; ++j) row[j] = kNegInf;
    v8 mx0 = neg_inf, mx1 = neg_inf;
    for (int64_t j = 0; j < n_pad; j += 16) {
      const v8 a0 = load8(row + j), a1 = load8(row + j + 8);
      mx0 = a0 > mx0 ? a0 : mx0;
      mx1 = a1 > mx1 ? a1 : mx1;
    }
    mx0 = mx0 > mx1 ? mx0 : mx1;
    float cm = mx0[0];
    for (int q = 1; q < 8; ++q) cm = mx0[q] > cm ? mx0[q] : cm;
    if (cm == kNegInf) {  // nothing visible in this chunk
      std::memset(row, 0, n_pad * sizeof(float));
      continue;
    }
    const float m_new = std::max(m[r], cm);
    const v8 mv = v8{} + m_new;
    v8 s0 = v8{}, s1 = v8{};
    for (int64_t j = 0; j < n_pad; j += 16) {
      const v8 e0 = simd::exp_nonpos_v(load8(row + j) - mv);
      const v8 e1 = simd::exp_nonpos_v(load8(row + j + 8) - mv);
      s0 += e0;
      s1 += e1;
      store8(row + j, e0);
      store8(row + j + 8, e1);
    }
    s0 += s1;
    float sum = 0.0f;
    for (int q = 0; q < 8; ++q) sum += s0[q];
    const float corr = m[r] == kNegInf ? 0.0f : std::exp(m[r] - m_new);
    l[r] = l[r] * corr + sum;
    if (corr != 1.0f) {
      float* a = acc + r * ldacc;
      for (int64_t d = 0; d < D; ++d) a[d] *= corr;
    }
    m[r] = m_new;
  }
}

// One task: row b, kv head hk, tree queries [t0, t1) of every head in the group; G * tb = M rows,
// row r = g * tb + i being query head hk * G + g at tree position t0 + i. Buffers live in a
// per-thread workspace that only grows (a key panel buffer is too big to allocate per call).
struct Task {
  int64_t b, hk, t0, tb, M, D, Dp, ld;  // Dp: D rounded up to panels; ld: row stride of the scores
  float* q;     // [M, D] queries
  float* S;     // [M, ld] scores, then probabilities
  float* acc;   // [M, Dp] accumulator
  float *m, *l; // [M] running max and sum
  float* kp;    // [kChunk / 16, D, 16] the chunk's keys as panels
  float* vp;    // [Dp / 16, kChunk, 16] the chunk's values as panels (unless read in place)
  float* bias;  // [ld] additive mask row (0 or -inf) of one query

  Task(const Args& a, int64_t item)
      : b(item / (a.Hkv * a.blocks)), hk((item / a.blocks) % a.Hkv), t0((item % a.blocks) * a.tb),
        tb(std::max<int64_t>(0, std::min(a.T, t0 + a.tb) - t0)), M(a.G * tb), D(a.D), Dp(round_up(a.D, kPanel)),
        ld(kChunk + kLanes) {
    static thread_local std::vector<float> workspace;
    const int64_t sizes[] = {M * D, M * ld, M * Dp, M, M, kChunk * D, Dp * kChunk, ld};
    int64_t total = 0;
    for (int64_t s : sizes) total += round_up(s, kLanes);
    if (static_cast<int64_t>(workspace.size()) < total) workspace.resize(total);
    float* p = workspace.data();
    float** slots[] = {&q, &S, &acc, &m, &l, &kp, &vp, &bias};
    for (int i = 0; i < 8; ++i) {
      *slots[i] = p;
      p += round_up(sizes[i], kLanes);
    }
    std::fill(acc, acc + M * Dp, 0.0f);
    std::fill(m, m + M, kNegInf);
    std::fill(l, l + M, 0.0f);
  }
  float* row(int64_t g, int64_t i) { return S + (g * tb + i) * ld; }
};

// A run of keys laid out at rows [v0, v1) of kbase/vbase: rows before `split` are prefix keys
// (key position = row), rows from `split` on are tree keys (tree index = row - split). The prefix
// and the tree form one segment when the tree follows the valid prefix in memory (the runtime's
// layout for aligned rows), so each chunk is one pass instead of two.
template <typename scalar_t>
struct Segment {
  const scalar_t *k, *v;
  int64_t stride_k, stride_v, v0, v1, split;
};

// Hides prefix keys at columns [j0, j0 + n) (positions p0..) below each query's window: query i
// sees keys at positions > pos_i - window.
SPECDEC_INLINE void mask_prefix(Task& w, const Args& a, int64_t p0, int64_t j0, int64_t n) {
  if (!a.pos) return;
  for (int64_t i = 0; i < w.tb; ++i) {
    const int64_t hidden = std::min(n, a.pos[w.b * a.N + a.off + w.t0 + i] - a.window + 1 - p0);
    for (int64_t g = 0; hidden > 0 && g < a.G; ++g) std::fill(w.row(g, i) + j0, w.row(g, i) + j0 + hidden, kNegInf);
  }
}

// Hides pending keys at columns [j0, j0 + n) (pending indices c0..) that each query's mask row does
// not show, or out of its window. Columns past j0 + n may be set to -inf (they are padding).
SPECDEC_INLINE void mask_tree(Task& w, const Args& a, int64_t c0, int64_t j0, int64_t n) {
  using namespace simd;
  const int64_t n_pad = round_up(n, kLanes);
  const int64_t* pos = a.pos ? a.pos + w.b * a.N : nullptr;
  for (int64_t i = 0; i < w.tb; ++i) {
    const int64_t t = w.t0 + i, self = a.off + t;  // query index, its pending index
    if (!a.mask && !pos) {  // causal chain: the keys after the query's own
      const int64_t from = std::max<int64_t>(0, self + 1 - c0);
      for (int64_t g = 0; from < n && g < a.G; ++g) std::fill(w.row(g, i) + j0 + from, w.row(g, i) + j0 + n, kNegInf);
      continue;
    }
    // One additive row (0 visible, -inf hidden) per query, added to its G heads' rows.
    float* bias = w.bias;
    const int32_t* words = a.mask ? a.mask + (w.b * a.T + t) * a.W : nullptr;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t col = c0 + j;
      bool vis = words ? (static_cast<uint32_t>(words[col >> 5]) >> (col & 31)) & 1u : col <= self;
      if (pos) vis = vis && pos[col] > pos[self] - a.window;
      bias[j] = vis ? 0.0f : kNegInf;
    }
    for (int64_t j = n; j < n_pad; ++j) bias[j] = kNegInf;
    for (int64_t g = 0; g < a.G; ++g) {
      float* row = w.row(g, i) + j0;
      for (int64_t j = 0; j < n_pad; j += kLanes) store(row + j, load(row + j) + load(bias + j));
    }
  }
}

// ---- Few rows: decode steps and small trees (M <= Args::direct_rows) ----
// At M = G * tb of a few rows, transposing every key into panels costs more than the products it
// feeds, and the panel kernel's 8-lane registers use half of an AVX-512 register. These 16-lane paths
// (one zmm on AVX-512, where they are chosen by default) skip the panels: a score is a dot product of the
// query with the key row (fp32 keys read in place, others widened once per block of 16 keys), D / 16 FMAs
// into a 16-lane accumulator per key, and the 16 accumulators of 16 keys fold into one vector of 16 scores by
// four levels of two-vector shuffles (45 instructions per 16 keys, not 16 horizontal sums). P.V reads the
// value rows as they are.
using simd::vf;

template <typename T>
SPECDEC_INLINE vf load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return simd::load(p);
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    return simd::load_bf16(reinterpret_cast<const uint16_t*>(p));
  } else {
    return simd::load_f16(reinterpret_cast<const uint16_t*>(p));
  }
}

SPECDEC_INLINE vf broadcast16(const float* p) {
  const vf t = {*p};
  return __builtin_shufflevector(t, t, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
}

// The folds: fold4(fold3(fold2(fold1(a0, a1), fold1(a2, a3)), ...)) has lane i = sum of a_i's lanes.
// Level k leaves 16 / 2^k partial sums of each of 2^k vectors, in order.
SPECDEC_INLINE vf fold1(vf a, vf b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
SPECDEC_INLINE vf fold2(vf a, vf b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
         __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
}
SPECDEC_INLINE vf fold3(vf a, vf b) {
  return __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
         __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
}
SPECDEC_INLINE vf fold4(vf a, vf b) {
  return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// out[i] = scale * q . k_i for the 16 keys k_i = k + i * ldk (fp32, D % 16 == 0).
SPECDEC_INLINE vf scores16(const float* q, const float* k, int64_t ldk, int64_t D, float scale) {
  vf acc[16] = {};
  for (int64_t d = 0; d < D; d += kLanes) {
    const vf qv = simd::load(q + d);
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) acc[i] += qv * simd::load(k + i * ldk + d);
  }
  const vf lo = fold3(fold2(fold1(acc[0], acc[1]), fold1(acc[2], acc[3])),
                      fold2(fold1(acc[4], acc[5]), fold1(acc[6], acc[7])));
  const vf hi = fold3(fold2(fold1(acc[8], acc[9]), fold1(acc[10], acc[11])),
                      fold2(fold1(acc[12], acc[13]), fold1(acc[14], acc[15])));
  return fold4(lo, hi) * scale;
}

// S[r, j] = scale * q_r . k_j for the chunk's n keys, every row. Keys are read in place where they are
// fp32 and a whole block of 16; otherwise a block is widened once into w.kp (16 x D), zero past n.
template <typename scalar_t>
SPECDEC_INLINE void direct_scores(Task& w, const scalar_t* k, int64_t stride, int64_t n, float scale) {
  const int64_t D = w.D;
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t nk = std::min<int64_t>(16, n - j0);
    const float* tile = w.kp;
    int64_t ldt = D;
    bool in_place = false;
    if constexpr (std::is_same_v<scalar_t, float>) {
      in_place = nk == 16;
      if (in_place) {
        tile = k + j0 * stride;
        ldt = stride;
      }
    }
    if (!in_place) {
      for (int64_t i = 0; i < 16; ++i)
        for (int64_t d = 0; d < D; d += kLanes)
          simd::store(w.kp + i * D + d, i < nk ? load16(k + (j0 + i) * stride + d) : vf{});
    }
    for (int64_t r = 0; r < w.M; ++r) simd::store(w.S + r * w.ld + j0, scores16(w.q + r * D, tile, ldt, D, scale));
  }
}

// acc[r, d0 + 16 c ...] += sum_j P[r, j] v[j, d0 + 16 c ...] for MR rows, NV vectors of 16 columns.
template <int MR, int NV, typename scalar_t>
SPECDEC_INLINE void pv_block(const float* P, int64_t ldp, const scalar_t* v, int64_t stride, int64_t n, float* acc,
                             int64_t ldacc) {
  vf sum[MR][NV];
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) sum[m][c] = simd::load(acc + m * ldacc + c * kLanes);
  for (int64_t j = 0; j < n; ++j) {
    vf vv[NV];
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) vv[c] = load16(v + j * stride + c * kLanes);
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      const vf p = broadcast16(P + m * ldp + j);
#pragma GCC unroll 4
      for (int c = 0; c < NV; ++c) sum[m][c] += p * vv[c];
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) simd::store(acc + m * ldacc + c * kLanes, sum[m][c]);
}

template <int NV, typename scalar_t>
SPECDEC_INLINE void pv_rows(Task& w, const scalar_t* v, int64_t stride, int64_t n, int64_t d0) {
  for (int64_t r = 0; r < w.M; r += 4) {
    const float* P = w.S + r * w.ld;
    float* acc = w.acc + r * w.Dp + d0;
    switch (std::min<int64_t>(4, w.M - r)) {
      case 1: pv_block<1, NV>(P, w.ld, v + d0, stride, n, acc, w.Dp); break;
      case 2: pv_block<2, NV>(P, w.ld, v + d0, stride, n, acc, w.Dp); break;
      case 3: pv_block<3, NV>(P, w.ld, v + d0, stride, n, acc, w.Dp); break;
      default: pv_block<4, NV>(P, w.ld, v + d0, stride, n, acc, w.Dp); break;
    }
  }
}

template <typename scalar_t>
SPECDEC_INLINE void direct_pv(Task& w, const scalar_t* v, int64_t stride, int64_t n) {
  int64_t d0 = 0;
  for (; d0 + 4 * kLanes <= w.D; d0 += 4 * kLanes) pv_rows<4>(w, v, stride, n, d0);
  for (; d0 < w.D; d0 += kLanes) pv_rows<1>(w, v, stride, n, d0);
}

// ---- Few rows on AVX2 (M <= Args::direct8_rows): 8-lane direct paths ----
// The panel path transposes every key into panels, reads each value row once per 32 dimensions and widens bf16 in
// six instructions a vector: a decode step's 3 rows (SmolLM2) cost ~190 cycles a key and kv head on a Zen 3, 8x
// their multiply-adds. Here 16 elements of a key or value row load as two 8-lane vectors in a fixed lane order
// (bf16: the even then the odd elements, two instructions from one 32-byte load; fp16 and fp32: as stored); the
// queries and the accumulator are held in the same order, and 4 keys' scores reduce together.
// Up to the AVX-512 paths' limit (kDirectRows), so that chains of up to 10 tokens of SmolLM2 round as its one-token
// steps. Not swept on AVX2: bench.kernels measured 1.14-1.52x over the panels at 3 rows (one token) and 1.02-1.11x
// at 6-12 (chains of 2 and 4, where the 4-row blocks spill and re-read the chunk).
constexpr int64_t kDirect8Rows = 32;
typedef simd::Lanes<8>::i vi8;

template <typename T>
SPECDEC_INLINE void split16(const T* p, v8& a, v8& b) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    vi8 u;
    std::memcpy(&u, p, sizeof(u));
    a = (v8)(u << 16);  // lane i: element 2i (the low half of the 32 bits)
    b = (v8)(u & static_cast<int32_t>(0xFFFF0000u));  // element 2i + 1
  } else {
    a = load8(p);
    b = load8(p + 8);
  }
}

// 16 fp32 values into (in) and out of (out) split16's lane order for T.
template <typename T>
SPECDEC_INLINE void order16(const float* p, v8& a, v8& b) {
  const v8 x = load8(p), y = load8(p + 8);
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    a = __builtin_shufflevector(x, y, 0, 2, 4, 6, 8, 10, 12, 14);
    b = __builtin_shufflevector(x, y, 1, 3, 5, 7, 9, 11, 13, 15);
  } else {
    a = x;
    b = y;
  }
}
template <typename T>
SPECDEC_INLINE void unorder16(v8 a, v8 b, float* p) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    store8(p, __builtin_shufflevector(a, b, 0, 8, 1, 9, 2, 10, 3, 11));
    store8(p + 8, __builtin_shufflevector(a, b, 4, 12, 5, 13, 6, 14, 7, 15));
  } else {
    store8(p, a);
    store8(p + 8, b);
  }
}

// Lane i of the result (i < 4) is the sum of a[(0, 2, 1, 3)[i]]'s lanes.
SPECDEC_INLINE v8 sum4(v8 a0, v8 a1, v8 a2, v8 a3) {
  const v8 x = __builtin_shufflevector(a0, a1, 0, 1, 2, 3, 8, 9, 10, 11) +
               __builtin_shufflevector(a0, a1, 4, 5, 6, 7, 12, 13, 14, 15);
  const v8 y = __builtin_shufflevector(a2, a3, 0, 1, 2, 3, 8, 9, 10, 11) +
               __builtin_shufflevector(a2, a3, 4, 5, 6, 7, 12, 13, 14, 15);
  const v8 z = __builtin_shufflevector(x, y, 0, 1, 8, 9, 4, 5, 12, 13) +
               __builtin_shufflevector(x, y, 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(z, z, 0, 2, 4, 6, 1, 3, 5, 7) + __builtin_shufflevector(z, z, 1, 3, 5, 7, 0, 2, 4, 6);
}

// S[r, j] = scale * q_r . k_j for the chunk's n keys and rows r0 .. r0 + MR (w.q in split16's order), 4 keys at a
// time. A row's sums do not depend on the rows beside it (nor on MR): a one-token step rounds as that query in a chain
// whose tasks take these paths too (up to direct8_rows rows).
template <int MR, typename T>
SPECDEC_INLINE void scores8(Task& w, int64_t r0, const T* k, int64_t stride, int64_t n, float scale) {
  const int64_t D = w.D;
  const float* q = w.q + r0 * D;
  for (int64_t j0 = 0; j0 < n; j0 += 4) {
    const T* key[4];
    for (int i = 0; i < 4; ++i) key[i] = k + std::min<int64_t>(j0 + i, n - 1) * stride;  // past n: a repeat
    v8 acc[MR][4] = {};
    for (int64_t d = 0; d < D; d += 16) {
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        v8 ka, kb;
        split16(key[i] + d, ka, kb);
#pragma GCC unroll 4
        for (int m = 0; m < MR; ++m) acc[m][i] += load8(q + m * D + d) * ka + load8(q + m * D + d + 8) * kb;
      }
    }
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      const v8 s = sum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]) * scale;
      float* out = w.S + (r0 + m) * w.ld + j0;
      const int64_t nk = std::min<int64_t>(4, n - j0);
      out[0] = s[0];
      if (nk > 1) out[1] = s[2];
      if (nk > 2) out[2] = s[1];
      if (nk > 3) out[3] = s[3];
    }
  }
}

// acc[r, d0 .. d0 + 16 NB) += sum_j P[r, j] v_j for rows r0 .. r0 + MR (the accumulator kept in split16's order
// meanwhile).
template <int MR, int NB, typename T>
SPECDEC_INLINE void pv8_block(Task& w, int64_t r0, const T* v, int64_t stride, int64_t n, int64_t d0) {
  float* const acc_rows = w.acc + r0 * w.Dp;
  const float* const p_rows = w.S + r0 * w.ld;
  v8 acc[MR][2 * NB];
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 2
    for (int g = 0; g < NB; ++g) order16<T>(acc_rows + m * w.Dp + d0 + 16 * g, acc[m][2 * g], acc[m][2 * g + 1]);
  for (int64_t j = 0; j < n; ++j) {
    v8 va[2 * NB];
#pragma GCC unroll 2
    for (int g = 0; g < NB; ++g) split16(v + j * stride + d0 + 16 * g, va[2 * g], va[2 * g + 1]);
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      const v8 p = panel::broadcast8(p_rows + m * w.ld + j);
#pragma GCC unroll 4
      for (int c = 0; c < 2 * NB; ++c) acc[m][c] += p * va[c];
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 2
    for (int g = 0; g < NB; ++g) unorder16<T>(acc[m][2 * g], acc[m][2 * g + 1], acc_rows + m * w.Dp + d0 + 16 * g);
}

template <int MR, typename T>
SPECDEC_INLINE void pv8(Task& w, int64_t r0, const T* v, int64_t stride, int64_t n) {
  int64_t d0 = 0;
  for (; d0 + 32 <= w.D; d0 += 32) pv8_block<MR, 2>(w, r0, v, stride, n, d0);
  if (d0 < w.D) pv8_block<MR, 1>(w, r0, v, stride, n, d0);
}

// Rows in blocks of at most 4 (a block's keys or values are read once for its rows).
template <typename T>
SPECDEC_INLINE void direct8_scores(Task& w, const T* k, int64_t stride, int64_t n, float scale) {
  for (int64_t r0 = 0; r0 < w.M; r0 += 4) {
    switch (std::min<int64_t>(4, w.M - r0)) {
      case 1: scores8<1>(w, r0, k, stride, n, scale); break;
      case 2: scores8<2>(w, r0, k, stride, n, scale); break;
      case 3: scores8<3>(w, r0, k, stride, n, scale); break;
      default: scores8<4>(w, r0, k, stride, n, scale); break;
    }
  }
}

template <typename T>
SPECDEC_INLINE void direct8_pv(Task& w, const T* v, int64_t stride, int64_t n) {
  for (int64_t r0 = 0; r0 < w.M; r0 += 4) {
    switch (std::min<int64_t>(4, w.M - r0)) {
      case 1: pv8<1>(w, r0, v, stride, n); break;
      case 2: pv8<2>(w, r0, v, stride, n); break;
      case 3: pv8<3>(w, r0, v, stride, n); break;
      default: pv8<4>(w, r0, v, stride, n); break;
    }
  }
}

SPECDEC_INLINE bool takes_direct8(const Args& a, int64_t M, int64_t D) { return M <= a.direct8_rows && D % 16 == 0; }

int64_t direct8_row_limit() {
  const char* env = std::getenv("SPECDEC_ATTENTION_DIRECT8_ROWS");
  if (env && *env) return std::max<int64_t>(0, std::atoll(env));
  return simd::best_isa() == simd::Isa::kAvx2 ? kDirect8Rows : 0;
}

// Keys at rows [c0, c0 + n) of a segment: scores, mask, online softmax, acc += P . V.
template <typename scalar_t>
SPECDEC_INLINE void chunk(Task& w, const Args& a, const Segment<scalar_t>& seg, int64_t c0, int64_t n) {
  const int64_t M = w.M, D = w.D, Dp = w.Dp, ld = w.ld;
  const bool direct8 = takes_direct8(a, M, D);
  const bool direct = !direct8 && M <= a.direct_rows && D % kLanes == 0;
  // The chunk's value rows are read only after its scores and softmax: ask for them now, so that they arrive
  // meanwhile (a decode step reads each layer's keys and values once, from memory: the weights streamed since
  // have evicted them). SmolLM2's 3 KV heads over 400 keys, bf16, 2 threads, caches flushed between passes over
  // 30 layers: 85.6-91.7 against 94.5-102.5 us a call, best of 15 in each of 4 alternations (AMD EPYC Zen 3).
  {
    const auto* v = reinterpret_cast<const char*>(seg.v + c0 * seg.stride_v);
    const int64_t row = seg.stride_v * static_cast<int64_t>(sizeof(scalar_t)), bytes = D * sizeof(scalar_t);
    for (int64_t j = 0; j < n; ++j)
      for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(v + j * row + o);
  }
  if (direct8) {
    direct8_scores(w, seg.k + c0 * seg.stride_k, seg.stride_k, n, a.scale);
  } else if (direct) {
    direct_scores(w, seg.k + c0 * seg.stride_k, seg.stride_k, n, a.scale);
  } else {
    pack_keys(seg.k + c0 * seg.stride_k, seg.stride_k, n, D, w.kp);
    small_gemm<Epilogue::kScale>(w.q, D, M, D, w.kp, kPanel, D * kPanel, (n + kPanel - 1) / kPanel, w.S, ld, a.scale);
  }
  const int64_t n_prefix = std::clamp<int64_t>(seg.split - c0, 0, n);
  if (n_prefix > 0) mask_prefix(w, a, c0, 0, n_prefix);
  if (n_prefix < n) mask_tree(w, a, c0 + n_prefix - seg.split, n_prefix, n - n_prefix);
  softmax_chunk(w.S, M, n, ld, w.m, w.l, w.acc, D, Dp);
  const scalar_t* v = seg.v + c0 * seg.stride_v;
  if (direct8) return direct8_pv(w, v, seg.stride_v, n);
  if (direct) return direct_pv(w, v, seg.stride_v, n);
  // Value rows are panels of 16 dims one row apart: read them in place when they need no widening,
  // or when one row block reads them once anyway.
  if (D % kPanel == 0 && (std::is_same_v<scalar_t, float> || M <= panel::kMaxRows)) {
    small_gemm<Epilogue::kAdd>(w.S, ld, M, n, v, seg.stride_v, kPanel, D / kPanel, w.acc, Dp, 1.0f);
  } else {
    pack_values(v, seg.stride_v, n, D, w.vp);
    small_gemm<Epilogue::kAdd>(w.S, ld, M, n, w.vp, kPanel, n * kPanel, Dp / kPanel, w.acc, Dp, 1.0f);
  }
}

template <typename scalar_t>
SPECDEC_INLINE void attend_segment(Task& w, const Args& a, const Segment<scalar_t>& seg) {
  for (int64_t c0 = seg.v0; c0 < seg.v1; c0 += kChunk) chunk(w, a, seg, c0, std::min(kChunk, seg.v1 - c0));
}

// Task `item` of the parallel loop: query block item / splits, key split item % splits.
template <typename scalar_t>
SPECDEC_INLINE void attend_block(const Args& a, int64_t item) {
  const int64_t split = item % a.splits;
  Task w(a, item / a.splits);
  if (w.tb == 0) return;
  const int64_t b = w.b, hk = w.hk, t0 = w.t0, tb = w.tb, G = a.G, D = a.D;

  const auto* q = static_cast<const scalar_t*>(a.q);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < tb; ++i) {
      const scalar_t* src = q + b * a.sq.b + (hk * G + g) * a.sq.h + (t0 + i) * a.sq.t;
      float* dst = w.q + (g * tb + i) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]);
    }
  if (takes_direct8(a, w.M, D)) {  // the queries in the order the 8-lane paths load keys in
    for (int64_t r = 0; r < w.M; ++r)
      for (int64_t d = 0; d < D; d += 16) {
        v8 x, y;
        order16<scalar_t>(w.q + r * D + d, x, y);
        store8(w.q + r * D + d, x);
        store8(w.q + r * D + d + 8, y);
      }
  }

  // Prefix keys [lo, L), lo the lowest position any query's window reaches.
  const int64_t L = a.lens[b];
  int64_t lo = 0;
  if (a.pos) {
    lo = L;
    for (int64_t i = 0; i < tb; ++i)
      lo = std::min(lo, std::max<int64_t>(0, a.pos[b * a.N + a.off + t0 + i] - a.window + 1));
  }
  // Pending keys [0, hi), hi one past the last column any query of the block sees.
  int64_t hi = a.off + t0 + tb;
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
    hi = std::min(hi, a.N);
  }
  const auto* kc = static_cast<const scalar_t*>(a.kc) + b * a.skc.b + hk * a.skc.h;
  const auto* vc = static_cast<const scalar_t*>(a.vc) + b * a.svc.b + hk * a.svc.h;
  const auto* kt = static_cast<const scalar_t*>(a.kt) + b * a.skt.b + hk * a.skt.h;
  const auto* vt = static_cast<const scalar_t*>(a.vt) + b * a.svt.b + hk * a.svt.h;
  // This split's key rows [split * split_keys, (split + 1) * split_keys) of the cache (all of them without
  // splits); the pending keys where they follow the prefix in memory, else (in their own buffer) in the last split.
  const int64_t lo_row = a.splits > 1 ? split * a.split_keys : 0;
  const int64_t hi_row = a.splits > 1 && split < a.splits - 1 ? lo_row + a.split_keys : INT64_MAX;
  const bool last = split == a.splits - 1;
  const bool joined = a.skc.t == a.skt.t && a.svc.t == a.svt.t && kc + L * a.skc.t == kt && vc + L * a.svc.t == vt;
  const int64_t from = std::max(lo, lo_row);
  if (joined) {
    const int64_t to = std::min(L + hi, hi_row);
    if (from < to) attend_segment(w, a, Segment<scalar_t>{kc, vc, a.skc.t, a.svc.t, from, to, L});
  } else {
    const int64_t to = std::min(L, hi_row);
    if (from < to) attend_segment(w, a, Segment<scalar_t>{kc, vc, a.skc.t, a.svc.t, from, to, L});
    if (last) attend_segment(w, a, Segment<scalar_t>{kt, vt, a.skt.t, a.svt.t, 0, hi, 0});
  }

  if (a.splits > 1) {  // leave the running state for the merge
    float* part = a.part + item * a.G * a.tb * (2 + D);  // item = block * splits + split
    for (int64_t r = 0; r < w.M; ++r) {
      float* dst = part + r * (2 + D);
      dst[0] = w.m[r];
      dst[1] = w.l[r];
      std::memcpy(dst + 2, w.acc + r * w.Dp, D * sizeof(float));
    }
    return;
  }
  auto* out = static_cast<scalar_t*>(a.out);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < tb; ++i) {
      const int64_t r = g * tb + i;
      const float inv = w.l[r] > 0.0f ? 1.0f / w.l[r] : 0.0f;  // no visible key (not a valid tree): zeros
      scalar_t* dst = out + ((b * a.Hq + hk * G + g) * a.T + t0 + i) * D;
      const float* src = w.acc + r * w.Dp;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(src[d] * inv);
    }
}

template <typename scalar_t>
SPECDEC_TARGET_AVX512 void attend_avx512(const Args& a, int64_t item) {
  attend_block<scalar_t>(a, item);
}
template <typename scalar_t>
SPECDEC_TARGET_AVX2 void attend_avx2(const Args& a, int64_t item) {
  attend_block<scalar_t>(a, item);
}
template <typename scalar_t>
void attend_base(const Args& a, int64_t item) {
  attend_block<scalar_t>(a, item);
}

// out for query block `item` from its key splits' running states: with M_s, l_s, acc_s per split and
// M = max M_s, out = sum_s e^(M_s - M) acc_s / sum_s e^(M_s - M) l_s (zeros where no key was visible).
template <typename scalar_t>
void merge_splits(const Args& a, int64_t item) {
  const int64_t b = item / (a.Hkv * a.blocks), hk = (item / a.blocks) % a.Hkv, t0 = (item % a.blocks) * a.tb;
  const int64_t tb = std::max<int64_t>(0, std::min(a.T, t0 + a.tb) - t0), D = a.D, rows = a.G * a.tb;
  const float* part = a.part + item * a.splits * rows * (2 + D);
  std::vector<float> acc(D);
  auto* out = static_cast<scalar_t*>(a.out);
  for (int64_t g = 0; g < a.G; ++g)
    for (int64_t i = 0; i < tb; ++i) {
      const int64_t r = g * tb + i;
      float m = kNegInf;
      for (int64_t s = 0; s < a.splits; ++s) m = std::max(m, part[(s * rows + r) * (2 + D)]);
      float l = 0.0f;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t s = 0; m != kNegInf && s < a.splits; ++s) {
        const float* src = part + (s * rows + r) * (2 + D);
        if (src[0] == kNegInf) continue;
        const float c = std::exp(src[0] - m);
        l += c * src[1];
        for (int64_t d = 0; d < D; ++d) acc[d] += c * src[2 + d];
      }
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
      scalar_t* dst = out + ((b * a.Hq + hk * a.G + g) * a.T + t0 + i) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(acc[d] * inv);
    }
}

template <typename scalar_t>
void run(const Args& a) {
  using Fn = void (*)(const Args&, int64_t);
  const Fn fn = simd::pick<Fn>(attend_avx512<scalar_t>, attend_avx2<scalar_t>, attend_base<scalar_t>);
  const int64_t blocks = a.B * a.Hkv * a.blocks;
  at::parallel_for(0, blocks * a.splits, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) fn(a, item);
  });
  if (a.splits == 1) return;
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) merge_splits<scalar_t>(a, item);
  });
}

// Key rows per split for a call of `pairs` (row, kv head) pairs: kSplitKeys where pairs <= kSplitMaxTasks, else
// none (0); $SPECDEC_ATTENTION_SPLIT_KEYS, where set, in every call (rounded up to whole chunks; 0 or less: none).
int64_t split_keys(int64_t pairs) {
  const char* env = std::getenv("SPECDEC_ATTENTION_SPLIT_KEYS");
  if (!env || !*env) return pairs <= kSplitMaxTasks ? kSplitKeys : 0;
  const int64_t n = std::atoll(env);
  return n <= 0 ? 0 : round_up(n, kChunk);
}

// Query blocks per (row, kv head): each block at least kMinRows tall (when T allows) and
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
  const int64_t N = k_tree_in.size(2);
  const std::vector<int64_t> tree_shape{B, Hkv, N, D};
  TORCH_CHECK(N >= T && k_tree_in.sizes() == tree_shape && v_tree_in.sizes() == tree_shape, op,
              "k_tree and v_tree must be [B, Hkv, N, D] = [", B, ", ", Hkv, ", N, ", D, "] with N >= T = ", T,
              ", got ", k_tree_in.sizes(), " and ", v_tree_in.sizes());
  TORCH_CHECK(cache_lens.dim() == 1 && cache_lens.size(0) == B && cache_lens.device().is_cpu() &&
                  (cache_lens.scalar_type() == at::kLong || cache_lens.scalar_type() == at::kInt),
              op, "cache_lens must be a [B] int32/int64 CPU tensor, got ", cache_lens.scalar_type(), " of shape ",
              cache_lens.sizes());
  const auto lens = cache_lens.to(at::kLong).contiguous();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = lens.const_data_ptr<int64_t>()[b];
    TORCH_CHECK(0 <= len && len <= S, op, "cache_lens[", b, "] = ", len, " is outside [0, S = ", S, "]");
  }
  const int64_t W = (N + 31) / 32;
  at::Tensor mask;
  if (tree_mask.has_value()) {
    mask = tree_mask->contiguous();
    TORCH_CHECK(mask.scalar_type() == at::kInt && mask.dim() == 3 && mask.size(0) == B && mask.size(1) == T &&
                    mask.size(2) == W && mask.device().is_cpu(),
                op, "tree_mask must be a [B, T, ceil(N/32)] = [", B, ", ", T, ", ", W, "] int32 CPU tensor, got ",
                mask.scalar_type(), " of shape ", mask.sizes());
  }
  at::Tensor pos;
  if (window.has_value()) {
    TORCH_CHECK(*window >= 1, op, "window must be >= 1, got ", *window);
    TORCH_CHECK(tree_positions.has_value(), op, "tree_positions are required with a sliding window");
    pos = tree_positions->to(at::kLong).contiguous();
    TORCH_CHECK(pos.dim() == 2 && pos.size(0) == B && pos.size(1) == N && pos.device().is_cpu(), op,
                "tree_positions must be [B, N] = [", B, ", ", N, "], got shape ", pos.sizes());
  }
  auto out = at::empty({B, Hq, T, D}, q_in.options());
  if (out.numel() == 0) return out;
  const auto q = last_dim_contiguous(q_in), kc = last_dim_contiguous(k_cache_in), vc = last_dim_contiguous(v_cache_in);
  const auto kt = last_dim_contiguous(k_tree_in), vt = last_dim_contiguous(v_tree_in);

  Args a{};
  a.B = B, a.Hq = Hq, a.Hkv = Hkv, a.G = Hq / Hkv, a.T = T, a.D = D, a.W = W, a.N = N, a.off = N - T;
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
  a.direct_rows = direct_row_limit();
  a.direct8_rows = direct8_row_limit();
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) longest = std::max(longest, a.lens[b]);
  a.split_keys = split_keys(B * Hkv);
  a.splits = a.split_keys > 0 ? std::max<int64_t>(1, (longest + N + a.split_keys - 1) / a.split_keys) : 1;
  at::Tensor part;
  if (a.splits > 1) {
    part = at::empty({B * Hkv * a.blocks * a.splits * a.G * a.tb * (2 + D)}, q_in.options().dtype(at::kFloat));
    a.part = part.mutable_data_ptr<float>();
  }
  a.out = out.mutable_data_ptr();
  if (dtype == at::kFloat) {
    run<float>(a);
  } else if (dtype == at::kBFloat16) {
    run<at::BFloat16>(a);
  } else {
    run<at::Half>(a);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("tree_attention", &tree_attention_cpu);
}

}  // namespace specdec
