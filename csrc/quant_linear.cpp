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
// SmolLM2's Q4_1/Q8_0 file. The activations are never quantized: the codes are widened to fp32 in registers
// and every product is an fp32 multiply-add, as in packed_linear.cpp.
//
// The math, per output element and group g of G weights: dot = sum_j x_j * code_j (in order j = 0 .. G-1),
// then acc += scale * dot, then acc += min * xs_g, where xs_g = sum_j x_j is computed once per call. That is
// sum_j x_j * (code_j * scale + min), the dense product up to summation order (fp32 throughout), with two
// multiply-adds a group for the affine part instead of one a weight.
//
// The inner loop is packed_linear's outer product: one step widens 16 codes of each of NP panels to fp32 and
// broadcasts one x value per row into MR x NP accumulators.
//
// Batch invariance: every output element's sequence of fp32 operations (the group dots, the two multiply-adds
// per group, groups in order, then the bias, then one rounding to the output dtype) depends on its row alone;
// row blocking never changes it, so row m of a T-row verification equals, bit for bit, the same row computed
// alone (one-token decoding). The one exception is opt-in: bf16 calls of at least `tile_rows` rows (an argument,
// 0 = never) run on AMX tiles where the CPU has them (isa_amx below), whose sums round differently.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <vector>

#include "linear_common.h"
#include "simd.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace specdec {
namespace {

constexpr int kPanel = 16;

struct Args {
  const float* x;      // [M, K] fp32 (widened once per call)
  const uint16_t* xb;  // [M, K] bf16 as given, for the AMX kernel (null where x is not bf16)
  const float* xs;     // [M, K / group] fp32: each group's sum of x, summed in order
  const uint8_t* w;    // [P, groups, chunk]
  const float* b;      // [N] fp32 or null
  void* y;             // [M, N] output in `out` dtype: the fp32 sums plus bias, rounded once where it is not fp32
  at::ScalarType out;  // fp32, bf16 or fp16
  int64_t ldy;         // y's row stride (a product of a group writes its columns of the group's one output)
  int64_t M, N, K, groups, chunk;
  int group;
};

template <typename T>
SPECDEC_INLINE void store_as(const Args& a, int64_t m, int64_t n0, int64_t cols, const float* v) {
  T* out = static_cast<T*>(a.y) + m * a.ldy + n0;
  for (int c = 0; c < cols; ++c) out[c] = static_cast<T>(a.b != nullptr ? v[c] + a.b[n0 + c] : v[c]);
}

// One panel's 16 sums of row m, plus bias, rounded once to the output dtype: by the thread that computed them (a
// serial pass over every output after the parallel one cost ~0.2 ms a SmolLM2 step at one row).
SPECDEC_INLINE void store_row(const Args& a, int64_t m, int64_t p, const float* v) {
  const int64_t n0 = p * kPanel, cols = std::min<int64_t>(kPanel, a.N - n0);
  if (a.out == at::kFloat) store_as<float>(a, m, n0, cols, v);
  else if (a.out == at::kBFloat16) store_as<at::BFloat16>(a, m, n0, cols, v);
  else store_as<at::Half>(a, m, n0, cols, v);
}

// Vector operations per instruction set, for csrc/quant_linear_body.h. Each block is compiled for its ISA.
using RunFn = void (*)(const Args&, int64_t, int64_t);

#if SPECDEC_X86_CLONES
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")
namespace isa_avx512 {
struct Ops {
  static constexpr int L = 16;
  using V = __m512;
  static SPECDEC_INLINE V zero() { return _mm512_setzero_ps(); }
  static SPECDEC_INLINE V bcast(const float* p) { return _mm512_set1_ps(*p); }
  static SPECDEC_INLINE V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static SPECDEC_INLINE V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  template <bool F16>
  static SPECDEC_INLINE V scale(const uint8_t* p) {
    if constexpr (F16) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    else return _mm512_loadu_ps(p);
  }
  // L bytes -> fp32 codes: 4 bits, the low halves of the bytes (c[0]) and the high halves (c[1]); 8 bits, the
  // int8s (c[0]).
  template <int BITS>
  static SPECDEC_INLINE void codes(const uint8_t* p, V* c) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (BITS == 4) {
      // The table lookup reads only the low 4 bits of each lane: one permute where a mask and a conversion were,
      // 6 vector operations per 32 codes instead of 7 (the loop is bound by them at one row), the same fp32 values.
      // Eight 1536x576 Q4_1 weights (4.4 MB), one row, one thread, Xeon AVX-512-BF16: 0.32 -> 0.29 ms.
      const __m512 lut = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      const __m512i b = _mm512_cvtepu8_epi32(raw);
      c[0] = _mm512_permutexvar_ps(b, lut);
      c[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), lut);
    } else {
      c[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
    }
  }
  static SPECDEC_INLINE void store(float* p, V v) { _mm512_storeu_ps(p, v); }
};
#include "quant_linear_body.h"
}  // namespace isa_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c,amx-tile,amx-bf16")
// AMX-BF16 (Sapphire Rapids and later Xeons), for bf16 products of at least `tile_rows` rows: the codes are small
// integers (0..15, or int8), exact in bf16, so every product x_j * code_j is exact in fp32, and the tile unit sums
// a group's products in fp32 (in its own order, not the vector kernel's); the group's scale and min are then
// applied in fp32 as above. One TDPBF16PS does a group of 16 columns for up to 16 rows, so a weight's cost barely
// grows with the rows, where the vector kernel pays 2 multiply-adds a weight a row. At one row it loses: each
// group's codes go through L1 as a 1 KB bf16 tile, and the tile loads do not overlap the decoding. All 211
// weights of SmolLM2-135M, 2 threads, Xeon with AMX, ms, vector / tiles: 6.5 / 9.9 at one row, 8.7 / 11.0 at 4,
// 14.2 / 12.2 at 8, 25.0 / 15.7 at 16, 47.3 / 24.2 at 32 (bench/results/quant_tiles_amx.json). Rows of a tile call
// depend on their own activations alone (batch-invariant among calls of at least tile_rows rows), but not bit for
// bit equal to the vector kernel's: a caller that needs one-token steps and verifications to agree passes 0.
// TDPBF16PS reads bf16 subnormal inputs as zero and flushes subnormal sums to zero.
namespace isa_amx {

struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-2 and 3-5: activations [mt, G] bf16, codes [G / 2, 16 pairs] bf16 and sums [mt, 16] fp32 of two
// groups in flight.
SPECDEC_INLINE void configure(int mt, int G) {
  TileConfig c{};
  c.palette = 1;
  for (int s = 0; s < 2; ++s) {
    c.rows[3 * s] = static_cast<uint8_t>(mt);
    c.colsb[3 * s] = static_cast<uint16_t>(2 * G);
    c.rows[3 * s + 1] = static_cast<uint8_t>(G / 2);
    c.colsb[3 * s + 1] = 64;
    c.rows[3 * s + 2] = static_cast<uint8_t>(mt);
    c.colsb[3 * s + 2] = 64;
  }
  asm volatile("" ::"r"(&c) : "memory");  // GCC 12's _tile_loadconfig names 8 of the config's 64 bytes as read
  _tile_loadconfig(&c);
}

// One 64-byte row of a codes tile: column c's codes k = 2 r and 2 r + 1 as a bf16 pair in dword c.
template <int BITS>
SPECDEC_INLINE void decode_row(const uint8_t* codes, int r, uint8_t* out) {
  __m512i v;
  if constexpr (BITS == 4) {
    // Step r holds both codes of column c in byte c (low nibble k = 2 r): spread to dword c as
    // low | high << 16, then look each 4-bit value up as bf16.
    const __m512i lut = _mm512_setr_epi32(0x3f800000, 0x40404000, 0x40a04080, 0x40e040c0, 0x41104100,
                                          0x41304120, 0x41504140, 0x41704160, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * r)));
    const __m512i t = _mm512_ternarylogic_epi32(d, _mm512_slli_epi32(d, 12), _mm512_set1_epi32(0x000f000f), 0xa8);
    v = _mm512_permutexvar_epi16(t, lut);
  } else {
    // Steps 2 r and 2 r + 1 hold column c's codes in byte c: int8 -> fp32 (exact), whose top half is the bf16.
    const __m512i a = _mm512_castps_si512(_mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 32 * r)))));
    const __m512i b = _mm512_castps_si512(_mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 32 * r + 16)))));
    v = _mm512_ternarylogic_epi32(_mm512_srli_epi32(a, 16), b, _mm512_set1_epi32(static_cast<int>(0xffff0000u)),
                                  0xd8);
  }
  _mm512_store_si512(reinterpret_cast<__m512i*>(out + 64 * r), v);
}

// Panels one at a time, software-pipelined: while the tile unit sums panel p's groups, the vector units decode
// panel p + 1's codes into the other half of a double buffer (each group's codes tile is decoded once, whatever
// the rows).
template <int BITS, bool F16, bool MIN>
void run(const Args& a, int64_t p_begin, int64_t p_end) {
  constexpr int SB = F16 ? 2 : 4;
  constexpr int kCodes = kPanel * SB * (MIN ? 2 : 1);
  const int G = a.group, R = G / 2;  // R: rows of a codes tile
  const int64_t groups = a.groups, panel_bytes = groups * R * 64;
  thread_local std::vector<uint8_t> storage;
  storage.resize(static_cast<size_t>(2 * panel_bytes + 64));
  uint8_t* const buf0 = storage.data() + ((64 - reinterpret_cast<uintptr_t>(storage.data()) % 64) % 64);
  alignas(64) float sums[2][16 * 16];
  auto decode = [&](int64_t p, int64_t g, uint8_t* buf) {
    const uint8_t* codes = a.w + (p * groups + g) * a.chunk + kCodes;
    for (int r = 0; r < R; ++r) decode_row<BITS>(codes, r, buf + g * R * 64);
  };
  for (int64_t g = 0; g < groups; ++g) decode(p_begin, g, buf0);
  int configured = 0;
  for (int64_t p = p_begin; p < p_end; ++p) {
    uint8_t* const cur = buf0 + ((p - p_begin) & 1) * panel_bytes;
    uint8_t* const next = buf0 + ((p - p_begin + 1) & 1) * panel_bytes;
    const bool ahead = p + 1 < p_end;
    asm volatile("" ::: "memory");  // the tile loads read cur (GCC's tileloadd has no memory operand)
    const uint8_t* chunk0 = a.w + p * groups * a.chunk;
    for (int64_t m0 = 0; m0 < a.M; m0 += 16) {
      const int mt = static_cast<int>(std::min<int64_t>(16, a.M - m0));
      if (mt != configured) {
        configure(mt, G);
        configured = mt;
      }
      const bool decoding = ahead && m0 == 0;
      __m512 acc[16];
      for (int m = 0; m < mt; ++m) acc[m] = _mm512_setzero_ps();
      const uint16_t* x = a.xb + m0 * a.K;
      const long ldx = 2 * a.K;
      auto fold = [&](int64_t g, const float* s) {
        const uint8_t* c = chunk0 + g * a.chunk;
        const __m512 sc = F16 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c)))
                              : _mm512_loadu_ps(c);
        __m512 mn = _mm512_setzero_ps();
        if constexpr (MIN)
          mn = F16 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + kPanel * SB)))
                   : _mm512_loadu_ps(c + kPanel * SB);
        for (int m = 0; m < mt; ++m) {
          acc[m] = _mm512_fmadd_ps(_mm512_load_ps(s + 16 * m), sc, acc[m]);
          if constexpr (MIN) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(a.xs[(m0 + m) * groups + g]), mn, acc[m]);
        }
      };
      int64_t g = 0;
      for (; g + 2 <= groups; g += 2) {
        _tile_loadd(0, x + g * G, ldx);
        _tile_loadd(1, cur + g * R * 64, 64);
        _tile_zero(2);
        _tile_dpbf16ps(2, 0, 1);
        _tile_loadd(3, x + (g + 1) * G, ldx);
        _tile_loadd(4, cur + (g + 1) * R * 64, 64);
        _tile_zero(5);
        _tile_dpbf16ps(5, 3, 4);
        if (decoding) {
          decode(p + 1, g, next);
          decode(p + 1, g + 1, next);
        }
        _tile_stored(2, sums[0], 64);
        _tile_stored(5, sums[1], 64);
        fold(g, sums[0]);
        fold(g + 1, sums[1]);
      }
      if (g < groups) {
        _tile_loadd(0, x + g * G, ldx);
        _tile_loadd(1, cur + g * R * 64, 64);
        _tile_zero(2);
        _tile_dpbf16ps(2, 0, 1);
        if (decoding) decode(p + 1, g, next);
        _tile_stored(2, sums[0], 64);
        fold(g, sums[0]);
      }
      for (int m = 0; m < mt; ++m) {
        float v[kPanel];
        _mm512_storeu_ps(v, acc[m]);
        store_row(a, m0 + m, p, v);
      }
    }
  }
  if (configured) _tile_release();
}

inline RunFn pick(int64_t bits, bool f16, bool has_min) {
  if (bits == 4) return f16 ? run<4, true, true> : run<4, false, true>;
  if (f16) return has_min ? run<8, true, true> : run<8, true, false>;
  return has_min ? run<8, false, true> : run<8, false, false>;
}

}  // namespace isa_amx
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace isa_avx2 {
struct Ops {
  static constexpr int L = 8;
  using V = __m256;
  static SPECDEC_INLINE V zero() { return _mm256_setzero_ps(); }
  static SPECDEC_INLINE V bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static SPECDEC_INLINE V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static SPECDEC_INLINE V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  template <bool F16>
  static SPECDEC_INLINE V scale(const uint8_t* p) {
    if constexpr (F16) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    else return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  }
  template <int BITS>
  static SPECDEC_INLINE void codes(const uint8_t* p, V* c) {
    const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    if constexpr (BITS == 4) {
      const __m256i b = _mm256_cvtepu8_epi32(raw);
      c[0] = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
      c[1] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
    } else {
      c[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
    }
  }
  static SPECDEC_INLINE void store(float* p, V v) { _mm256_storeu_ps(p, v); }
};
#include "quant_linear_body.h"
}  // namespace isa_avx2
#pragma GCC pop_options
#endif

// Any other CPU: GCC's generic vectors of 8 lanes (lowered to what the baseline ISA has).
namespace isa_base {
struct Ops {
  static constexpr int L = 8;
  typedef float V __attribute__((vector_size(32)));
  typedef int32_t Vi __attribute__((vector_size(32)));
  static SPECDEC_INLINE V zero() { return V{}; }
  static SPECDEC_INLINE V bcast(const float* p) { return V{} + *p; }
  static SPECDEC_INLINE V fma(V a, V b, V c) { return a * b + c; }
  static SPECDEC_INLINE V mul(V a, V b) { return a * b; }
  template <bool F16>
  static SPECDEC_INLINE V scale(const uint8_t* p) {
    if constexpr (F16) {
      return simd::load_f16_n<8>(reinterpret_cast<const uint16_t*>(p));
    } else {
      V v;
      std::memcpy(&v, p, sizeof(v));
      return v;
    }
  }
  template <int BITS>
  static SPECDEC_INLINE void codes(const uint8_t* p, V* c) {
    Vi b;
    for (int i = 0; i < 8; ++i) b[i] = BITS == 4 ? p[i] : static_cast<int8_t>(p[i]);
    if constexpr (BITS == 4) {
      c[0] = __builtin_convertvector(b & 15, V);
      c[1] = __builtin_convertvector(b >> 4, V);
    } else {
      c[0] = __builtin_convertvector(b, V);
    }
  }
  static SPECDEC_INLINE void store(float* p, V v) { std::memcpy(p, &v, sizeof(v)); }
};
#include "quant_linear_body.h"
}  // namespace isa_base

// Whether this CPU has AMX-BF16 tiles and Linux grants this process their state (asked once), and SPECDEC_AMX is
// not 0 (an A/B switch, read at each call).
bool amx_enabled() {
#if SPECDEC_X86_CLONES
  static const bool usable = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (simd::best_isa() != simd::Isa::kAvx512 || !__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    constexpr unsigned kAmxBf16 = 1u << 22, kAmxTile = 1u << 24;
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return (edx & kAmxBf16) && (edx & kAmxTile) && syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  if (!usable) return false;
  const char* env = std::getenv("SPECDEC_AMX");
  return !(env != nullptr && std::strcmp(env, "0") == 0);
#else
  return false;
#endif
}

RunFn pick_format(int64_t bits, bool f16, bool has_min) {
#if SPECDEC_X86_CLONES
  switch (simd::best_isa()) {
    case simd::Isa::kAvx512: return isa_avx512::pick(bits, f16, has_min);
    case simd::Isa::kAvx2: return isa_avx2::pick(bits, f16, has_min);
    default: break;
  }
#endif
  return isa_base::pick(bits, f16, has_min);
}

int64_t panels_per_unit(int64_t M) {
#if SPECDEC_X86_CLONES
  if (simd::best_isa() == simd::Isa::kAvx512) return isa_avx512::panels_per_unit(M);
#endif
  return isa_base::panels_per_unit(M);
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

// One weight of a call: its packed panels, its bias (contiguous fp32, or undefined) and its output [M, n] (rows of
// stride y.stride(0): a group's products write side by side into one output).
struct Product {
  at::Tensor w, b, y;
  int64_t n;
};

// y_i = x . W_i^T + b_i for weights of one format over one x [M, K]: x is widened and its group sums taken once,
// and one pass of the thread pool covers the panels of every weight. Each output element's operations are those
// of a call with its weight alone (the micro-kernel's order does not depend on which panels share a task), so a
// group's outputs equal the separate calls' bit for bit.
void run_products(const at::Tensor& x, std::vector<Product>& ps, int64_t k, int64_t bits, int64_t group,
                  bool has_min, bool f16_scale, int64_t tile_rows) {
  const int64_t M = x.size(0);
  if (M == 0) return;
  if (k == 0) {
    for (auto& p : ps) p.b.defined() ? p.y.copy_(p.b.expand({M, p.n})) : p.y.zero_();
    return;
  }
  const auto dtype = x.scalar_type();
  const auto xc = x.contiguous();
  const float* xf = linear::rows_fp32(xc);
  thread_local std::vector<float> xsums;
  const int64_t groups = k / group;
  xsums.assign(static_cast<size_t>(M * groups), 0.0f);
  // Each group's sum in order j = 0 .. group - 1, the groups side by side: independent chains instead of one
  // dependent add after another (the same fp32 sums).
  for (int64_t m = 0; m < M; ++m) {
    float* xs = xsums.data() + m * groups;
    const float* xm = xf + m * k;
    for (int64_t j = 0; j < group; ++j)
      for (int64_t g = 0; g < groups; ++g) xs[g] += xm[g * group + j];
  }
  const bool amx = dtype == at::kBFloat16 && tile_rows > 0 && M >= tile_rows && amx_enabled();
  const int64_t unit = amx ? 1 : panels_per_unit(M);
  const auto* xb = dtype == at::kBFloat16 ? reinterpret_cast<const uint16_t*>(xc.const_data_ptr()) : nullptr;
  std::vector<Args> args;
  std::vector<int64_t> first{0};  // first[i]: the index of weight i's first unit of panels
  for (auto& p : ps) {
    args.push_back(Args{xf, xb, xsums.data(), p.w.const_data_ptr<uint8_t>(),
                        p.b.defined() ? p.b.const_data_ptr<float>() : nullptr, p.y.mutable_data_ptr(), dtype,
                        p.y.stride(0), M, p.n, k, groups, p.w.size(2), static_cast<int>(group)});
    first.push_back(first.back() + (p.w.size(0) + unit - 1) / unit);
  }
#if SPECDEC_X86_CLONES
  const RunFn fn = amx ? isa_amx::pick(bits, f16_scale, has_min) : pick_format(bits, f16_scale, has_min);
#else
  const RunFn fn = pick_format(bits, f16_scale, has_min);
#endif
  // A task gets at least ~64K weights (below that, waking the pool costs more than the work).
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(unit * kPanel * k, 1));
  at::parallel_for(0, first.back(), grain, [&](int64_t begin, int64_t end) {
    for (size_t i = 0; i < ps.size(); ++i) {
      const int64_t lo = std::max(begin, first[i]) - first[i], hi = std::min(end, first[i + 1]) - first[i];
      if (lo < hi) fn(args[i], lo * unit, std::min(hi * unit, ps[i].w.size(0)));
    }
  });
}

at::ScalarType check_x(const char* op, const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.device().is_cpu(), op, ": x must be on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, op, ": x must be [M, K = ", k, "], got ", x.sizes());
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              ": x must be fp32, bf16 or fp16, got ", dtype);
  return dtype;
}

at::Tensor quant_linear_cpu(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t k, int64_t bits,
                            int64_t group, bool has_min, bool f16_scale, const std::optional<at::Tensor>& bias,
                            int64_t tile_rows) {
  check_format("quant_linear", packed, n, k, bits, group, has_min, f16_scale);
  const auto dtype = check_x("quant_linear", x, k);
  std::vector<Product> ps{{packed.contiguous(), linear::bias_fp32("quant_linear", bias, n, dtype),
                           at::empty({x.size(0), n}, x.options()), n}};
  if (n > 0) run_products(x, ps, k, bits, group, has_min, f16_scale, tile_rows);
  return ps[0].y;
}

// specdec::quant_linear_group: the products of one x with several weights of one format (a layer's q, k and v
// projections, or its gate and up projections) in one call, as specdec/compile_passes.py groups them: one pass of
// the thread pool where separate calls would pay its fixed cost once a weight. The outputs come side by side in
// one [M, sum n] tensor (weight i's columns after those of weights 0 .. i-1; callers take column slices): one
// tensor, not a list, so that inductor's C++ wrapper calls the op through the dispatcher, not back through Python.
at::Tensor quant_linear_group_cpu(const at::Tensor& x, at::TensorList packed, at::IntArrayRef n, int64_t k,
                                  int64_t bits, int64_t group, bool has_min, bool f16_scale,
                                  const c10::List<std::optional<at::Tensor>>& bias, int64_t tile_rows) {
  TORCH_CHECK(packed.size() == n.size() && bias.size() == n.size(), "quant_linear_group: ", packed.size(),
              " packed weights, ", n.size(), " sizes and ", bias.size(), " biases: one each per weight");
  const auto dtype = check_x("quant_linear_group", x, k);
  int64_t total = 0;
  for (size_t i = 0; i < n.size(); ++i) {
    check_format("quant_linear_group", packed[i], n[i], k, bits, group, has_min, f16_scale);
    total += n[i];
  }
  auto out = at::empty({x.size(0), total}, x.options());
  std::vector<Product> ps;
  int64_t col = 0;
  for (size_t i = 0; i < n.size(); ++i) {
    if (n[i] > 0)
      ps.push_back({packed[i].contiguous(), linear::bias_fp32("quant_linear_group", bias.get(i), n[i], dtype),
                    out.narrow(1, col, n[i]), n[i]});
    col += n[i];
  }
  run_products(x, ps, k, bits, group, has_min, f16_scale, tile_rows);
  return out;
}

// The fp16 or fp32 value at p.
float param_at(const uint8_t* p, bool f16) {
  if (f16) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return c10::detail::fp16_ieee_to_fp32_value(h);
  }
  float v;
  std::memcpy(&v, p, 4);
  return v;
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
          const float sc = param_at(c + sb * col, f16_scale);
          const float mn = has_min ? param_at(c + sb * (kPanel + col), f16_scale) : 0.0f;
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
  m.impl("quant_linear_group", &quant_linear_group_cpu);
  m.impl("quant_dequantize", &quant_dequantize_cpu);
}

}  // namespace specdec
