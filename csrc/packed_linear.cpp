// CPU kernel of specdec::packed_linear: y = x . W^T + b for a few rows of x (verification's T
// drafted tokens, T ~ 1-64), with W prepacked once into column panels (specdec.kernels.pack_linear_weight):
//
//   packed[p, k, s] = W[16 p + col(s), k]   (p < ceil(N / 16), zero past N)
//   col(s) = s                  for fp32 and fp16
//   col(s) = s / 2 + 8 (s % 2)  for bf16: the 16 values of one (p, k) load as 8 int32 lanes whose
//                               low halves are columns 0-7 and high halves columns 8-15, so widening
//                               them to fp32 is one shift and one mask.
//
// Why a second linear kernel: skinny_linear (csrc/skinny_linear.cpp) takes W as stored, [N, K], and
// dots rows of W with rows of x, so every output element is a horizontal sum and each widened
// weight vector can only be reused across a few rows of x before the registers run out. From four
// rows on it is compute-bound at a fraction of the FMA rate, and a verification of T tokens costs
// nearly T times a one-token step. With panels, the inner loop is an outer product: one panel
// step widens 16 weights into two registers and broadcasts one x value per row, so a 6-row block
// keeps 12 accumulators and does 12 FMAs per 16 weights read (the classic 6x16 GEMM micro-kernel).
//
// Batch invariance: every output element is one fp32 accumulator, updated once per k in order
// k = 0 .. K-1 with the same multiply-add (one fused FMA where the ISA has it: setup.py compiles
// with -ffp-contract=fast so every instantiation contracts alike), then the bias, then one rounding
// to the output dtype.
// Which rows share a call, or how they are blocked, never changes that sequence, so row m of a
// T-row verification equals, bit for bit, the same row computed alone (one-token decoding).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "linear_common.h"
#include "panel_gemm.h"
#include "simd.h"

namespace specdec {
namespace {

using panel::kPanel;
using panel::v8;
typedef simd::Lanes<8>::i v8i;

struct Args {
  const float* x;  // [M, K] fp32 (x widened once per call)
  const void* w;   // [P, K, 16] packed weight dtype
  const float* b;  // [N] fp32 or null
  void* y;         // [M, N] output dtype
  int64_t M, N, K;
};

// How far ahead of the panel step being read the weight stream is prefetched. The packed weight is
// one sequential stream (panel after panel) read once per call from DRAM; the hardware prefetcher
// alone does not keep enough misses in flight for the FMAs of 2-12 rows to overlap it. Measured on a
// Zen 3 EPYC (AVX2, one thread), all 211 bf16 weights of SmolLM2-135M (270 MB), best of 5, ms, four
// rounds alternating builds: 6 rows 31.3-40.3 without, 23.9-26.2 with (one noisy round 31.6); 4 rows
// 28.3-33.6 / 22.8-23.5; 12 rows 50.2-64.0 / 41.7-44.8; one row (bandwidth bound) unchanged, ~20.
// In a stand-alone harness 2 KB and 8 KB were within a few percent of 4 KB.
constexpr uintptr_t kPrefetchBytes = 4096;

// The micro-kernel's view of a packed weight: panel steps widened from the packed layout, sums
// stored with the bias, one rounding, columns past N dropped.
template <typename w_t>
struct PackedOp {
  const Args& a;

  SPECDEC_INLINE void load(int64_t p, int64_t k, v8& lo, v8& hi) const {
    const w_t* w = static_cast<const w_t*>(a.w) + (p * a.K + k) * kPanel;
    // Inline asm rather than __builtin_prefetch: with the builtin GCC 12 spilled one of the 6-row
    // block's twelve accumulators to the stack (a store and reload on every k step, slower than no
    // prefetch at all). An address past the end is harmless: a prefetch never faults.
#if defined(__x86_64__)
    asm volatile("prefetcht0 %0" : : "m"(*reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(w) + kPrefetchBytes)));
#else
    __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(w) + kPrefetchBytes));
#endif
    if constexpr (std::is_same_v<w_t, float>) {
      std::memcpy(&lo, w, sizeof(v8));
      std::memcpy(&hi, w + 8, sizeof(v8));
    } else if constexpr (std::is_same_v<w_t, at::BFloat16>) {  // interleaved: one shift, one mask
      v8i v;
      std::memcpy(&v, w, sizeof(v));
      lo = (v8)(v << 16);
      hi = (v8)(v & static_cast<int32_t>(0xFFFF0000u));
    } else {
      lo = simd::load_f16_n<8>(reinterpret_cast<const uint16_t*>(w));
      hi = simd::load_f16_n<8>(reinterpret_cast<const uint16_t*>(w) + 8);
    }
  }

  SPECDEC_INLINE void store(int64_t m, int64_t p, v8 lo, v8 hi) const {
    float v[kPanel];
    std::memcpy(v, &lo, sizeof(lo));
    std::memcpy(v + 8, &hi, sizeof(hi));
    const int64_t n0 = p * kPanel, cols = std::min<int64_t>(kPanel, a.N - n0);
    w_t* out = static_cast<w_t*>(a.y) + m * a.N + n0;
    for (int c = 0; c < cols; ++c) out[c] = static_cast<w_t>(a.b != nullptr ? v[c] + a.b[n0 + c] : v[c]);
  }
};

// Wide register blocks up to two rows: bf16 panel steps need registers of their own.
constexpr int kWideRows = 2;

#if SPECDEC_X86_CLONES
// bf16 weights and activations on a CPU with AVX-512-BF16 (AMD Zen 4, Intel Cooper Lake and later):
// VDPBF16PS multiplies bf16 pairs and adds both products into one fp32 lane, twice the multiply-adds per
// instruction of the fp32 FMAs above and no widening. It takes two k steps at a time, so a panel's steps
// k and k + 1 (contiguous in the packed layout) are interleaved into (W[n, k], W[n, k + 1]) pairs with
// one permute, lane i holding column 16 p + i, and each row of x is broadcast as its (x[k], x[k + 1])
// pair. Batch invariance holds as above, per pair of k: every row's lane takes the same instruction
// sequence whatever the blocking, so a row computed alone equals it computed in a batch, bit for bit.
// (The sums round differently from the fp32 path's, which this CPU then no longer uses for bf16.)
#define SPECDEC_TARGET_AVX512BF16 \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,f16c")))

namespace bf16dot {

constexpr int kMaxRows = 8;  // rows per register block: 8 x 2 panels of accumulators, 2 weight registers

struct Args {
  const uint16_t* x;  // [M, ldx] bf16 bits, ldx even (a zero past K when K is odd)
  int64_t ldx;
  const uint16_t* w;  // [P, K, 16] packed bf16 bits (the interleaved column order above)
  const float* b;     // [N] or null
  at::BFloat16* y;    // [M, N]
  int64_t M, N, K;
};

// Half-word indices turning packed steps k (halves 0-15) and k + 1 (halves 16-31) into lane pairs in column
// order: column c sits at half 2c (c < 8) or 2(c - 8) + 1 of a step.
SPECDEC_TARGET_AVX512BF16 inline __m512i pair_index() {
  alignas(64) int16_t idx[32];
  for (int c = 0; c < kPanel; ++c) {
    const int s = c < 8 ? 2 * c : 2 * (c - 8) + 1;
    idx[2 * c] = static_cast<int16_t>(s);
    idx[2 * c + 1] = static_cast<int16_t>(kPanel + s);
  }
  return _mm512_load_si512(idx);
}

template <int MR, int NP>
SPECDEC_TARGET_AVX512BF16 SPECDEC_INLINE void micro(const Args& a, __m512i idx, int64_t m0, int64_t p0) {
  __m512 acc[MR][NP];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_setzero_ps();
  const int64_t K = a.K, pairs = (K + 1) / 2;
  const uint16_t* w = a.w + p0 * K * kPanel;
  const uint16_t* x = a.x + m0 * a.ldx;
  for (int64_t kp = 0; kp < pairs; ++kp) {
    __m512i wv[NP];
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) {
      const uint16_t* step = w + (p * K + 2 * kp) * kPanel;
      _mm_prefetch(reinterpret_cast<const char*>(step) + kPrefetchBytes, _MM_HINT_T0);
      const __m512i v = 2 * kp + 1 < K  // steps k and k + 1; past an odd K, step k and zeros
                            ? _mm512_loadu_si512(step)
                            : _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(step)));
      wv[p] = _mm512_permutexvar_epi16(idx, v);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * a.ldx + 2 * kp, sizeof(pair));
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_dpbf16_ps(acc[m][p], (__m512bh)wv[p], xb);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) {
      alignas(64) float v[kPanel];
      _mm512_store_ps(v, acc[m][p]);
      const int64_t n0 = (p0 + p) * kPanel, cols = std::min<int64_t>(kPanel, a.N - n0);
      at::BFloat16* out = a.y + (m0 + m) * a.N + n0;
      for (int c = 0; c < cols; ++c) out[c] = static_cast<at::BFloat16>(a.b != nullptr ? v[c] + a.b[n0 + c] : v[c]);
    }
}

// Rows in near-equal blocks of at most MAXR against NP panels at p.
template <int NP, int MAXR>
SPECDEC_TARGET_AVX512BF16 SPECDEC_INLINE void rows(const Args& a, __m512i idx, int64_t p) {
  const int64_t blocks = (a.M + MAXR - 1) / MAXR;
  int64_t m = 0;
  for (int64_t i = 0; i < blocks; ++i) {
    const int r = static_cast<int>(a.M / blocks + (i < a.M % blocks));
    switch (r) {
      case 1: micro<1, NP>(a, idx, m, p); break;
      case 2: micro<2, NP>(a, idx, m, p); break;
      case 3: micro<3, NP>(a, idx, m, p); break;
      case 4: micro<4, NP>(a, idx, m, p); break;
      default:
        if constexpr (MAXR > 4) {
          switch (r) {
            case 5: micro<5, NP>(a, idx, m, p); break;
            case 6: micro<6, NP>(a, idx, m, p); break;
            case 7: micro<7, NP>(a, idx, m, p); break;
            default: micro<8, NP>(a, idx, m, p); break;
          }
        } else {
          TORCH_INTERNAL_ASSERT(false, "packed_linear: a block of ", r, " rows over ", MAXR);
        }
    }
    m += r;
  }
}

// Panels per register block: 4 up to 4 rows (more weight loads in flight where the product is near the
// memory bound), else 2 with row blocks of up to kMaxRows.
inline int64_t panels_per_block(int64_t M) { return M <= 4 ? 4 : 2; }

SPECDEC_TARGET_AVX512BF16 void run(const Args& a, int64_t p_begin, int64_t p_end) {
  const __m512i idx = pair_index();
  const int64_t np = panels_per_block(a.M);
  int64_t p = p_begin;
  for (; p + np <= p_end; p += np) {
    if (np == 4) rows<4, 4>(a, idx, p);
    else rows<2, kMaxRows>(a, idx, p);
  }
  for (; p < p_end; ++p) rows<1, kMaxRows>(a, idx, p);
}

// Whether this CPU has AVX-512-BF16, unless SPECDEC_BF16_DOT=0 keeps bf16 on the fp32 path (an A/B switch).
bool available() {
  static const bool ok = [] {
    __builtin_cpu_init();
    const char* env = std::getenv("SPECDEC_BF16_DOT");
    return simd::best_isa() == simd::Isa::kAvx512 && __builtin_cpu_supports("avx512bf16") &&
           !(env != nullptr && std::string(env) == "0");
  }();
  return ok;
}

at::Tensor linear(const at::Tensor& xc, const at::Tensor& w, const at::Tensor& b, int64_t n, at::Tensor y) {
  const int64_t M = xc.size(0), K = xc.size(1), P = w.size(0);
  const uint16_t* x = reinterpret_cast<const uint16_t*>(xc.const_data_ptr());
  int64_t ldx = K;
  thread_local std::vector<uint16_t> padded;
  if (K % 2) {  // rows of x as whole (x[k], x[k + 1]) pairs: a zero after each row's last value
    ldx = K + 1;
    padded.assign(static_cast<size_t>(M * ldx), 0);
    for (int64_t m = 0; m < M; ++m) std::memcpy(padded.data() + m * ldx, x + m * K, K * sizeof(uint16_t));
    x = padded.data();
  }
  const Args a{x, ldx, reinterpret_cast<const uint16_t*>(w.const_data_ptr()),
               b.defined() ? b.const_data_ptr<float>() : nullptr,
               reinterpret_cast<at::BFloat16*>(y.mutable_data_ptr()), M, n, K};
  const int64_t unit = panels_per_block(M), units = (P + unit - 1) / unit;
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(unit * kPanel * K, 1));
  at::parallel_for(0, units, grain, [&](int64_t begin, int64_t end) { run(a, begin * unit, std::min(end * unit, P)); });
  return y;
}

}  // namespace bf16dot
#endif

template <typename w_t>
SPECDEC_INLINE void run_impl(const Args& a, int64_t p_begin, int64_t p_end) {
  panel::gemm<kWideRows>(PackedOp<w_t>{a}, a.x, a.K, a.M, a.K, p_begin, p_end);
}

template <typename w_t>
SPECDEC_TARGET_AVX512 void run_avx512(const Args& a, int64_t begin, int64_t end) {
  run_impl<w_t>(a, begin, end);
}
template <typename w_t>
SPECDEC_TARGET_AVX2 void run_avx2(const Args& a, int64_t begin, int64_t end) {
  run_impl<w_t>(a, begin, end);
}
template <typename w_t>
void run_base(const Args& a, int64_t begin, int64_t end) {
  run_impl<w_t>(a, begin, end);
}

at::Tensor packed_linear_cpu(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                             const std::optional<at::Tensor>& bias) {
  const auto dtype = linear::check_dtypes("packed_linear", x, packed);
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel,
              "packed_linear: packed weight must be [ceil(N / 16), K, 16], got shape ", packed.sizes());
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "packed_linear: x has K = ", K, " columns but the packed weight is ",
              packed.sizes());
  TORCH_CHECK(n >= 0 && (n + kPanel - 1) / kPanel == P, "packed_linear: N = ", n, " does not fit ", P,
              " panels of 16 columns");
  const at::Tensor b = linear::bias_fp32("packed_linear", bias, n, dtype);
  auto y = at::empty({M, n}, x.options());
  if (M == 0 || n == 0) return y;
  const auto xc = x.contiguous();
  const auto w = packed.contiguous();
#if SPECDEC_X86_CLONES
  if (dtype == at::kBFloat16 && bf16dot::available()) return bf16dot::linear(xc, w, b, n, y);
#endif
  const float* xf = linear::rows_fp32(xc);
  Args a{xf, w.const_data_ptr(), b.defined() ? b.const_data_ptr<float>() : nullptr, y.mutable_data_ptr(), M, n, K};
  linear::dispatch_weight_dtype(dtype, [&](auto tag) {
    using scalar_t = decltype(tag);
    using Fn = void (*)(const Args&, int64_t, int64_t);
    const Fn fn = simd::pick<Fn>(run_avx512<scalar_t>, run_avx2<scalar_t>, run_base<scalar_t>);
    // Work units are register blocks of panels; a task gets at least ~64K weight elements (below
    // that, waking the pool costs more than the work).
    const int64_t unit = panel::panels_per_block<kWideRows>(M);
    const int64_t units = (P + unit - 1) / unit;
    const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(unit * kPanel * K, 1));
    at::parallel_for(0, units, grain, [&](int64_t begin, int64_t end) {
      fn(a, begin * unit, std::min(end * unit, P));
    });
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("packed_linear", &packed_linear_cpu);
}

}  // namespace specdec
