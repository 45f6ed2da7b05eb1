// What the panel kernels share (panel_linear.cpp: fp32 weights; blocks_linear.cpp: GGUF codes rebuilt to fp32):
// a panel is 48 output features by K inputs (the stored layout, the same on every CPU), multiplied against a
// few rows of x per pass with 3 accumulator vectors per row in registers; panels are split over torch's threads.
// Each kernel only says how one k-step's weight vectors are loaded.
//
// Built for AVX-512 (-mavx512f: one pass covers the panel's 48 features as 3 zmm vectors, 8 rows: 24 of the
// 32 registers) or for AVX2 + FMA (-mavx2 -mfma: a pass covers one half of the panel, 24 features as 3 ymm
// vectors, 4 rows: 12 accumulators + 3 weights + 1 broadcast = the 16 registers; the second half's pass reads
// the panel again from L2, where the first one left it).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "simd.h"

namespace panel_rows {

using simd::LANES;
using simd::Vec;
constexpr int MAX_ROWS = simd::REGISTERS == 32 ? 8 : 4;  // rows per pass: 3 x 8 of 32 zmm, 3 x 4 of 16 ymm

constexpr int VECS = 3;              // accumulator vectors per row in one pass
constexpr int SPAN = LANES * VECS;   // output features one pass covers (48 or 24)
constexpr int COLS = 48;             // output features per panel
constexpr int SPANS = COLS / SPAN;   // passes per panel and group of rows (1 or 2)
static_assert(COLS % SPAN == 0, "a panel is a whole number of spans");

template <int ROWS>
inline void zero(Vec (&acc)[ROWS][VECS]) {
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < VECS; ++v) acc[r][v] = simd::zero();
}

// acc[r] += x[r, k] * (w0 | w1 | w2) for every row r (x is [ROWS, K] row-major)
template <int ROWS>
inline void multiply_add(Vec (&acc)[ROWS][VECS], const float* x, int64_t K, int64_t k, Vec w0, Vec w1, Vec w2) {
  for (int r = 0; r < ROWS; ++r) {
    const Vec xr = simd::broadcast(x[r * K + k]);
    acc[r][0] = simd::fma(xr, w0, acc[r][0]);
    acc[r][1] = simd::fma(xr, w1, acc[r][1]);
    acc[r][2] = simd::fma(xr, w2, acc[r][2]);
  }
}

// y[r, 0..valid) = acc[r] (a span may hold fewer than SPAN real outputs at the end of the last panel; y rows
// are N apart)
template <int ROWS>
inline void store(const Vec (&acc)[ROWS][VECS], float* y, int64_t N, int64_t valid) {
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < VECS; ++v) {
      const int64_t left = valid - LANES * v;
      if (left > 0) simd::store_first(y + r * N + LANES * v, acc[r][v], left);
    }
}

// real outputs in span s of panel p (the last panel may end early; 0 or less: none), which starts at feature
// p * COLS + s * SPAN of N
inline int64_t span_outputs(int64_t N, int64_t p, int64_t s) {
  return std::min<int64_t>(SPAN, N - p * COLS - s * SPAN);
}

// pass(p, s, r, rows, valid) for every panel p of P, every span s of it that holds real outputs and every group
// of at most MAX_ROWS rows starting at r, panels split over torch's threads; valid = span_outputs
template <typename Pass>
inline void for_each_pass(int64_t P, int64_t M, int64_t N, const Pass& pass) {
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t s = 0; s < SPANS && span_outputs(N, p, s) > 0; ++s)
        for (int64_t r = 0; r < M; r += MAX_ROWS)
          pass(p, s, r, std::min<int64_t>(MAX_ROWS, M - r), span_outputs(N, p, s));
  });
}

}  // namespace panel_rows
