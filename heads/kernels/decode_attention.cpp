// One decode step of grouped-query attention on a CPU, AVX-512 or AVX2 (heads/kernels/decode_attention.py).
//
// q [B, Hkv, G, D]: the G query heads that share each key/value head, one query token per row;
// k, v [B, Hkv, T, D]: the cached keys and values (bf16 or fp32, rows of D contiguous, any batch/head strides:
// views into a cache with spare room); mask [B, T] (true: attend) or none. -> out [B, Hkv, G, D], q's dtype.
//
// Why not PyTorch's SDPA: its CPU flash kernel tiles the query rows, and a decode step has G (3 for SmolLM2)
// of them per key/value head, so most of each tile is padding and the bf16 rows are converted again per tile;
// at batch 128 and a few hundred cached tokens it ran ~2.5x slower than reading K and V once from memory.
// Here each (row, key/value head) is one task: for every query head, the scores over the cached tokens
// (fp32 dot products of the converted key rows, K stays in L2 for the next query head), a softmax, and the
// probability-weighted sum of the value rows; fp32 throughout, rounded once to q's dtype at the end.
// Vectors are simd.h's: 16 lanes with AVX-512, 8 with AVX2.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <limits>
#include <vector>

#include "simd.h"

namespace {

using simd::LANES;
using simd::Vec;

// exp(x) for x <= 0 (scores minus their max), ~2 ulp: x = n ln2 + r, exp(r) by a degree-6 polynomial, times
// 2^n. -inf (a masked score) gives exactly 0.
inline Vec exp_nonpositive(Vec x) {
  const Vec given = x;
  x = simd::max(x, simd::broadcast(-87.0f));
  const Vec n = simd::round_nearest(simd::mul(x, simd::broadcast(1.44269504088896341f)));
  Vec r = simd::fma(n, simd::broadcast(-0.693145751953125f), x);
  r = simd::fma(n, simd::broadcast(-1.428606765330187e-06f), r);
  Vec p = simd::broadcast(1.0f / 720);
  p = simd::fma(p, r, simd::broadcast(1.0f / 120));
  p = simd::fma(p, r, simd::broadcast(1.0f / 24));
  p = simd::fma(p, r, simd::broadcast(1.0f / 6));
  p = simd::fma(p, r, simd::broadcast(0.5f));
  p = simd::fma(p, r, simd::broadcast(1.0f));
  p = simd::fma(p, r, simd::broadcast(1.0f));
  return simd::zero_where_minus_inf(given, simd::times_pow2(p, n));
}

// scores[t] = scale * q . k[t] (-inf where masked); returns their max
template <int DV, typename T>
float scores_of(const T* q, const T* k, int64_t T_len, const bool* mask, float scale, float* scores) {
  Vec qv[DV];
  for (int v = 0; v < DV; ++v) qv[v] = simd::mul(simd::load(q + LANES * v), simd::broadcast(scale));
  float best = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < T_len; ++t) {
    if (mask && !mask[t]) {
      scores[t] = -std::numeric_limits<float>::infinity();
      continue;
    }
    const T* row = k + t * LANES * DV;
    Vec acc = simd::mul(qv[0], simd::load(row));
    for (int v = 1; v < DV; ++v) acc = simd::fma(qv[v], simd::load(row + LANES * v), acc);
    const float s = simd::sum(acc);
    scores[t] = s;
    best = s > best ? s : best;
  }
  return best;
}

// scores -> exp(scores - best) in place; returns their sum
inline float exponentiate(float* scores, int64_t T_len, float best) {
  const Vec shift = simd::broadcast(best);
  const float minus_inf = -std::numeric_limits<float>::infinity();
  Vec total = simd::zero();
  for (int64_t t = 0; t < T_len; t += LANES) {
    // past the end: -inf, whose exp is 0, so the sum takes nothing from there
    const int64_t left = T_len - t;
    Vec x = left >= LANES ? simd::load(scores + t) : simd::load_first(scores + t, left);
    if (left < LANES) {
      alignas(64) float padded[LANES];
      simd::store(padded, x);
      for (int64_t i = left; i < LANES; ++i) padded[i] = minus_inf;
      x = simd::load(padded);
    }
    const Vec e = exp_nonpositive(simd::sub(x, shift));
    simd::store_first(scores + t, e, left);
    total = simd::add(total, e);
  }
  return simd::sum(total);
}

// out = sum_t weights[t] v[t] / total
template <int DV, typename T>
void weighted_values(const float* weights, const T* v, int64_t T_len, float total, T* out) {
  Vec acc[DV];
  for (int i = 0; i < DV; ++i) acc[i] = simd::zero();
  for (int64_t t = 0; t < T_len; ++t) {
    if (weights[t] == 0.0f) continue;  // masked (left padding)
    const Vec w = simd::broadcast(weights[t]);
    const T* row = v + t * LANES * DV;
    for (int i = 0; i < DV; ++i) acc[i] = simd::fma(w, simd::load(row + LANES * i), acc[i]);
  }
  const Vec norm = simd::broadcast(1.0f / total);
  for (int i = 0; i < DV; ++i) simd::store(out + LANES * i, simd::mul(acc[i], norm));
}

template <int DV, typename T>
void attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const bool* mask,
            double scale, torch::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), T_len = k.size(2), D = LANES * DV;
  const T* qs = q.data_ptr<T>();
  const T* ks = k.data_ptr<T>();
  const T* vs = v.data_ptr<T>();
  T* os = out.data_ptr<T>();
  const int64_t kb = k.stride(0), kh = k.stride(1), vb = v.stride(0), vh = v.stride(1);
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(T_len);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / H, h = task % H;
      const T* key = ks + b * kb + h * kh;
      const T* value = vs + b * vb + h * vh;
      const bool* row_mask = mask ? mask + b * T_len : nullptr;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t at = (task * G + g) * D;
        const float best = scores_of<DV>(qs + at, key, T_len, row_mask, static_cast<float>(scale), scores.data());
        const float total = exponentiate(scores.data(), T_len, best);
        weighted_values<DV>(scores.data(), value, T_len, total, os + at);
      }
    }
  });
}

template <typename T>
void dispatch_width(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const bool* mask,
                    double scale, torch::Tensor& out) {
  switch (q.size(3)) {
    case 64: return attend<64 / LANES, T>(q, k, v, mask, scale, out);
    case 128: return attend<128 / LANES, T>(q, k, v, mask, scale, out);
    default: TORCH_CHECK(false, "head dim must be 64 or 128");
  }
}

}  // namespace

torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const c10::optional<torch::Tensor>& mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && q.is_contiguous(), "q: contiguous [B, Hkv, G, D]");
  TORCH_CHECK(k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes(), "k, v: [B, Hkv, T, D] alike");
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(1) == q.size(1) && k.size(3) == q.size(3), "k does not match q");
  TORCH_CHECK(k.stride(3) == 1 && k.stride(2) == k.size(3) && v.stride(3) == 1 && v.stride(2) == v.size(3),
              "k, v: rows of D contiguous");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "q, k, v: one dtype");
  const bool* mask_data = nullptr;
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == torch::kBool && mask->is_contiguous() && mask->dim() == 2 &&
                    mask->size(0) == q.size(0) && mask->size(1) == k.size(2),
                "mask: contiguous bool [B, T]");
    mask_data = mask->data_ptr<bool>();
  }
  auto out = torch::empty_like(q);
  if (q.scalar_type() == torch::kBFloat16) {
    dispatch_width<at::BFloat16>(q, k, v, mask_data, scale, out);
  } else {
    TORCH_CHECK(q.scalar_type() == torch::kFloat, "q, k, v: bf16 or fp32");
    dispatch_width<float>(q, k, v, mask_data, scale, out);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "one decode step of grouped-query attention");
}
