// The vector operations the CPU kernels use, for the instruction set each is compiled for (heads/kernels/panel.py:
// -mavx512f where PyTorch runs AVX-512, else -mavx2 -mfma): Vec is LANES fp32 lanes, a zmm or a ymm register.
// The kernels are written once against these, in LANES-wide steps.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <limits>

#include <c10/util/BFloat16.h>

namespace simd {

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int LANES = 16;
constexpr int REGISTERS = 32;
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec broadcast(float x) { return _mm512_set1_ps(x); }
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec load(const c10::BFloat16* p) {  // bf16 -> fp32: the bf16 bits are the float's high half
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline float sum(Vec v) { return _mm512_reduce_add_ps(v); }
inline Vec codes(const int8_t* q) {  // LANES int8 codes -> floats
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
}
inline __mmask16 first(int64_t n) { return n >= LANES ? 0xffff : static_cast<__mmask16>((1u << n) - 1); }
inline Vec load_first(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(first(n), p); }  // 0 past n
inline void store_first(float* p, Vec v, int64_t n) {  // the first min(n, LANES) lanes
  if (n >= LANES) _mm512_storeu_ps(p, v);
  else _mm512_mask_storeu_ps(p, first(n), v);
}
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline void store(c10::BFloat16* p, Vec v) {  // fp32 -> bf16, round to nearest even (as torch's .to())
  __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}
inline Vec round_nearest(Vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec times_pow2(Vec p, Vec n) { return _mm512_scalef_ps(p, n); }  // p * 2^n, n integral
inline Vec zero_where_minus_inf(Vec x, Vec y) {  // y, with 0 in the lanes where x is -inf
  const __mmask16 live = _mm512_cmp_ps_mask(x, broadcast(-std::numeric_limits<float>::infinity()), _CMP_NEQ_OQ);
  return _mm512_maskz_mov_ps(live, y);
}
inline Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
#elif defined(__AVX2__) && defined(__FMA__)
using Vec = __m256;
constexpr int LANES = 8;
constexpr int REGISTERS = 16;
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec broadcast(float x) { return _mm256_set1_ps(x); }
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec load(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline float sum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline Vec codes(const int8_t* q) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
}
inline __m256i first(int64_t n) {  // all ones in the first min(n, LANES) lanes
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n < LANES ? n : LANES)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline Vec load_first(const float* p, int64_t n) { return _mm256_maskload_ps(p, first(n)); }
inline void store_first(float* p, Vec v, int64_t n) {
  if (n >= LANES) _mm256_storeu_ps(p, v);
  else _mm256_maskstore_ps(p, first(n), v);
}
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline void store(c10::BFloat16* p, Vec v) {
  __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  bits = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
  // 8 values of 16 bits in 32-bit lanes -> 8 halves: pack within each 128-bit lane, then join the lanes' halves
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0b1000);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline Vec round_nearest(Vec x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec times_pow2(Vec p, Vec n) {  // p * 2^n for integral n in [-126, 127]: 2^n built in the exponent bits
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
}
inline Vec zero_where_minus_inf(Vec x, Vec y) {
  const Vec live = _mm256_cmp_ps(x, broadcast(-std::numeric_limits<float>::infinity()), _CMP_NEQ_OQ);
  return _mm256_and_ps(live, y);
}
inline Vec max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
#else
#error "the CPU kernels need AVX-512 or AVX2 with FMA"
#endif

}  // namespace simd
