// y[M, N] = x[M, K] @ W^T for a few rows M, fp32, AVX-512 (the "panel" weight layout, infer/panel.py).
//
// W is stored once as panels: wp[P][K][48] with wp[p][k][j] = W[48p + j][k] (zero past N). One panel is a
// contiguous K x 48 block, streamed once per call while up to 8 rows of x are multiplied against it: each
// k loads 3 weight vectors and broadcasts one x value per row into 3 accumulators, 24 of the 32 zmm
// registers for 8 rows. The weights are read once whatever M is (as a GEMV does), so M = 8 costs little
// more than M = 1; MKL's GEMM at small M does not get there. Panels are split over torch's threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int VECS = 3;             // zmm accumulators per row
constexpr int COLS = 16 * VECS;     // output features per panel
constexpr int MAX_ROWS = 8;         // rows per pass over a panel (3 x 8 accumulators)
constexpr int PREFETCH = 32 * COLS;  // floats ahead: 32 k-steps (6 KB), into L2: far enough to hide DRAM latency

template <int ROWS>
inline void panel_pass(const float* x, int64_t K, const float* panel, float* y, int64_t N, int64_t valid) {
  __m512 acc[ROWS][VECS];
  for (int m = 0; m < ROWS; ++m)
    for (int v = 0; v < VECS; ++v) acc[m][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* w = panel + k * COLS;
    // all three cache lines of the k-step 32 ahead (the hardware prefetcher alone left the FMAs waiting for
    // memory instead of overlapping with it: 4-8 rows 7-10% slower)
    _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH + 16), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH + 32), _MM_HINT_T1);
    const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16), w2 = _mm512_loadu_ps(w + 32);
    for (int m = 0; m < ROWS; ++m) {
      const __m512 xm = _mm512_set1_ps(x[m * K + k]);
      acc[m][0] = _mm512_fmadd_ps(xm, w0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(xm, w1, acc[m][1]);
      acc[m][2] = _mm512_fmadd_ps(xm, w2, acc[m][2]);
    }
  }
  for (int m = 0; m < ROWS; ++m)
    for (int v = 0; v < VECS; ++v) {
      const int64_t left = valid - 16 * v;  // the last panel may hold fewer than 48 real outputs
      if (left >= 16) _mm512_storeu_ps(y + m * N + 16 * v, acc[m][v]);
      else if (left > 0) _mm512_mask_storeu_ps(y + m * N + 16 * v, static_cast<__mmask16>((1u << left) - 1), acc[m][v]);
    }
}

using Pass = void (*)(const float*, int64_t, const float*, float*, int64_t, int64_t);
constexpr Pass PASSES[MAX_ROWS + 1] = {nullptr, panel_pass<1>, panel_pass<2>, panel_pass<3>, panel_pass<4>,
                                       panel_pass<5>, panel_pass<6>, panel_pass<7>, panel_pass<8>};

}  // namespace

torch::Tensor panel_linear(const torch::Tensor& x, const torch::Tensor& panels, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat, "x: contiguous fp32 [M, K]");
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && panels.size(2) == COLS && panels.size(1) == x.size(1),
              "panels: contiguous fp32 [P, K, 48]");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  TORCH_CHECK(N > 48 * (P - 1) && N <= 48 * P, "N does not match the panels");
  auto y = torch::empty({M, N}, x.options());
  const float* xs = x.data_ptr<float>();
  const float* ws = panels.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t valid = std::min<int64_t>(COLS, N - p * COLS);
      for (int64_t m = 0; m < M; m += MAX_ROWS) {
        const int64_t rows = std::min<int64_t>(MAX_ROWS, M - m);
        PASSES[rows](xs + m * K, K, ws + p * K * COLS, ys + m * N + p * COLS, N, valid);
      }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("panel_linear", &panel_linear, "x @ W^T with W as panels"); }
