// y[M, N] = x[M, K] @ W^T for a few rows M, fp32 arithmetic, AVX-512 or AVX2, with W read from its block-quantized
// encoding (the "blocks" weight layout, heads/kernels/blocks.py): W[n][k] = d[n][k/32] * q[n][k] + m[n][k/32], the
// values a GGUF Q4_1 / Q8_0 tensor dequantizes to (m = 0 for Q8_0), rebuilt in registers exactly as the
// dequantizer computes them: d * q is exact in fp32 (an f16 scale times a code of at most 8 bits), so the one
// rounding of fma(d, q, m) is the dequantizer's one rounding of d * q + m (one instruction instead of two; built
// with -ffp-contract=off all the same, so the compiler fuses nothing else).
//
// The codes are stored as panels like the panel layout's weights: q[P][K][48] int8 with q[p][k][j] =
// q(48p + j, k) (zero past N), and the scales/offsets as s[P][K/32][48] fp32. One panel streams 48 bytes per
// k-step instead of 192 (fp32), so a decode step reads ~1.2 bytes per weight: the weights of a small model
// stay in the last-level cache, and M rows cost one decode of each weight vector per pass of rows (AVX-512:
// passes of 8 rows). With AVX2 a pass rebuilds in registers for at most 2 rows (more would spill the 16
// registers, see REGISTER_ROWS); more rows (a tree) first rebuild each block of 32 k-steps of a span once into
// an fp32 scratch in L1 that every group of 4 rows then multiplies (rebuilt_once): rebuilding is most of a
// pass's cost there (on a 2-core AMD EPYC of the Zen 3 generation all of SmolLM2-135M's Linears took 11.9 ms
// for 1 row, 15.2 for 4 and 28.1 for 8 when each group of 4 rebuilt the weights itself; 22.8 for 8 from the
// scratch, 21.3-22.5 (two runs) when each rebuild also prefetches the codes two blocks ahead, which the
// multiplications in between would otherwise wait for). The sums are the same, in the same order.
#include <torch/extension.h>

#include <vector>

#include "panel_rows.h"

namespace {

using namespace panel_rows;
constexpr int BLOCK = 32;            // k-steps per scale/offset (GGUF's block size)
constexpr int PREFETCH = 16 * COLS;  // bytes ahead: 16 k-steps of codes

template <int ROWS>
inline void panel_pass(const float* x, int64_t K, const int8_t* q, const float* d, const float* m, float* y,
                       int64_t N, int64_t valid) {
  Vec acc[ROWS][VECS];
  zero<ROWS>(acc);
  for (int64_t k0 = 0; k0 < K; k0 += BLOCK) {
    const float* db = d + (k0 / BLOCK) * COLS;
    const float* mb = m + (k0 / BLOCK) * COLS;
    const Vec d0 = simd::load(db), d1 = simd::load(db + LANES), d2 = simd::load(db + 2 * LANES);
    const Vec m0 = simd::load(mb), m1 = simd::load(mb + LANES), m2 = simd::load(mb + 2 * LANES);
    for (int64_t k = k0; k < k0 + BLOCK; ++k) {
      const int8_t* qk = q + k * COLS;
      _mm_prefetch(reinterpret_cast<const char*>(qk + PREFETCH), _MM_HINT_T0);
      multiply_add<ROWS>(acc, x, K, k, simd::fma(d0, simd::codes(qk), m0),
                         simd::fma(d1, simd::codes(qk + LANES), m1), simd::fma(d2, simd::codes(qk + 2 * LANES), m2));
    }
  }
  store<ROWS>(acc, y, N, valid);
}

using Pass = void (*)(const float*, int64_t, const int8_t*, const float*, const float*, float*, int64_t, int64_t);
constexpr Pass PASSES[MAX_ROWS + 1] = {nullptr, panel_pass<1>, panel_pass<2>, panel_pass<3>, panel_pass<4>,
#if defined(__AVX512F__)
                                       panel_pass<5>, panel_pass<6>, panel_pass<7>, panel_pass<8>
#endif
};

// With AVX2, rows beyond 2 are multiplied from the rebuilt scratch: a pass that rebuilds in registers holds 3 x
// rows accumulators, 3 weights and the block's 6 scale and offset vectors, which spill out of the 16 registers
// above 2 rows (a 1536 x 576 Linear of SmolLM2-135M: 40 us for 2 rows, 89 us for 4). AVX-512 keeps its passes
// of 8 rows (measured there before; its 32 registers hold them).
constexpr bool FROM_SCRATCH = LANES == 8;  // AVX2
constexpr int64_t REGISTER_ROWS = 2;         // AVX2: rows a pass that rebuilds in registers takes
constexpr int64_t AHEAD = 2 * BLOCK;         // k-steps ahead whose codes a scratch rebuild prefetches

// tile[r] += x[r, k0 + j] * w[j] over the BLOCK k-steps of a rebuilt block w [BLOCK][SPAN] (in L1)
template <int ROWS>
inline void scratch_pass(const float* x, int64_t K, int64_t k0, const float* w, float* tile) {
  Vec acc[ROWS][VECS];
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < VECS; ++v) acc[r][v] = simd::load(tile + r * SPAN + v * LANES);
  for (int j = 0; j < BLOCK; ++j) {
    const float* wj = w + j * SPAN;
    multiply_add<ROWS>(acc, x, K, k0 + j, simd::load(wj), simd::load(wj + LANES), simd::load(wj + 2 * LANES));
  }
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < VECS; ++v) simd::store(tile + r * SPAN + v * LANES, acc[r][v]);
}

using ScratchPass = void (*)(const float*, int64_t, int64_t, const float*, float*);
constexpr ScratchPass SCRATCH_PASSES[MAX_ROWS + 1] = {nullptr, scratch_pass<1>, scratch_pass<2>, scratch_pass<3>,
                                                      scratch_pass<4>,
#if defined(__AVX512F__)
                                                      scratch_pass<5>, scratch_pass<6>, scratch_pass<7>, scratch_pass<8>
#endif
};

// y[:, span] for all M rows, the span's weights rebuilt once per block of k-steps; w: [BLOCK][SPAN] scratch,
// tile: [M][SPAN] partial sums
void rebuilt_once(const float* x, int64_t M, int64_t K, const int8_t* q, const float* d, const float* m, float* y,
                  int64_t N, int64_t valid, float* w, float* tile) {
  std::fill(tile, tile + M * SPAN, 0.0f);
  for (int64_t k0 = 0; k0 < K; k0 += BLOCK) {
    const float* db = d + (k0 / BLOCK) * COLS;
    const float* mb = m + (k0 / BLOCK) * COLS;
    for (int j = 0; j < BLOCK; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(q + (k0 + AHEAD + j) * COLS), _MM_HINT_T0);
      for (int v = 0; v < VECS; ++v)
        simd::store(w + j * SPAN + v * LANES,
                    simd::fma(simd::load(db + v * LANES), simd::codes(q + (k0 + j) * COLS + v * LANES),
                              simd::load(mb + v * LANES)));
    }
    for (int64_t r = 0; r < M; r += MAX_ROWS)
      SCRATCH_PASSES[std::min<int64_t>(MAX_ROWS, M - r)](x + r * K, K, k0, w, tile + r * SPAN);
  }
  for (int64_t r = 0; r < M; ++r) std::copy(tile + r * SPAN, tile + r * SPAN + valid, y + r * N);
}

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
  if (FROM_SCRATCH && M > REGISTER_ROWS) {
    at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
      std::vector<float> w(BLOCK * SPAN), tile(M * SPAN);
      for (int64_t p = p0; p < p1; ++p)
        for (int64_t s = 0; s < SPANS && span_outputs(N, p, s) > 0; ++s) {
          const int64_t at = s * SPAN;
          rebuilt_once(xs, M, K, qs + p * K * COLS + at, ds + p * scales + at, ms + p * scales + at,
                       ys + p * COLS + at, N, span_outputs(N, p, s), w.data(), tile.data());
        }
    });
    return y;
  }
  for_each_pass(P, M, N, [&](int64_t p, int64_t s, int64_t r, int64_t rows, int64_t valid) {
    const int64_t at = s * SPAN;  // the span's first feature within the panel
    PASSES[rows](xs + r * K, K, qs + p * K * COLS + at, ds + p * scales + at, ms + p * scales + at,
                 ys + r * N + p * COLS + at, N, valid);
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("blocks_linear", &blocks_linear, "x @ W^T with W as block-quantized panels, dequantized exactly");
}
