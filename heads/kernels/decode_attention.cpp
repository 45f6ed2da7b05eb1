// One decode step of grouped-query attention on a CPU, AVX-512 (heads/kernels/decode_attention.py).
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
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const at::BFloat16* p) {  // 16 bf16 -> fp32: the bf16 bits are the float's high half
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }

inline void store16(at::BFloat16* p, __m512 x) {  // fp32 -> bf16, round to nearest even (as torch's .to())
  __m512i bits = _mm512_castps_si512(x);
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}

// exp(x) for x <= 0 (scores minus their max), ~2 ulp: x = n ln2 + r, exp(r) by a degree-6 polynomial, 2^n by
// scalef. -inf (a masked score) gives exactly 0.
inline __m512 exp_nonpositive(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                                            _CMP_NEQ_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

// scores[t] = scale * q . k[t] (-inf where masked); returns their max
template <int DV, typename T>
float scores_of(const T* q, const T* k, int64_t T_len, const bool* mask, float scale, float* scores) {
  __m512 qv[DV];
  for (int v = 0; v < DV; ++v) qv[v] = _mm512_mul_ps(load16(q + 16 * v), _mm512_set1_ps(scale));
  float best = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < T_len; ++t) {
    if (mask && !mask[t]) {
      scores[t] = -std::numeric_limits<float>::infinity();
      continue;
    }
    const T* row = k + t * 16 * DV;
    __m512 acc = _mm512_mul_ps(qv[0], load16(row));
    for (int v = 1; v < DV; ++v) acc = _mm512_fmadd_ps(qv[v], load16(row + 16 * v), acc);
    const float s = _mm512_reduce_add_ps(acc);
    scores[t] = s;
    best = s > best ? s : best;
  }
  return best;
}

// scores -> exp(scores - best) in place; returns their sum
inline float exponentiate(float* scores, int64_t T_len, float best) {
  const __m512 shift = _mm512_set1_ps(best);
  __m512 total = _mm512_setzero_ps();
  for (int64_t t = 0; t < T_len; t += 16) {
    const __mmask16 in = T_len - t >= 16 ? 0xffff : static_cast<__mmask16>((1u << (T_len - t)) - 1);
    __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(in, scores + t), shift));
    e = _mm512_maskz_mov_ps(in, e);
    _mm512_mask_storeu_ps(scores + t, in, e);
    total = _mm512_add_ps(total, e);
  }
  return _mm512_reduce_add_ps(total);
}

// out = sum_t weights[t] v[t] / total
template <int DV, typename T>
void weighted_values(const float* weights, const T* v, int64_t T_len, float total, T* out) {
  __m512 acc[DV];
  for (int i = 0; i < DV; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t t = 0; t < T_len; ++t) {
    if (weights[t] == 0.0f) continue;  // masked (left padding)
    const __m512 w = _mm512_set1_ps(weights[t]);
    const T* row = v + t * 16 * DV;
    for (int i = 0; i < DV; ++i) acc[i] = _mm512_fmadd_ps(w, load16(row + 16 * i), acc[i]);
  }
  const __m512 norm = _mm512_set1_ps(1.0f / total);
  for (int i = 0; i < DV; ++i) store16(out + 16 * i, _mm512_mul_ps(acc[i], norm));
}

template <int DV, typename T>
void attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const bool* mask,
            double scale, torch::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), T_len = k.size(2), D = 16 * DV;
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
    case 64: return attend<4, T>(q, k, v, mask, scale, out);
    case 128: return attend<8, T>(q, k, v, mask, scale, out);
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
