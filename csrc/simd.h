// SIMD helpers shared by the CPU kernels: 16-lane GCC/Clang vector types, lowered to whatever
// the target has (one zmm on AVX-512, two ymm on AVX2, four xmm on SSE2, NEON on arm), and
// runtime ISA dispatch: a hot function is written once as an always-inline template body and
// instantiated in wrappers compiled for AVX-512, AVX2+FMA and the baseline; the best one the CPU
// supports is picked at run time (the extension itself is built for the baseline ISA).
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <limits>

#define SPECDEC_INLINE inline __attribute__((always_inline))

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define SPECDEC_X86_CLONES 1
#define SPECDEC_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define SPECDEC_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")))
#else
#define SPECDEC_X86_CLONES 0
#define SPECDEC_TARGET_AVX2
#define SPECDEC_TARGET_AVX512
#endif

namespace specdec::simd {

constexpr int kLanes = 16;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

typedef float vf __attribute__((vector_size(4 * kLanes)));
typedef int32_t vi __attribute__((vector_size(4 * kLanes)));

enum class Isa { kBase, kAvx2, kAvx512 };

// The widest instruction set the wrappers are compiled for that this CPU supports.
inline Isa best_isa() {
#if SPECDEC_X86_CLONES
  static const Isa isa = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma"))
      return Isa::kAvx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
    return Isa::kBase;
  }();
  return isa;
#else
  return Isa::kBase;
#endif
}

// The clone of a kernel for the widest ISA this CPU supports (the three wrappers of one body).
template <typename Fn>
inline Fn pick(Fn avx512, Fn avx2, Fn base) {
  switch (best_isa()) {
    case Isa::kAvx512: return avx512;
    case Isa::kAvx2: return avx2;
    default: return base;
  }
}

// Helpers for any fp32 vector type V (vf by default, or Lanes<8>::f: on AVX2, 16-lane vectors are two
// registers each, and GCC lowers some loops over them to scalar code with spills) and its int32 mask.
template <typename V = vf>
SPECDEC_INLINE V splat(float v) { return V{} + v; }
template <typename V = vf>
SPECDEC_INLINE V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <typename V>
SPECDEC_INLINE void store(float* p, V v) { std::memcpy(p, &v, sizeof(v)); }
template <typename M, typename V>
SPECDEC_INLINE V select(M mask, V a, V b) { return mask ? a : b; }
template <typename V>
SPECDEC_INLINE V vmax(V a, V b) { return a > b ? a : b; }  // b where a is NaN (maxps)
template <typename M>
SPECDEC_INLINE bool any(M m) {
  int32_t r = 0;
  for (int j = 0; j < static_cast<int>(sizeof(M) / sizeof(int32_t)); ++j) r |= m[j];
  return r != 0;
}
template <typename V>
SPECDEC_INLINE float hmax(V v) {
  float r = v[0];
  for (int j = 1; j < static_cast<int>(sizeof(V) / sizeof(float)); ++j) r = v[j] > r ? v[j] : r;
  return r;
}
template <typename V>
SPECDEC_INLINE float hsum(V v) {
  float r = 0.0f;
  for (int j = 0; j < static_cast<int>(sizeof(V) / sizeof(float)); ++j) r += v[j];
  return r;
}

// e^x for x <= 0, within 2.5e-7 relative; 0 below -87 and for -inf and NaN. x = n ln2 + g with
// |g| <= ln2 / 2: e^g by a degree-5 minimax polynomial, 2^n built in the exponent bits.
// V: any fp32 vector type (vf, or Lanes<8>::f where 16-lane temporaries would spill on AVX2).
template <typename V>
SPECDEC_INLINE V exp_nonpos_v(V x) {
  typedef int32_t VI __attribute__((vector_size(sizeof(V))));
  // 1.5 * 2^23 + 127: adding it rounds to an integer and leaves n + 127 in the low mantissa bits.
  constexpr float kMagic = 12582912.0f + 127.0f;
  const V lo = V{} - 87.0f;
  const V xc = x > lo ? x : lo;
  const V t = xc * 1.44269504088896341f + kMagic;
  const V n = t - kMagic;
  const V g = (xc - n * 0.693359375f) - n * -2.12194440e-4f;  // ln 2 in two parts
  V p = V{} + 8.2903141156e-3f;  // minimax on [-ln2/2, ln2/2] with p(0) = 1 exactly
  p = p * g + 4.1897930205e-2f;
  p = p * g + 1.6667635739e-1f;
  p = p * g + 4.9999150634e-1f;
  p = p * g + 9.9999970198e-1f;
  p = p * g + 1.0f;
  const V scale = (V)((VI)t << 23);
  return x >= lo ? p * scale : V{};
}
SPECDEC_INLINE vf exp_nonpos(vf x) { return exp_nonpos_v(x); }

// fp32 -> bf16 bits with round-to-nearest-even (inputs here are finite).
SPECDEC_INLINE void store_bf16(uint16_t* p, vf v) {
  const vi bits = (vi)v;
  const vi rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16;
  for (int j = 0; j < kLanes; ++j) p[j] = static_cast<uint16_t>(rounded[j]);
}

// Vector types of N fp32/int32/16-bit lanes: the kernels use kLanes, or 8 (one ymm) where a register
// block of 16-lane vectors would not fit in AVX2's 16 registers.
template <int N>
struct Lanes {
  typedef float f __attribute__((vector_size(4 * N)));
  typedef int32_t i __attribute__((vector_size(4 * N)));
  typedef uint16_t h __attribute__((vector_size(2 * N)));
};

// N bf16 values (raw bits) -> fp32.
template <int N>
SPECDEC_INLINE typename Lanes<N>::f load_bf16_n(const uint16_t* p) {
  typename Lanes<N>::h h;
  std::memcpy(&h, p, sizeof(h));
  return (typename Lanes<N>::f)(__builtin_convertvector(h, typename Lanes<N>::i) << 16);
}

// N IEEE fp16 values (raw bits) -> fp32 (one instruction under F16C; a libgcc call per lane on the baseline).
template <int N>
SPECDEC_INLINE typename Lanes<N>::f load_f16_n(const uint16_t* p) {
#if SPECDEC_X86_CLONES && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
  typedef _Float16 vhf __attribute__((vector_size(2 * N)));
  vhf h;
  std::memcpy(&h, p, sizeof(h));
  return __builtin_convertvector(h, typename Lanes<N>::f);
#else
  typename Lanes<N>::f r;
  for (int j = 0; j < N; ++j) r[j] = c10::detail::fp16_ieee_to_fp32_value(p[j]);
  return r;
#endif
}

SPECDEC_INLINE vf load_bf16(const uint16_t* p) { return load_bf16_n<kLanes>(p); }
SPECDEC_INLINE vf load_f16(const uint16_t* p) { return load_f16_n<kLanes>(p); }

}  // namespace specdec::simd
