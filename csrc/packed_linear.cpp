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
#include <cstring>
#include <optional>

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
  const float* xf = linear::rows_fp32(xc);
  const auto w = packed.contiguous();
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
