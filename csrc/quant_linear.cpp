// CPU kernels of specdec::quant_linear and specdec::quant_dequantize: y = x . W^T + b where W is kept
// as the affine codes of a GGUF file (specdec/gguf_blocks.py), W[n, k] = code[n, k] * scale[n, g] + min[n, g]
// with g = k / G, repacked once at load (specdec.kernels.pack_quant_weight) into column panels:
//
//   packed[p, g, :] = one chunk of `chunk` bytes for columns 16 p .. 16 p + 15 and k in [G g, G g + G):
//     scale[16]  fp16 (f16_scale) or fp32
//     min[16]    the same type, only with has_min
//     codes      bits == 8: G steps of 16 int8, step j holding code[16 p + c, G g + j] at byte c;
//                bits == 4: G / 2 steps of 16 bytes, byte c of step j holding code[16 p + c, G g + 2 j] in its
//                low nibble and code[16 p + c, G g + 2 j + 1] in its high nibble (codes 0..15)
//   (columns past N have zero scales, mins and codes)
//
// Why: a one-row decode step is bound by the bytes of weights it reads. The GGUF's blocks are 4.5-8.5 bits
// a weight where the dense bf16 copy is 16, so streaming the blocks as stored reads 2.8x fewer bytes for
// SmolLM2's Q4_1/Q8_0 file. The activations are never quantized: each weight is rebuilt in fp32 in
// registers, exactly the value transformers' dense fp32 model holds (code * scale is exact in fp32 for every
// block type with a min, so fma(code, scale, min) rounds as the reference's multiply-then-add), and
// multiplied into fp32 accumulators as in packed_linear.cpp.
//
// The inner loop is packed_linear's outer product: one step widens 16 codes of each of NP panels to fp32
// weights and broadcasts one x value per row into MR x NP accumulators.
//
// Batch invariance: every output element is one fp32 accumulator, updated once per k in order
// k = 0 .. K-1 with the same multiply-add of the same rebuilt weight, then the bias, then one rounding to
// the output dtype; row blocking never changes that sequence, so row m of a T-row verification equals,
// bit for bit, the same row computed alone (one-token decoding).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "linear_common.h"
#include "simd.h"

namespace specdec {
namespace {

constexpr int kPanel = 16;
// Distance ahead of the chunk being decoded at which the weight stream is prefetched (as packed_linear).
constexpr int64_t kPrefetchBytes = 4096;

struct Args {
  const float* x;      // [M, K] fp32 (widened once per call)
  const uint8_t* w;    // [P, groups, chunk]
  const float* b;      // [N] fp32 or null
  float* y;            // [M, N] fp32 sums plus bias (rounded to the output dtype after, where it is not fp32)
  int64_t M, N, K, groups, chunk;
  int group;
};

template <int L>
struct Vec {
  typedef float f __attribute__((vector_size(4 * L)));
  typedef int32_t i __attribute__((vector_size(4 * L)));
  typedef uint8_t u8 __attribute__((vector_size(L)));
  typedef int8_t s8 __attribute__((vector_size(L)));
};

template <int L>
SPECDEC_INLINE typename Vec<L>::f broadcast(const float* p) {
  const typename Vec<L>::f t = {*p};
  if constexpr (L == 16) return __builtin_shufflevector(t, t, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  else return __builtin_shufflevector(t, t, 0, 0, 0, 0, 0, 0, 0, 0);
}

template <int L, bool F16>
SPECDEC_INLINE typename Vec<L>::f load_scale(const uint8_t* p) {
  if constexpr (F16) {
    return simd::load_f16_n<L>(reinterpret_cast<const uint16_t*>(p));
  } else {
    typename Vec<L>::f v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  }
}

// The weight of one affine code vector: code * scale (+ min).
template <int L, bool MIN>
SPECDEC_INLINE typename Vec<L>::f weight(typename Vec<L>::i code, typename Vec<L>::f sc, typename Vec<L>::f mn) {
  const auto c = __builtin_convertvector(code, typename Vec<L>::f);
  if constexpr (MIN) return c * sc + mn;
  else return c * sc;
}

SPECDEC_INLINE void store_row(const Args& a, int64_t m, int64_t p, const float* v) {
  const int64_t n0 = p * kPanel, cols = std::min<int64_t>(kPanel, a.N - n0);
  float* out = a.y + m * a.N + n0;
  for (int c = 0; c < cols; ++c) out[c] = a.b != nullptr ? v[c] + a.b[n0 + c] : v[c];
}

// Rows [m0, m0 + MR) against panels [p0, p0 + NP), L lanes a vector (16 / L vectors a panel).
template <int L, int BITS, bool F16, bool MIN, int MR, int NP>
SPECDEC_INLINE void micro(const Args& a, int64_t m0, int64_t p0) {
  using VF = typename Vec<L>::f;
  using VI = typename Vec<L>::i;
  constexpr int H = kPanel / L;
  constexpr int SB = F16 ? 2 : 4;
  constexpr int kCodes = kPanel * SB * (MIN ? 2 : 1);  // byte offset of the codes in a chunk
  VF acc[MR][NP][H] = {};
  const float* xr = a.x + m0 * a.K;
  const int G = a.group;
  for (int64_t g = 0; g < a.groups; ++g) {
    VF sc[NP][H], mn[NP][H];
    const uint8_t* q[NP];
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) {
      const uint8_t* c = a.w + ((p0 + p) * a.groups + g) * a.chunk;
      __builtin_prefetch(c + kPrefetchBytes);
#pragma GCC unroll 2
      for (int h = 0; h < H; ++h) {
        sc[p][h] = load_scale<L, F16>(c + h * L * SB);
        mn[p][h] = MIN ? load_scale<L, F16>(c + kPanel * SB + h * L * SB) : VF{};
      }
      q[p] = c + kCodes;
    }
    const float* xk = xr + g * G;
    if constexpr (BITS == 4) {
      for (int j = 0; j < G / 2; ++j) {
#pragma GCC unroll 4
        for (int p = 0; p < NP; ++p)
#pragma GCC unroll 2
          for (int h = 0; h < H; ++h) {
            typename Vec<L>::u8 bytes;
            std::memcpy(&bytes, q[p] + j * kPanel + h * L, L);
            const VI iv = __builtin_convertvector(bytes, VI);
            const VF w0 = weight<L, MIN>(iv & 15, sc[p][h], mn[p][h]);
            const VF w1 = weight<L, MIN>(iv >> 4, sc[p][h], mn[p][h]);
#pragma GCC unroll 8
            for (int m = 0; m < MR; ++m) {
              acc[m][p][h] += broadcast<L>(xk + m * a.K + 2 * j) * w0;
              acc[m][p][h] += broadcast<L>(xk + m * a.K + 2 * j + 1) * w1;
            }
          }
      }
    } else {
      for (int j = 0; j < G; ++j) {
#pragma GCC unroll 4
        for (int p = 0; p < NP; ++p)
#pragma GCC unroll 2
          for (int h = 0; h < H; ++h) {
            typename Vec<L>::s8 bytes;
            std::memcpy(&bytes, q[p] + j * kPanel + h * L, L);
            const VF w = weight<L, MIN>(__builtin_convertvector(bytes, VI), sc[p][h], mn[p][h]);
#pragma GCC unroll 8
            for (int m = 0; m < MR; ++m) acc[m][p][h] += broadcast<L>(xk + m * a.K + j) * w;
          }
      }
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) {
      float v[kPanel];
#pragma GCC unroll 2
      for (int h = 0; h < H; ++h) {
        const VF t = acc[m][p][h];  // a copy: taking the accumulators' address would keep them in memory
        std::memcpy(v + h * L, &t, sizeof(t));
      }
      store_row(a, m0 + m, p0 + p, v);
    }
}

// All rows, in near-equal blocks of at most MAXR, against NP panels at p (one at a time past p_end).
template <int L, int BITS, bool F16, bool MIN, int NP, int MAXR>
SPECDEC_INLINE void rows(const Args& a, int64_t p, int64_t p_end) {
  if constexpr (NP > 1) {
    if (p + NP > p_end) {
      for (; p < p_end; ++p) rows<L, BITS, F16, MIN, 1, MAXR>(a, p, p_end);
      return;
    }
  }
  const int64_t blocks = (a.M + MAXR - 1) / MAXR;
  int64_t m = 0;
  for (int64_t i = 0; i < blocks; ++i) {
    const int r = static_cast<int>(a.M / blocks + (i < a.M % blocks));
#define SPECDEC_QROWS(R) \
  case R: \
    if constexpr (R <= MAXR) micro<L, BITS, F16, MIN, R, NP>(a, m, p); \
    break;
    switch (r) {
      SPECDEC_QROWS(1)
      SPECDEC_QROWS(2)
      SPECDEC_QROWS(3)
      SPECDEC_QROWS(4)
      SPECDEC_QROWS(5)
      SPECDEC_QROWS(6)
      SPECDEC_QROWS(7)
      SPECDEC_QROWS(8)
      default: TORCH_INTERNAL_ASSERT(false, "quant_linear: a block of ", r, " rows");
    }
#undef SPECDEC_QROWS
    m += r;
  }
}

// Panels per register block and rows per block, by lane width: 16 lanes (AVX-512, 32 registers) keep 4
// panels at one row and 2 panels of up to 8 rows; 8 lanes (AVX2, 16 registers) 2 panels at one row and one
// panel of up to 3 rows (each panel is two registers of weights, scales and mins there).
template <int L>
inline int64_t panels_per_unit(int64_t M) {
  if constexpr (L == 16) return M == 1 ? 4 : 2;
  else return M == 1 ? 2 : 1;
}

template <int L, int BITS, bool F16, bool MIN>
SPECDEC_INLINE void run_impl(const Args& a, int64_t p_begin, int64_t p_end) {
  const int64_t np = panels_per_unit<L>(a.M);
  for (int64_t p = p_begin; p < p_end; p += np) {
    if constexpr (L == 16) {
      if (np == 4) rows<L, BITS, F16, MIN, 4, 1>(a, p, p_end);
      else rows<L, BITS, F16, MIN, 2, 8>(a, p, p_end);
    } else {
      if (np == 2) rows<L, BITS, F16, MIN, 2, 1>(a, p, p_end);
      else rows<L, BITS, F16, MIN, 1, 3>(a, p, p_end);
    }
  }
}

template <int BITS, bool F16, bool MIN>
SPECDEC_TARGET_AVX512 void run_avx512(const Args& a, int64_t b, int64_t e) { run_impl<16, BITS, F16, MIN>(a, b, e); }
template <int BITS, bool F16, bool MIN>
SPECDEC_TARGET_AVX2 void run_avx2(const Args& a, int64_t b, int64_t e) { run_impl<8, BITS, F16, MIN>(a, b, e); }
template <int BITS, bool F16, bool MIN>
void run_base(const Args& a, int64_t b, int64_t e) { run_impl<8, BITS, F16, MIN>(a, b, e); }

using RunFn = void (*)(const Args&, int64_t, int64_t);

template <int BITS, bool F16, bool MIN>
RunFn pick_fn() {
  return simd::pick<RunFn>(run_avx512<BITS, F16, MIN>, run_avx2<BITS, F16, MIN>,
                           run_base<BITS, F16, MIN>);
}

// 4-bit codes always come with a min (Q4_0, Q4_1, Q4_K): a zero min is stored for a format without one.
RunFn pick_format(int64_t bits, bool f16, bool has_min) {
  if (bits == 4) return f16 ? pick_fn<4, true, true>() : pick_fn<4, false, true>();
  if (f16) return has_min ? pick_fn<8, true, true>() : pick_fn<8, true, false>();
  return has_min ? pick_fn<8, false, true>() : pick_fn<8, false, false>();
}

int64_t chunk_bytes(int64_t bits, int64_t group, bool has_min, bool f16) {
  return kPanel * (f16 ? 2 : 4) * (has_min ? 2 : 1) + kPanel * group * bits / 8;
}

void check_format(const char* op, const at::Tensor& packed, int64_t n, int64_t k, int64_t bits, int64_t group,
                  bool has_min, bool f16) {
  TORCH_CHECK(packed.device().is_cpu(), op, ": packed must be on the CPU");
  TORCH_CHECK(packed.scalar_type() == at::kByte, op, ": packed must be uint8, got ", packed.scalar_type());
  TORCH_CHECK(bits == 4 || bits == 8, op, ": bits must be 4 or 8, got ", bits);
  TORCH_CHECK(bits == 8 || has_min, op, ": 4-bit codes are stored with a min (zeros where the format has none)");
  TORCH_CHECK(group == 16 || group == 32, op, ": group must be 16 or 32, got ", group);
  TORCH_CHECK(n >= 0 && k >= 0 && k % group == 0, op, ": K = ", k, " must be a multiple of the group ", group);
  const int64_t P = (n + kPanel - 1) / kPanel;
  TORCH_CHECK(packed.dim() == 3 && packed.size(0) == P && packed.size(1) == k / group &&
                  packed.size(2) == chunk_bytes(bits, group, has_min, f16),
              op, ": packed must be [ceil(N / 16), K / group, ", chunk_bytes(bits, group, has_min, f16),
              "] for N = ", n, ", K = ", k, ", got ", packed.sizes());
}

at::Tensor quant_linear_cpu(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t k, int64_t bits,
                            int64_t group, bool has_min, bool f16_scale, const std::optional<at::Tensor>& bias) {
  check_format("quant_linear", packed, n, k, bits, group, has_min, f16_scale);
  TORCH_CHECK(x.device().is_cpu(), "quant_linear: x must be on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "quant_linear: x must be [M, K = ", k, "], got ", x.sizes());
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "quant_linear: x must be fp32, bf16 or fp16, got ", dtype);
  const at::Tensor b = linear::bias_fp32("quant_linear", bias, n, dtype);
  auto y = at::empty({x.size(0), n}, x.options());
  const int64_t M = x.size(0), P = packed.size(0);
  if (M == 0 || n == 0) return y;
  if (k == 0) return b.defined() ? y.copy_(b.expand({M, n})) : y.zero_();
  const auto xc = x.contiguous();
  const auto w = packed.contiguous();
  // fp32 sums go straight to y; for a half-precision y into a per-thread buffer, rounded once after.
  thread_local std::vector<float> sums;
  float* y32 = nullptr;
  if (dtype == at::kFloat) {
    y32 = y.mutable_data_ptr<float>();
  } else {
    sums.resize(static_cast<size_t>(M * n));
    y32 = sums.data();
  }
  const Args a{linear::rows_fp32(xc), w.const_data_ptr<uint8_t>(), b.defined() ? b.const_data_ptr<float>() : nullptr,
               y32, M, n, k, k / group, w.size(2), static_cast<int>(group)};
  const RunFn fn = pick_format(bits, f16_scale, has_min);
  const int64_t unit = simd::best_isa() == simd::Isa::kAvx512 ? panels_per_unit<16>(M) : panels_per_unit<8>(M);
  const int64_t units = (P + unit - 1) / unit;
  // A task gets at least ~64K weights (below that, waking the pool costs more than the work).
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(unit * kPanel * k, 1));
  at::parallel_for(0, units, grain, [&](int64_t begin, int64_t end) { fn(a, begin * unit, std::min(end * unit, P)); });
  if (dtype == at::kBFloat16) {
    auto* out = y.mutable_data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < M * n; ++i) out[i] = static_cast<at::BFloat16>(y32[i]);
  } else if (dtype == at::kHalf) {
    auto* out = y.mutable_data_ptr<at::Half>();
    for (int64_t i = 0; i < M * n; ++i) out[i] = static_cast<at::Half>(y32[i]);
  }
  return y;
}

float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

at::Tensor quant_dequantize_cpu(const at::Tensor& packed, int64_t n, int64_t k, int64_t bits, int64_t group,
                                bool has_min, bool f16_scale) {
  check_format("quant_dequantize", packed, n, k, bits, group, has_min, f16_scale);
  auto out = at::empty({n, k}, packed.options().dtype(at::kFloat));
  const auto w = packed.contiguous();
  const uint8_t* base = w.const_data_ptr<uint8_t>();
  float* o = out.mutable_data_ptr<float>();
  const int64_t groups = k / group, chunk = w.size(2), P = w.size(0), sb = f16_scale ? 2 : 4;
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* c = base + (p * groups + g) * chunk;
        const uint8_t* codes = c + kPanel * sb * (has_min ? 2 : 1);
        for (int col = 0; col < kPanel && p * kPanel + col < n; ++col) {
          float sc, mn = 0.0f;
          if (f16_scale) sc = half_at(c + 2 * col);
          else std::memcpy(&sc, c + 4 * col, 4);
          if (has_min) {
            if (f16_scale) mn = half_at(c + kPanel * 2 + 2 * col);
            else std::memcpy(&mn, c + kPanel * 4 + 4 * col, 4);
          }
          float* row = o + (p * kPanel + col) * k + g * group;
          for (int64_t j = 0; j < group; ++j) {
            const int code = bits == 8 ? static_cast<int8_t>(codes[j * kPanel + col])
                                       : (codes[(j / 2) * kPanel + col] >> (4 * (j % 2))) & 15;
            const float v = static_cast<float>(code) * sc;
            row[j] = has_min ? v + mn : v;
          }
        }
      }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("quant_linear", &quant_linear_cpu);
  m.impl("quant_dequantize", &quant_dequantize_cpu);
}

}  // namespace specdec
