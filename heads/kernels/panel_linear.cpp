// y[M, N] = x[M, K] @ W^T for a few rows M, fp32, AVX-512 or AVX2 (the "panel" weight layout, heads/kernels/panel.py).
//
// W is stored once as panels: wp[P][K][48] with wp[p][k][j] = W[48p + j][k] (zero past N). One panel is a
// contiguous K x 48 block, streamed once per call while a few rows of x are multiplied against it: each k loads 3
// weight vectors and broadcasts one x value per row into 3 accumulators (AVX-512: the whole panel, 8 rows at a
// time; AVX2: each half of it, 4 rows at a time, see panel_rows.h). The weights come from memory once whatever
// M is (as a GEMV reads them), so M = 8 costs little more than M = 1; MKL's GEMM at small M does not get there.
// Panels are split over torch's threads.
#include <torch/extension.h>

#include "panel_rows.h"

namespace {

using namespace panel_rows;
constexpr int PREFETCH = 32 * COLS;  // floats ahead: 32 k-steps (6 KB), into L2: far enough to hide DRAM latency

template <int ROWS>
inline void panel_pass(const float* x, int64_t K, const float* panel, float* y, int64_t N, int64_t valid) {
  Vec acc[ROWS][VECS];
  zero<ROWS>(acc);
  for (int64_t k = 0; k < K; ++k) {
    const float* w = panel + k * COLS;
    // all three cache lines of the k-step 32 ahead (the hardware prefetcher alone left the FMAs waiting for
    // memory instead of overlapping with it: 4-8 rows 7-10% slower)
    _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH + 16), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH + 32), _MM_HINT_T1);
    multiply_add<ROWS>(acc, x, K, k, simd::load(w), simd::load(w + LANES), simd::load(w + 2 * LANES));
  }
  store<ROWS>(acc, y, N, valid);
}

using Pass = void (*)(const float*, int64_t, const float*, float*, int64_t, int64_t);
constexpr Pass PASSES[MAX_ROWS + 1] = {nullptr, panel_pass<1>, panel_pass<2>, panel_pass<3>, panel_pass<4>,
#if defined(__AVX512F__)
                                       panel_pass<5>, panel_pass<6>, panel_pass<7>, panel_pass<8>
#endif
};

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
  for_each_pass(P, M, N, [&](int64_t p, int64_t s, int64_t r, int64_t rows, int64_t valid) {
    PASSES[rows](xs + r * K, K, ws + p * K * COLS + s * SPAN, ys + r * N + p * COLS + s * SPAN, N, valid);
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("panel_linear", &panel_linear, "x @ W^T with W as panels"); }
