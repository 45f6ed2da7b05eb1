// y[M, N] = x[M, K] @ W^T for a few rows M, fp32 arithmetic, AVX-512, with W read from its block-quantized
// encoding (the "blocks" weight layout, heads/kernels/blocks.py): W[n][k] = d[n][k/32] * q[n][k] + m[n][k/32], the
// values a GGUF Q4_1 / Q8_0 tensor dequantizes to (m = 0 for Q8_0), rebuilt in registers exactly as the
// dequantizer computes them: d * q is exact in fp32 (an f16 scale times a code of at most 8 bits), so the one
// rounding of fma(d, q, m) is the dequantizer's one rounding of d * q + m (one instruction instead of two; built
// with -ffp-contract=off all the same, so the compiler fuses nothing else).
//
// The codes are stored as panels like the panel layout's weights: q[P][K][48] int8 with q[p][k][j] =
// q(48p + j, k) (zero past N), and the scales/offsets as s[P][K/32][48] fp32. One panel streams 48 bytes per
// k-step instead of 192 (fp32), so a decode step reads ~1.2 bytes per weight: the weights of a small model
// stay in the last-level cache, and M rows cost one decode of each weight vector per pass of 8 rows.
#include <torch/extension.h>

#include "panel_rows.h"

namespace {

using namespace panel_rows;
constexpr int BLOCK = 32;            // k-steps per scale/offset (GGUF's block size)
constexpr int PREFETCH = 16 * COLS;  // bytes ahead: 16 k-steps of codes

inline __m512 codes(const int8_t* q) {  // 16 int8 codes -> 16 floats
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
}

template <int ROWS>
inline void panel_pass(const float* x, int64_t K, const int8_t* q, const float* d, const float* m, float* y,
                       int64_t N, int64_t valid) {
  __m512 acc[ROWS][VECS];
  zero<ROWS>(acc);
  for (int64_t k0 = 0; k0 < K; k0 += BLOCK) {
    const float* db = d + (k0 / BLOCK) * COLS;
    const float* mb = m + (k0 / BLOCK) * COLS;
    const __m512 d0 = _mm512_loadu_ps(db), d1 = _mm512_loadu_ps(db + 16), d2 = _mm512_loadu_ps(db + 32);
    const __m512 m0 = _mm512_loadu_ps(mb), m1 = _mm512_loadu_ps(mb + 16), m2 = _mm512_loadu_ps(mb + 32);
    for (int64_t k = k0; k < k0 + BLOCK; ++k) {
      const int8_t* qk = q + k * COLS;
      _mm_prefetch(reinterpret_cast<const char*>(qk + PREFETCH), _MM_HINT_T0);
      multiply_add<ROWS>(acc, x, K, k, _mm512_fmadd_ps(d0, codes(qk), m0), _mm512_fmadd_ps(d1, codes(qk + 16), m1),
                         _mm512_fmadd_ps(d2, codes(qk + 32), m2));
    }
  }
  store<ROWS>(acc, y, N, valid);
}

using Pass = void (*)(const float*, int64_t, const int8_t*, const float*, const float*, float*, int64_t, int64_t);
constexpr Pass PASSES[MAX_ROWS + 1] = {nullptr, panel_pass<1>, panel_pass<2>, panel_pass<3>, panel_pass<4>,
                                       panel_pass<5>, panel_pass<6>, panel_pass<7>, panel_pass<8>};

}  // namespace

torch::Tensor blocks_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& d,
                            const torch::Tensor& m, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat, "x: contiguous fp32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % BLOCK == 0, "K must be a multiple of 32");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == torch::kChar && q.size(1) == K &&
              q.size(2) == COLS, "q: contiguous int8 [P, K, 48]");
  const int64_t P = q.size(0);
  for (const auto* s : {&d, &m})
    TORCH_CHECK(s->is_contiguous() && s->scalar_type() == torch::kFloat && s->dim() == 3 && s->size(0) == P &&
                s->size(1) == K / BLOCK && s->size(2) == COLS, "d, m: contiguous fp32 [P, K/32, 48]");
  TORCH_CHECK(N > COLS * (P - 1) && N <= COLS * P, "N does not match the panels");
  auto y = torch::empty({M, N}, x.options());
  const float* xs = x.data_ptr<float>();
  const int8_t* qs = q.data_ptr<int8_t>();
  const float* ds = d.data_ptr<float>();
  const float* ms = m.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  const int64_t scales = (K / BLOCK) * COLS;  // floats of d (and of m) per panel
  for_each_pass(P, M, N, [&](int64_t p, int64_t r, int64_t rows, int64_t valid) {
    PASSES[rows](xs + r * K, K, qs + p * K * COLS, ds + p * scales, ms + p * scales, ys + r * N + p * COLS, N, valid);
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("blocks_linear", &blocks_linear, "x @ W^T with W as block-quantized panels, dequantized exactly");
}
