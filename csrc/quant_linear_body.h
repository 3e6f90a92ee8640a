// The quantized-weight micro-kernel of csrc/quant_linear.cpp, written once and included once per instruction set,
// inside a namespace that defines `Ops` (the vector type V of L fp32 lanes and the few operations the kernel needs)
// under a `#pragma GCC target` for that ISA, so every function here is compiled for it.
//
// Expects in scope: Args, RunFn, kPanel, store_row (quant_linear.cpp).

// Whether micro<MR, NP> decodes one code vector pair at a time (see there): the 2-row, 2-panel block of the 8-lane
// ISAs (AVX2, and the baseline's generic 8-lane vectors).
template <int MR, int NP>
constexpr bool kOneCodeAtATime = Ops::L == 8 && MR > 1 && NP > 1;

// Rows [m0, m0 + MR) against panels [p0, p0 + NP), L lanes a vector (16 / L vectors a panel).
template <int BITS, bool F16, bool MIN, int MR, int NP>
SPECDEC_INLINE void micro(const Args& a, int64_t m0, int64_t p0) {
  using VF = typename Ops::V;
  constexpr int L = Ops::L;
  constexpr int H = kPanel / L;
  constexpr int SB = F16 ? 2 : 4;
  constexpr int kCodes = kPanel * SB * (MIN ? 2 : 1);  // byte offset of the codes in a chunk
  VF acc[MR][NP][H];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p)
#pragma GCC unroll 2
      for (int h = 0; h < H; ++h) acc[m][p][h] = Ops::zero();
  const float* xr = a.x + m0 * a.K;
  const int G = a.group;
  // One step reads 16 bytes of each panel: S codes per column (two nibbles, or one int8).
  constexpr int S = BITS == 4 ? 2 : 1;
  for (int64_t g = 0; g < a.groups; ++g) {
    const uint8_t* q[NP];
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) {
      const uint8_t* c = a.w + ((p0 + p) * a.groups + g) * a.chunk;
      // Every line of the same chunk of the next NP panels (the next register block's): far enough ahead to hide
      // the memory's latency in a call of a few panels a thread.
      const int64_t ahead = NP * a.groups * a.chunk;
      for (int64_t o = 0; o < a.chunk; o += 64) __builtin_prefetch(c + ahead + o);
      q[p] = c + kCodes;
    }
    const float* xk = xr + g * G;
    // dot = sum_j x_j code_j over the group (codes widened to fp32 exactly), then acc += scale * dot
    // (+ min * sum_j x_j): the group's sum_j x_j (code_j * scale + min), two multiply-adds a group instead of one a
    // weight.
    VF dot[MR][NP][H];
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p)
#pragma GCC unroll 2
        for (int h = 0; h < H; ++h) dot[m][p][h] = Ops::zero();
    // Every output element's multiply-adds run in the same order (j, then s) in both loop forms: they differ only in
    // which vectors are live at once.
    if constexpr (kOneCodeAtATime<MR, NP>) {
      // One code vector pair at a time, each x value broadcast where it is used: with AVX2's 16 registers the other
      // form keeps all of a panel's codes and every row's broadcasts live, and spills an accumulator at 2 rows x 2
      // panels.
      for (int j = 0; j < G / S; ++j) {
#pragma GCC unroll 4
        for (int p = 0; p < NP; ++p) {
#pragma GCC unroll 2
          for (int h = 0; h < H; ++h) {
            VF c[S];
            Ops::template codes<BITS>(q[p] + j * kPanel + h * L, c);
#pragma GCC unroll 2
            for (int s = 0; s < S; ++s) {
#pragma GCC unroll 8
              for (int m = 0; m < MR; ++m)
                dot[m][p][h] = Ops::fma(Ops::bcast(xk + m * a.K + S * j + s), c[s], dot[m][p][h]);
            }
          }
        }
      }
    } else {
      for (int j = 0; j < G / S; ++j) {
#pragma GCC unroll 4
        for (int p = 0; p < NP; ++p) {
          // The panel's codes first, then one x value at a time into every vector of the panel: H * S code vectors,
          // one broadcast and the accumulators live at once (AVX2 has 16 registers).
          VF c[H][S];
#pragma GCC unroll 2
          for (int h = 0; h < H; ++h) Ops::template codes<BITS>(q[p] + j * kPanel + h * L, c[h]);
#pragma GCC unroll 8
          for (int m = 0; m < MR; ++m)
#pragma GCC unroll 2
            for (int s = 0; s < S; ++s) {
              const VF xb = Ops::bcast(xk + m * a.K + S * j + s);
#pragma GCC unroll 2
              for (int h = 0; h < H; ++h) {
                dot[m][p][h] = Ops::fma(xb, c[h][s], dot[m][p][h]);
              }
            }
        }
      }
    }
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) {
      const uint8_t* c = a.w + ((p0 + p) * a.groups + g) * a.chunk;
#pragma GCC unroll 2
      for (int h = 0; h < H; ++h) {
        const VF sc = Ops::template scale<F16>(c + h * L * SB);
        const VF mn = MIN ? Ops::template scale<F16>(c + kPanel * SB + h * L * SB) : Ops::zero();
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) {
          acc[m][p][h] = Ops::fma(dot[m][p][h], sc, acc[m][p][h]);
          if constexpr (MIN) acc[m][p][h] = Ops::fma(Ops::bcast(a.xs + (m0 + m) * a.groups + g), mn, acc[m][p][h]);
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
        Ops::store(v + h * L, acc[m][p][h]);
      }
      store_row(a, m0 + m, p0 + p, v);
    }
}

// All rows, in near-equal blocks of at most MAXR, against NP panels at p (one at a time past p_end).
template <int BITS, bool F16, bool MIN, int NP, int MAXR>
SPECDEC_INLINE void rows(const Args& a, int64_t p, int64_t p_end) {
  if constexpr (NP > 1) {
    if (p + NP > p_end) {
      for (; p < p_end; ++p) rows<BITS, F16, MIN, 1, MAXR>(a, p, p_end);
      return;
    }
  }
  const int64_t blocks = (a.M + MAXR - 1) / MAXR;
  int64_t m = 0;
  for (int64_t i = 0; i < blocks; ++i) {
    const int r = static_cast<int>(a.M / blocks + (i < a.M % blocks));
#define SPECDEC_QROWS(R) \
  case R: \
    if constexpr (R <= MAXR) micro<BITS, F16, MIN, R, NP>(a, m, p); \
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
// panels at one row and 2 panels of up to 4 rows; 8 lanes (AVX2, 16 registers) 2 panels at one and at two rows
// (8 accumulators at two rows: the FMA chains of a 1-panel block leave the units half idle) and one panel of up
// to 4 rows past that (8 accumulators, 4 code vectors and a broadcast: 5 rows spill, and 4 rows reach 1.3-1.7x
// the 2-row block's speed at 4 to 16 rows on a Zen 3).
inline int64_t panels_per_unit(int64_t M) {
  if constexpr (Ops::L == 16) return M == 1 ? 4 : 2;
  else return M <= 2 ? 2 : 1;
}

template <int BITS, bool F16, bool MIN>
void run(const Args& a, int64_t p_begin, int64_t p_end) {
  const int64_t np = panels_per_unit(a.M);
  for (int64_t p = p_begin; p < p_end; p += np) {
    if constexpr (Ops::L == 16) {
      if (np == 4) rows<BITS, F16, MIN, 4, 1>(a, p, p_end);
      else rows<BITS, F16, MIN, 2, 4>(a, p, p_end);
    } else {
      if (np == 2) rows<BITS, F16, MIN, 2, 2>(a, p, p_end);  // one row: micro<1, 2>; two rows: micro<2, 2>
      else rows<BITS, F16, MIN, 1, 4>(a, p, p_end);
    }
  }
}

// The kernel for one format. (4-bit codes always come with a min: Q4_0, Q4_1, Q4_K; a zero min where the format
// has none.)
inline RunFn pick(int64_t bits, bool f16, bool has_min) {
  if (bits == 4) return f16 ? run<4, true, true> : run<4, false, true>;
  if (f16) return has_min ? run<8, true, true> : run<8, true, false>;
  return has_min ? run<8, false, true> : run<8, false, false>;
}

