// y[M, N] = x[M, K] @ W^T for a few rows M with Intel AMX, W read from its GGUF block encoding (the "tiles" weight
// layout, heads/kernels/tiles.py): W[n][k] = d[n][k/32] * q[n][k] + m[n][k/32], d and m f16 values, q small integers.
//
// AMX multiplies bf16 tiles and accumulates in fp32. Nothing is rounded to bf16 on the way in:
//  - every code q is an integer of at most 8 bits, exact in bf16;
//  - x is split into three bf16 parts, x = x0 + x1 + x2 exactly (24 significant bits = 3 x 8), so each product
//    x_i * q is exact in fp32 and the tile unit only rounds its fp32 sums, as any fp32 dot product does.
// One tile product covers one GGUF block (32 k) of 16 output columns: C[r][n] = sum_k x[r][k] q[n][k] for the three
// parts; the block's scale and offset are applied in AVX-512 registers: y[r][n] += d[n] C[r][n] + m[n] X[r], with
// X[r] the block's sum of x. So y = sum over blocks of (d * (x . q) + m * sum(x)) = x . W up to fp32 rounding of the
// sums (the weights themselves are never rounded). Rows are independent: a row's result does not depend on M.
//
// Layout (tiles.py arranges it once per Linear): codes [G, K/32, 16, 16, 2] int8, for column group g (16 outputs)
// and block b the B tile in AMX's pair-interleaved form, row i = (q[n][2i], q[n][2i+1]) for n = 0..15; scales and
// offsets [G, K/32, 16] fp32. Columns past N are zero.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

namespace {

constexpr int BLOCK = 32;     // k per GGUF block = k per tile product (16 pairs of bf16)
constexpr int GROUP = 16;     // output columns per tile
constexpr int TILE_ROWS = 16; // rows of x per tile (more rows: one pass per 16)
constexpr int TILE_BYTES = BLOCK * GROUP;  // int8 codes per (group, block)

struct alignas(64) TileConfig {  // AMX palette 1: rows and bytes per row of tmm0..tmm7
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool request_tile_data() {  // Linux hands AMX state to a process only on request (arch_prctl ARCH_REQ_XCOMP_PERM)
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}
const bool TILES_PERMITTED = request_tile_data();

__m512i small_code_table() {  // bf16 bits of 0..15 (vpermw reads entries 0..31; 16..31 unused)
  alignas(64) uint16_t table[32] = {};
  for (int i = 0; i < 16; ++i) {
    const float value = static_cast<float>(i);
    uint32_t bits;
    std::memcpy(&bits, &value, 4);
    table[i] = static_cast<uint16_t>(bits >> 16);  // exact: small integers have at most 4 significant bits
  }
  return _mm512_load_si512(table);
}

// one (group, block) of codes -> its B tile as bf16: 4-bit codes through a table, signed 8-bit ones through fp32
template <bool SMALL_CODES>
inline void codes_to_bf16(const int8_t* q, uint16_t* out, __m512i table) {
  for (int c = 0; c < TILE_BYTES; c += 32) {
    if (SMALL_CODES) {
      const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c)));
      _mm512_store_si512(out + c, _mm512_permutexvar_epi16(words, table));
    } else {
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + c))));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + c + 16))));
      _mm512_store_si512(out + c, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    }
  }
}

struct Operands {
  int64_t M, K, N, G;
  const uint16_t* parts;  // [3, K/32, M, 32] bf16: x's parts, block-major so one block of 16 rows is one A tile
  const float* sums;      // [M, K/32] each block's sum of x
  const int8_t* codes;    // [G, K/32, 512]
  const float* scales;    // [G, K/32, 16]
  const float* offsets;   // [G, K/32, 16]
  float* y;               // [M, N]
};

// Rows row0 .. row0+ROWS of y. Two column groups share each load of x's tiles: tmm0-2 x's parts, tmm3-4 the two
// groups' codes, tmm5-6 their block products. The tile products of block b+1 are issued before the AVX-512 side
// scales block b's, so the two units overlap.
template <int ROWS, bool SMALL_CODES, bool OFFSETS>
void row_pass(const Operands& o, int64_t row0) {
  const int64_t KB = o.K / BLOCK, pairs = (o.G + 1) / 2;
  const __m512i table = small_code_table();
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    TileConfig config;
    for (int t : {0, 1, 2, 5, 6}) config.rows[t] = ROWS, config.colsb[t] = 64;
    for (int t : {3, 4}) config.rows[t] = BLOCK / 2, config.colsb[t] = 64;
    _tile_loadconfig(&config);
    alignas(64) uint16_t b_tiles[2][TILE_BYTES];
    alignas(64) float products[2][2][TILE_ROWS * GROUP];  // [block parity][group][row][column]
    const uint16_t* x_tiles = o.parts + row0 * BLOCK;
    for (int64_t pair = p0; pair < p1; ++pair) {
      const int64_t g = 2 * pair;
      const bool second = g + 1 < o.G;
      auto issue = [&](int64_t b) {  // block b's products of both groups into products[b & 1]
        const int8_t* q = o.codes + (g * KB + b) * TILE_BYTES;
        codes_to_bf16<SMALL_CODES>(q, b_tiles[0], table);
        if (second) codes_to_bf16<SMALL_CODES>(q + KB * TILE_BYTES, b_tiles[1], table);
        _tile_loadd(0, x_tiles + (0 * KB + b) * o.M * BLOCK, 64);
        _tile_loadd(1, x_tiles + (1 * KB + b) * o.M * BLOCK, 64);
        _tile_loadd(2, x_tiles + (2 * KB + b) * o.M * BLOCK, 64);
        _tile_loadd(3, b_tiles[0], 64);
        _tile_zero(5);
        _tile_dpbf16ps(5, 0, 3);
        _tile_dpbf16ps(5, 1, 3);
        _tile_dpbf16ps(5, 2, 3);
        _tile_stored(5, products[b & 1][0], 64);
        if (second) {
          _tile_loadd(4, b_tiles[1], 64);
          _tile_zero(6);
          _tile_dpbf16ps(6, 0, 4);
          _tile_dpbf16ps(6, 1, 4);
          _tile_dpbf16ps(6, 2, 4);
          _tile_stored(6, products[b & 1][1], 64);
        }
      };
      const int groups = second ? 2 : 1;
      __m512 acc[2][ROWS];
      for (int j = 0; j < 2; ++j)
        for (int r = 0; r < ROWS; ++r) acc[j][r] = _mm512_setzero_ps();
      issue(0);
      for (int64_t b = 0; b < KB; ++b) {
        if (b + 1 < KB) issue(b + 1);
        for (int j = 0; j < groups; ++j) {
          const float* c = products[b & 1][j];
          const int64_t at = ((g + j) * KB + b) * GROUP;
          const __m512 d = _mm512_loadu_ps(o.scales + at);
          const __m512 m = _mm512_loadu_ps(o.offsets + at);
          for (int r = 0; r < ROWS; ++r) {
            acc[j][r] = _mm512_fmadd_ps(d, _mm512_load_ps(c + r * GROUP), acc[j][r]);
            if (OFFSETS) acc[j][r] = _mm512_fmadd_ps(m, _mm512_set1_ps(o.sums[(row0 + r) * KB + b]), acc[j][r]);
          }
        }
      }
      for (int j = 0; j < groups; ++j) {
        const int64_t column = (g + j) * GROUP, valid = std::min<int64_t>(GROUP, o.N - column);
        const __mmask16 mask = valid >= GROUP ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
        for (int r = 0; r < ROWS; ++r) _mm512_mask_storeu_ps(o.y + (row0 + r) * o.N + column, mask, acc[j][r]);
      }
    }
    _tile_release();
  });
}

template <bool SMALL_CODES, bool OFFSETS>
void all_rows(const Operands& o) {
  using Pass = void (*)(const Operands&, int64_t);
  static constexpr Pass PASSES[TILE_ROWS + 1] = {
      nullptr, row_pass<1, SMALL_CODES, OFFSETS>, row_pass<2, SMALL_CODES, OFFSETS>, row_pass<3, SMALL_CODES, OFFSETS>,
      row_pass<4, SMALL_CODES, OFFSETS>, row_pass<5, SMALL_CODES, OFFSETS>, row_pass<6, SMALL_CODES, OFFSETS>,
      row_pass<7, SMALL_CODES, OFFSETS>, row_pass<8, SMALL_CODES, OFFSETS>, row_pass<9, SMALL_CODES, OFFSETS>,
      row_pass<10, SMALL_CODES, OFFSETS>, row_pass<11, SMALL_CODES, OFFSETS>, row_pass<12, SMALL_CODES, OFFSETS>,
      row_pass<13, SMALL_CODES, OFFSETS>, row_pass<14, SMALL_CODES, OFFSETS>, row_pass<15, SMALL_CODES, OFFSETS>,
      row_pass<16, SMALL_CODES, OFFSETS>};
  for (int64_t row0 = 0; row0 < o.M; row0 += TILE_ROWS) PASSES[std::min<int64_t>(TILE_ROWS, o.M - row0)](o, row0);
}

}  // namespace

bool available() { return TILES_PERMITTED; }

// x [M, K] fp32 -> (parts [3, K/32, M, 32] bf16 bits as int16 with x = part0 + part1 + part2 exactly,
//                   sums [M, K/32] each block's sum of x, in a fixed order)
std::vector<torch::Tensor> split_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat, "x: contiguous fp32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), KB = K / BLOCK;
  TORCH_CHECK(K % BLOCK == 0, "K must be a multiple of 32");
  auto parts = torch::empty({3, KB, M, BLOCK}, x.options().dtype(torch::kInt16));
  auto sums = torch::empty({M, KB}, x.options());
  const float* xs = x.data_ptr<float>();
  uint16_t* ps = reinterpret_cast<uint16_t*>(parts.data_ptr<int16_t>());
  float* ss = sums.data_ptr<float>();
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < KB; ++b) {
      const __m512 lo = _mm512_loadu_ps(xs + r * K + b * BLOCK), hi = _mm512_loadu_ps(xs + r * K + b * BLOCK + 16);
      ss[r * KB + b] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
      __m512 rest[2] = {lo, hi};
      for (int p = 0; p < 3; ++p)
        for (int h = 0; h < 2; ++h) {
          const __m256bh part = _mm512_cvtneps_pbh(rest[h]);  // nearest bf16; the remainder is exact in fp32
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(ps + ((p * KB + b) * M + r) * BLOCK + h * 16),
                              reinterpret_cast<__m256i>(part));
          rest[h] = _mm512_sub_ps(rest[h], _mm512_cvtpbh_ps(part));
        }
    }
  return {parts, sums};
}

torch::Tensor tiles_linear(const torch::Tensor& parts, const torch::Tensor& sums, const torch::Tensor& codes,
                           const torch::Tensor& scales, const torch::Tensor& offsets, int64_t N, bool small_codes,
                           bool with_offsets) {
  TORCH_CHECK(TILES_PERMITTED, "the kernel was not granted AMX tile state");
  TORCH_CHECK(parts.dim() == 4 && parts.size(0) == 3 && parts.size(3) == BLOCK && parts.is_contiguous(), "parts: from split_rows");
  const int64_t KB = parts.size(1), M = parts.size(2), K = KB * BLOCK;
  TORCH_CHECK(codes.dim() == 5 && codes.is_contiguous() && codes.scalar_type() == torch::kChar && codes.size(1) == KB &&
              codes.size(2) == BLOCK / 2 && codes.size(3) == GROUP && codes.size(4) == 2, "codes: contiguous int8 [G, K/32, 16, 16, 2]");
  const int64_t G = codes.size(0);
  for (const auto* s : {&scales, &offsets})
    TORCH_CHECK(s->is_contiguous() && s->scalar_type() == torch::kFloat && s->dim() == 3 && s->size(0) == G &&
                s->size(1) == KB && s->size(2) == GROUP, "scales, offsets: contiguous fp32 [G, K/32, 16]");
  TORCH_CHECK(N > GROUP * (G - 1) && N <= GROUP * G, "N does not match the column groups");
  auto y = torch::empty({M, N}, sums.options());
  const Operands o{M, K, N, G, reinterpret_cast<const uint16_t*>(parts.data_ptr<int16_t>()), sums.data_ptr<float>(),
                   codes.data_ptr<int8_t>(), scales.data_ptr<float>(), offsets.data_ptr<float>(), y.data_ptr<float>()};
  if (small_codes) with_offsets ? all_rows<true, true>(o) : all_rows<true, false>(o);
  else with_offsets ? all_rows<false, true>(o) : all_rows<false, false>(o);
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether this process may use AMX tiles");
  m.def("split_rows", &split_rows, "x -> its three bf16 parts per block and each block's sum");
  m.def("tiles_linear", &tiles_linear, "x @ W^T with AMX, W as GGUF blocks (codes, scales, offsets)");
}
