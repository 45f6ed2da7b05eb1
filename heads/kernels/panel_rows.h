// What the panel kernels share (panel_linear.cpp: fp32 weights; blocks_linear.cpp: GGUF codes rebuilt to fp32):
// a panel is 48 output features (3 AVX-512 vectors) by K inputs, multiplied against up to 8 rows of x per pass
// with 3 x 8 accumulators in registers; panels are split over torch's threads. Each kernel only says how one
// k-step's 48 weights are loaded.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace panel_rows {

constexpr int VECS = 3;          // zmm accumulators per row
constexpr int COLS = 16 * VECS;  // output features per panel
constexpr int MAX_ROWS = 8;      // rows per pass over a panel (3 x 8 accumulators)

template <int ROWS>
inline void zero(__m512 (&acc)[ROWS][VECS]) {
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < VECS; ++v) acc[r][v] = _mm512_setzero_ps();
}

// acc[r] += x[r, k] * (w0 | w1 | w2) for every row r (x is [ROWS, K] row-major)
template <int ROWS>
inline void multiply_add(__m512 (&acc)[ROWS][VECS], const float* x, int64_t K, int64_t k, __m512 w0, __m512 w1,
                         __m512 w2) {
  for (int r = 0; r < ROWS; ++r) {
    const __m512 xr = _mm512_set1_ps(x[r * K + k]);
    acc[r][0] = _mm512_fmadd_ps(xr, w0, acc[r][0]);
    acc[r][1] = _mm512_fmadd_ps(xr, w1, acc[r][1]);
    acc[r][2] = _mm512_fmadd_ps(xr, w2, acc[r][2]);
  }
}

// y[r, 0..valid) = acc[r] (the last panel may hold fewer than 48 real outputs; y rows are N apart)
template <int ROWS>
inline void store(const __m512 (&acc)[ROWS][VECS], float* y, int64_t N, int64_t valid) {
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < VECS; ++v) {
      const int64_t left = valid - 16 * v;
      if (left >= 16) _mm512_storeu_ps(y + r * N + 16 * v, acc[r][v]);
      else if (left > 0) _mm512_mask_storeu_ps(y + r * N + 16 * v, static_cast<__mmask16>((1u << left) - 1), acc[r][v]);
    }
}

// pass(p, r, rows, valid) for every panel p of P and every group of at most 8 rows starting at r, panels split
// over torch's threads; valid = real outputs in panel p
template <typename Pass>
inline void for_each_pass(int64_t P, int64_t M, int64_t N, const Pass& pass) {
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t valid = std::min<int64_t>(COLS, N - p * COLS);
      for (int64_t r = 0; r < M; r += MAX_ROWS) pass(p, r, std::min<int64_t>(MAX_ROWS, M - r), valid);
    }
  });
}

}  // namespace panel_rows
