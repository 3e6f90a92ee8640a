// The register-blocked GEMM micro-kernel shared by packed_linear.cpp and tree_attention.cpp:
//
//   out[m, 16 p + c] = sum_k x[m * ldx + k] * B(p, k)[c]     (x fp32; B given as panels of 16 columns)
//
// One step of the inner loop widens one 16-column step of each of NP panels into two 8-lane
// registers each and broadcasts one x value per row: an MR x 16 NP block keeps MR x NP x 2 fp32
// accumulators in registers (6 x 1 x 2 = 12 on AVX2's 16 registers, the classic 6x16 kernel).
//
// Every output element is one accumulator, updated once per k in order k = 0 .. K-1 with the same
// multiply-add, whatever the row blocking: a row's result never depends on which rows share a call
// (packed_linear's batch invariance rests on this).
//
// The caller supplies an Op with two always-inline members: load(p, k, lo, hi) widens panel p's step k
// (columns 0-7 into lo, 8-15 into hi) and store(m, p, lo, hi) consumes row m's 16 sums of panel p.
// Everything here is always_inline, so it is compiled for the ISA of the target clone that calls it
// (a helper compiled on its own, a lambda included, would get the baseline ISA).
#pragma once

#include <cstdint>

#include "simd.h"

namespace specdec::panel {

constexpr int kPanel = 16;   // columns per panel: two 8-lane registers
constexpr int kMaxRows = 6;  // rows per register block

typedef simd::Lanes<8>::f v8;

// Broadcast of one float. Written this way GCC emits one vbroadcastss from memory inside the
// target clones; {s, s, ...} or a memcpy into a vector is built lane by lane there.
SPECDEC_INLINE v8 broadcast8(const float* p) {
  const v8 t = {*p};
  return __builtin_shufflevector(t, t, 0, 0, 0, 0, 0, 0, 0, 0);
}

// Rows [m0, m0 + MR) against panels [p0, p0 + NP). (The accumulators are only ever passed by value:
// an array whose address is taken, even by memcpy, is kept in memory by GCC and every FMA goes
// through a store.)
template <int MR, int NP, typename Op>
SPECDEC_INLINE void micro(const Op& op_ref, const float* x, int64_t ldx, int64_t K, int64_t m0, int64_t p0) {
  const Op op = op_ref;  // a local copy: its fields stay in registers across the k loop
  const float* xr = x + m0 * ldx;
  v8 acc[MR][NP][2] = {};
  for (int64_t k = 0; k < K; ++k) {
    v8 wv[NP][2];
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) op.load(p0 + p, k, wv[p][0], wv[p][1]);
#pragma GCC unroll 6
    for (int m = 0; m < MR; ++m) {
      const v8 xb = broadcast8(xr + m * ldx + k);
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) {
        acc[m][p][0] += xb * wv[p][0];
        acc[m][p][1] += xb * wv[p][1];
      }
    }
  }
#pragma GCC unroll 6
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) op.store(m0 + m, p0 + p, acc[m][p][0], acc[m][p][1]);
}

// One row block against NP panels at p (one panel at a time past p_end). Blocks of more than
// `wide_rows` rows take one panel at a time: NP x 2 accumulators per row would not fit.
template <int NP, int MR, int wide_rows, typename Op>
SPECDEC_INLINE void block(const Op& op, const float* x, int64_t ldx, int64_t K, int64_t m0, int64_t p, int64_t p_end) {
  if constexpr (NP > 1 && MR <= wide_rows) {
    if (p + NP <= p_end) return micro<MR, NP>(op, x, ldx, K, m0, p);
    for (; p < p_end; ++p) micro<MR, 1>(op, x, ldx, K, m0, p);
  } else {
    for (int64_t q = p; q < p + NP && q < p_end; ++q) micro<MR, 1>(op, x, ldx, K, m0, q);
  }
}

template <int NP, int wide_rows, typename Op>
SPECDEC_INLINE void gemm_np(const Op& op, const float* x, int64_t ldx, int64_t M, int64_t K, int64_t p_begin,
                            int64_t p_end) {
  const int64_t blocks = (M + kMaxRows - 1) / kMaxRows;
  for (int64_t p = p_begin; p < p_end; p += NP) {
    int64_t m = 0;
    for (int64_t i = 0; i < blocks; ++i) {
      const int rows = static_cast<int>(M / blocks + (i < M % blocks));
      switch (rows) {
        case 1: block<NP, 1, wide_rows>(op, x, ldx, K, m, p, p_end); break;
        case 2: block<NP, 2, wide_rows>(op, x, ldx, K, m, p, p_end); break;
        case 3: block<NP, 3, wide_rows>(op, x, ldx, K, m, p, p_end); break;
        case 4: block<NP, 4, wide_rows>(op, x, ldx, K, m, p, p_end); break;
        case 5: block<NP, 5, wide_rows>(op, x, ldx, K, m, p, p_end); break;
        default: block<NP, 6, wide_rows>(op, x, ldx, K, m, p, p_end); break;
      }
      m += rows;
    }
  }
}

// Panels per register block for M rows: 4 at one row, 2 up to `wide_rows` rows, else 1 (eight or more
// FMA chains in flight). wide_rows is 2 where each panel step needs its own registers (bf16
// shift-and-mask widening), 3 where B's steps are fp32 and fold into the FMAs as memory operands.
template <int wide_rows>
inline int panels_per_block(int64_t M) {
  return M == 1 ? 4 : M <= wide_rows ? 2 : 1;
}

// Seven or eight rows: one 6-row block per panel, and the last one or two rows as a wide block over two
// panels at a time. (Near-equal blocks would be 4 + 4, each keeping only 8 FMA chains in flight; a 2-row
// block of one panel would keep 4.)
template <int wide_rows, typename Op>
SPECDEC_INLINE void gemm_six_plus(const Op& op, const float* x, int64_t ldx, int64_t M, int64_t K, int64_t p_begin,
                                  int64_t p_end) {
  for (int64_t p = p_begin; p < p_end; p += 2) {
    for (int64_t q = p; q < p + 2 && q < p_end; ++q) micro<6, 1>(op, x, ldx, K, 0, q);
    if (M == 7) block<2, 1, wide_rows>(op, x, ldx, K, 6, p, p_end);
    else block<2, 2, wide_rows>(op, x, ldx, K, 6, p, p_end);
  }
}

// out[M, 16 p] for panels [p_begin, p_end) of x[M, K] . B: panels outer (one panel's steps stay in
// L1 while every row block reads them), rows in near-equal blocks of at most six, except 7 and 8 rows:
// 6 + 1 or 6 + 2, the short block over two panels (gemm_six_plus; all 211 bf16 weights of SmolLM2, one
// thread, alternating builds: 8 rows 29.3-31.6 -> 27.6-28.6 ms, 7 rows 28.7-30.1 -> 26.5-27.3 ms).
template <int wide_rows, typename Op>
SPECDEC_INLINE void gemm(const Op& op, const float* x, int64_t ldx, int64_t M, int64_t K, int64_t p_begin,
                         int64_t p_end) {
  if (M == 7 || M == 8) return gemm_six_plus<wide_rows>(op, x, ldx, M, K, p_begin, p_end);
  switch (panels_per_block<wide_rows>(M)) {
    case 4: return gemm_np<4, wide_rows>(op, x, ldx, M, K, p_begin, p_end);
    case 2: return gemm_np<2, wide_rows>(op, x, ldx, M, K, p_begin, p_end);
    default: return gemm_np<1, wide_rows>(op, x, ldx, M, K, p_begin, p_end);
  }
}

}  // namespace specdec::panel
