// bfloat16 matrix products at a few rows on AMX tiles (Sapphire Rapids and newer), for CPUs
// that report AMX-TILE and AMX-BF16 and whose kernel grants this process the tile state.
//
// `vdpbf16ps` issues half a vector per cycle here, so the AVX-512 kernel is compute-bound
// from about 4 rows; one `tdpbf16ps` multiplies a 16 x 32 weight tile into up to 16 rows at
// once, so the same pass stays bound by reading the weights up to 16 rows (more rows take
// chunks of 16, each block of weight rows re-read from L2). The 16 rows of a weight tile are
// prefetched a few blocks ahead (`prefetch_rows`): the hardware prefetchers alone left each
// tile load waiting on memory.
//
// The product is computed transposed, C[n, m] = sum_k W[n, k] X[m, k]: the weight tile (the
// A operand: 16 rows of 32 values, 64 bytes each) loads straight from the row-major weight
// with its row stride, and the activations are the B operand, packed once per call in the
// pair-interleaved order the instruction reads (`pack_x`). Two accumulator tiles take the
// even and the odd blocks of 32 so consecutive multiplies do not wait on each other.

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cpuid.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "vec_exp.h"

#if SF_HAVE_AMX
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c,amx-tile,amx-bf16,amx-int8")

namespace sf {
namespace amx {
namespace {

#include "amx_tiles.h"

// tiles: 0, 1 the accumulators (even and odd blocks), 2, 3 the activations, 4, 5 the weights
void configure(int mc) {
  TileConfig cfg;
  for (int t = 0; t < 6; ++t) cfg.rows[t] = 16;
  for (int t = 0; t < 4; ++t) cfg.colsb[t] = static_cast<uint16_t>(4 * mc);
  cfg.colsb[4] = cfg.colsb[5] = 64;
  load_config(cfg);
}

// Software prefetch distance, in blocks of 32 values of every row in a block of 16 rows:
// without it a tile load waits for its 16 rows' lines from memory and the tiles read the
// weights at about 20 GB/s whatever the row count; 4 blocks (256 bytes a row) ahead measured
// fastest (1.6-1.8x at 8-16 rows; 2, 6, 8 and 12 measured slower or no better).
constexpr int kPrefetchBlocks = 4;

// the line `pf` blocks ahead of block b on row r of the weight block at wb, continuing on
// the next block of 16 rows past the row's end
inline void prefetch_rows(const char* wb, int64_t stride, int64_t blocks, int64_t b, int pf,
                          int64_t bytes_per_block) {
  int64_t at = b + pf;
  const char* base = wb;
  if (at >= blocks) {
    at -= blocks;
    base += 16 * stride;
  }
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r)
    _mm_prefetch(base + r * stride + at * bytes_per_block, _MM_HINT_T0);
}



// One block of 16 weight rows against one chunk of `mc` activation rows.
// `rows` of the chunk's `mc` (packed) rows are written out
void block(const uint32_t* xp, int rows, int mc, int64_t k, const uint16_t* w, int64_t ldw,
           const float* bias, int64_t n, int64_t m0, Out out) {
  const int64_t stride = ldw * 2;  // bytes per weight row
  const int64_t bstride = 4 * mc;
  const int64_t blocks = k / 32;
  const char* wb = reinterpret_cast<const char*>(w + n * ldw);
  _tile_zero(0);
  _tile_zero(1);
  int64_t b = 0;
  for (; b + 2 <= blocks; b += 2) {
    prefetch_rows(wb, stride, blocks, b, kPrefetchBlocks, 64);
    prefetch_rows(wb, stride, blocks, b + 1, kPrefetchBlocks, 64);
    SF_TILE_LOADD(4, wb + b * 64, stride);
    SF_TILE_LOADD(2, xp + b * 16 * mc, bstride);
    SF_TILE_LOADD(5, wb + (b + 1) * 64, stride);
    SF_TILE_LOADD(3, xp + (b + 1) * 16 * mc, bstride);
    _tile_dpbf16ps(0, 4, 2);
    _tile_dpbf16ps(1, 5, 3);
  }
  if (b < blocks) {
    SF_TILE_LOADD(4, wb + b * 64, stride);
    SF_TILE_LOADD(2, xp + b * 16 * mc, bstride);
    _tile_dpbf16ps(0, 4, 2);
  }
  alignas(64) float c0[16][16];
  alignas(64) float c1[16][16];
  SF_TILE_STORED(0, c0, 64);
  SF_TILE_STORED(1, c1, 64);
  __m512 r[16];
#pragma GCC unroll 16
  for (int w = 0; w < 16; ++w) r[w] = _mm512_add_ps(_mm512_load_ps(c0[w]), _mm512_load_ps(c1[w]));
  write_block(r, rows, bias, n, m0, out);
}

}  // namespace

bool request_tiles() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool tile = (d >> 24) & 1u, bf16 = (d >> 22) & 1u, int8 = (d >> 25) & 1u;
  if (!tile || !bf16 || !int8) return false;
  // Linux hands out the tile data state per process, on request (ARCH_REQ_XCOMP_PERM)
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

int64_t chunk_rows(int64_t m) { return m <= 16 ? m : 16; }

int64_t packed_size(int64_t m, int64_t k) {
  const int64_t mc = chunk_rows(m);
  return (m + mc - 1) / mc * mc * (k / 2);
}

void pack_x(const uint16_t* x, int64_t m, int64_t k, uint32_t* xp) {
  const int64_t mc = chunk_rows(m);
  for (int64_t m0 = 0; m0 < m; m0 += mc) {
    uint32_t* dst = xp + m0 * (k / 2);
    for (int64_t p = 0; p < k / 2; ++p)
      for (int64_t i = 0; i < mc; ++i) {
        uint32_t pair = 0;  // rows past m (a last chunk of fewer than 16) multiply as zeros
        if (m0 + i < m) std::memcpy(&pair, x + (m0 + i) * k + 2 * p, 4);
        dst[p * mc + i] = pair;
      }
  }
}

void gemv_bf16(const uint32_t* xp, int64_t m, int64_t k, const uint16_t* w, int64_t ldw,
               const float* bias, int64_t n0, int64_t n1, Out out) {
  const int mc = static_cast<int>(chunk_rows(m));
  configure(mc);
  for (int64_t n = n0; n + 16 <= n1; n += 16)
    for (int64_t m0 = 0; m0 < m; m0 += mc)
      block(xp + m0 * (k / 2), static_cast<int>(std::min<int64_t>(mc, m - m0)), mc, k, w, ldw,
            bias, n, m0, out);
  _tile_release();
}

// ---- int8 weights against activations quantised to blocks of 32 (Q8Act) -----------------
//
// Per block of 32 inputs, one `tdpbssd` gives the integer dot products of 16 weight rows with
// every activation row; the block's scales (the activation's per row, the weight's per row or
// per block) are applied to those sums in AVX-512 lanes, one lane per activation row, as the
// AVX-512 kernel applies them per block. Four sum tiles hold two pairs of blocks: a pair is
// multiplied while the pair before it is stored and scaled.

namespace {

// tiles: 0-3 the blocks' integer sums (two pairs of blocks in flight), 4, 5 the weights (16
// rows x 32 bytes), 6, 7 the activations (8 rows of 4-byte groups, one group per activation
// row)
void configure_q8(int mc) {
  TileConfig cfg;
  for (int t = 0; t < 6; ++t) cfg.rows[t] = 16;
  cfg.rows[6] = cfg.rows[7] = 8;
  for (int t = 0; t < 4; ++t) cfg.colsb[t] = static_cast<uint16_t>(4 * mc);
  cfg.colsb[4] = cfg.colsb[5] = 32;
  cfg.colsb[6] = cfg.colsb[7] = static_cast<uint16_t>(4 * mc);
  load_config(cfg);
}

// acc[r] += float(sums[r]) * scale of row r's block b, over the activation rows' lanes; the
// weight's block scales (`bsf`, Q8_0's) already in float32, a row of `row_stride` a weight row
// (one broadcast from memory each, not a float16 load, convert and broadcast)
inline void scale_block(const int32_t (&sums)[16][16], __m512 (&acc)[16], __m512 ad,
                        const float* bsf, int64_t row_stride, int64_t b) {
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) {
    const __m512 v = _mm512_cvtepi32_ps(_mm512_load_si512(sums[r]));
    const __m512 sc = bsf ? _mm512_mul_ps(ad, _mm512_set1_ps(bsf[r * row_stride + b])) : ad;
    acc[r] = _mm512_fmadd_ps(v, sc, acc[r]);
  }
}

// 16 rows of `blocks` float16 values to float32 in the same order (exact)
inline void widen_rows(const uint16_t* h, int64_t blocks, float* f) {
  const int64_t n = 16 * blocks;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(
        f + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i))));
  for (; i < n; ++i) f[i] = _cvtsh_ss(h[i]);
}

// Pairs of blocks b, b + 1 (b = 0, 2, 4, ...) alternate between the sum tiles 0, 1 and 2, 3:
// pair p is issued before pair p - 1 is drained, so the tiles multiply while the vector units
// scale (a pair drained right after its own multiply waited for it). `issue(hi, b)` and
// `drain(hi, b)` take the pair at block b in tiles 2, 3 (hi) or 0, 1.
template <class Issue, class Drain>
inline void pairs_in_flight(int64_t pairs, Issue issue, Drain drain) {
  if (pairs == 0) return;
  issue(false, 0);
  for (int64_t p = 1; p < pairs; ++p) {
    const bool hi = p % 2;
    issue(hi, 2 * p);
    drain(!hi, 2 * (p - 1));
  }
  drain((pairs - 1) % 2 == 1, 2 * (pairs - 1));
}

// The GCC tile intrinsics name their tile in the instruction text, so each pair of sum tiles
// gets its own copy of these two (a macro, not a template): `issue_q8_S0S1` multiplies blocks
// b and b + 1 into the sum tiles S0 and S1 (one line a row: two blocks of 32 bytes),
// `drain_q8_S0S1` scales their sums into acc.
#define SF_Q8_PAIR(S0, S1) \
inline void issue_q8_##S0##S1(const char* wb, int64_t k, const uint32_t* xp, int mc, int64_t blocks, \
                     int64_t b) { \
  prefetch_rows(wb, k, blocks, b, 2 * kPrefetchBlocks, 32); \
  const int64_t bstride = 4 * mc; \
  _tile_zero(S0); \
  _tile_zero(S1); \
  SF_TILE_LOADD(4, wb + b * 32, k); \
  SF_TILE_LOADD(6, xp + b * 8 * mc, bstride); \
  SF_TILE_LOADD(5, wb + (b + 1) * 32, k); \
  SF_TILE_LOADD(7, xp + (b + 1) * 8 * mc, bstride); \
  _tile_dpbssd(S0, 4, 6); \
  _tile_dpbssd(S1, 5, 7); \
} \
 \
inline void drain_q8_##S0##S1(__m512 (&acc)[16], const float* ad, const float* bs, int64_t blocks, \
                     int64_t b) { \
  alignas(64) int32_t s0[16][16]; \
  alignas(64) int32_t s1[16][16]; \
  SF_TILE_STORED(S0, s0, 64); \
  SF_TILE_STORED(S1, s1, 64); \
  scale_block(s0, acc, _mm512_loadu_ps(ad + b * 16), bs, blocks, b); \
  scale_block(s1, acc, _mm512_loadu_ps(ad + (b + 1) * 16), bs, blocks, b + 1); \
}
SF_Q8_PAIR(0, 1)
SF_Q8_PAIR(2, 3)
#undef SF_Q8_PAIR

void block_q8(const uint32_t* xp, const float* ad, int rows, int mc, int64_t k, const int8_t* w,
              const float* scale, const float* bs, const float* bias, int64_t n, int64_t m0,
              Out out) {
  const int64_t blocks = k / 32;
  const char* wb = reinterpret_cast<const char*>(w + n * k);
  __m512 acc[16];
  for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
  pairs_in_flight(
      blocks / 2,
      [&](bool hi, int64_t b) {
        if (hi)
          issue_q8_23(wb, k, xp, mc, blocks, b);
        else
          issue_q8_01(wb, k, xp, mc, blocks, b);
      },
      [&](bool hi, int64_t b) {
        if (hi)
          drain_q8_23(acc, ad, bs, blocks, b);
        else
          drain_q8_01(acc, ad, bs, blocks, b);
      });
  if (blocks % 2) {
    const int64_t b = blocks - 1;
    alignas(64) int32_t s0[16][16];
    _tile_zero(0);
    SF_TILE_LOADD(4, wb + b * 32, k);
    SF_TILE_LOADD(6, xp + b * 8 * mc, 4 * mc);
    _tile_dpbssd(0, 4, 6);
    SF_TILE_STORED(0, s0, 64);
    scale_block(s0, acc, _mm512_loadu_ps(ad + b * 16), bs, blocks, b);
  }
  if (scale)
    for (int r = 0; r < 16; ++r) acc[r] = _mm512_mul_ps(acc[r], _mm512_set1_ps(scale[n + r]));
  write_block(acc, rows, bias, n, m0, out);
}

}  // namespace

int64_t packed_q8_size(int64_t m, int64_t k) {
  const int64_t mc = chunk_rows(m);
  return (m + mc - 1) / mc * mc * (k / 4);
}

int64_t packed_q8_scales(int64_t m, int64_t k) {
  const int64_t mc = chunk_rows(m);
  return (m + mc - 1) / mc * (k / 32) * 16;
}

void pack_q8(const Q8Act& a, uint32_t* xp, float* ad) {
  const int64_t m = a.m, k = a.k, mc = chunk_rows(m), blocks = k / 32;
  for (int64_t m0 = 0; m0 < m; m0 += mc) {
    uint32_t* dst = xp + m0 * (k / 4);
    float* sc = ad + m0 / mc * blocks * 16;
    for (int64_t g = 0; g < k / 4; ++g)
      for (int64_t i = 0; i < mc; ++i) {
        uint32_t four = 0;  // rows past m multiply as zeros
        if (m0 + i < m) std::memcpy(&four, a.q + (m0 + i) * a.kp + 4 * g, 4);
        dst[g * mc + i] = four;
      }
    for (int64_t b = 0; b < blocks; ++b)
      for (int64_t i = 0; i < 16; ++i)
        sc[b * 16 + i] = (i < mc && m0 + i < m) ? a.d[(m0 + i) * (a.kp / 32) + b] : 0.0f;
  }
}

void gemv_q8(const uint32_t* xp, const float* ad, int64_t m, int64_t k, const int8_t* w,
             const float* scale, const uint16_t* bscale, const float* bias, int64_t n0,
             int64_t n1, Out out) {
  const int mc = static_cast<int>(chunk_rows(m));
  const int64_t blocks = k / 32;
  // a block of 16 rows' scales in float32, once per block (each is used once per chunk)
  thread_local std::vector<float> widened;
  scratch(widened, 16 * blocks);
  configure_q8(mc);
  for (int64_t n = n0; n + 16 <= n1; n += 16) {
    if (bscale) widen_rows(bscale + n * blocks, blocks, widened.data());
    for (int64_t m0 = 0; m0 < m; m0 += mc)
      block_q8(xp + m0 * (k / 4), ad + m0 / mc * blocks * 16,
               static_cast<int>(std::min<int64_t>(mc, m - m0)), mc, k, w, scale,
               bscale ? widened.data() : nullptr, bias, n, m0, out);
  }
  _tile_release();
}

// ---- int4 codes against activations quantised to blocks of 32 (Q8Act) ------------------
//
// One group of 32 weights per block, as gemv_q4 reads them: w = code * scale + offset, so a
// row's block contributes d_x * (scale * dot(codes, x codes) + offset * sum(x codes)).
// Unlike the int8 tiles above, the product is not transposed here:
// C[m, n] = sum_k X[m, k] W[n, k] with the quantised activation rows as the A operand, loaded
// as they are (one group of 32 bytes a row, the rows' own stride), and 16 weight rows' codes as
// the B operand, unpacked into the order `tdpbsud` reads (8 rows of 64 bytes: for each group
// of 4 values, those 4 values of each of the 16 weight rows). A group's sums then come out as
// one vector per activation row with a lane per weight row, so the scales are applied once per
// activation row and group (mc vectors, not 16: at 4-8 rows the epilogue's work is a quarter
// to a half), the block's float16 scales and offsets are gathered into the same lanes (one
// dword a row serves two groups), and the activations need no packing. int8 weights keep the
// transposed product: they load into a tile as they are, while int4 codes are unpacked anyway,
// so putting them in the B operand's order costs only the permutes. Against the transposed
// int4 kernel this replaced (3072 x 576, from memory, two threads, alternating rounds): 4
// rows 0.78x the AVX-512 kernel's time, 5 rows 0.70x, 8 rows 0.79x and 16 rows 0.96x the
// old tiles'.

namespace {

// tiles: 0-3 the groups' integer sums (two pairs of groups in flight), 4, 5 the codes (8 rows
// of 64 bytes), 6, 7 the activations (mc rows of 32 bytes)
void configure_q4(int mc) {
  TileConfig cfg;
  for (int t = 0; t < 4; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(mc);
    cfg.colsb[t] = 64;
  }
  cfg.rows[4] = cfg.rows[5] = 8;
  cfg.colsb[4] = cfg.colsb[5] = 64;
  cfg.rows[6] = cfg.rows[7] = static_cast<uint8_t>(mc);
  cfg.colsb[6] = cfg.colsb[7] = 32;
  load_config(cfg);
}

// two groups' codes of 16 weight rows in the B operand's order
struct alignas(64) Q4Unpacked {
  uint8_t g[2][8][64];
};

// The codes of groups b and b + 1 of 16 rows (32 bytes a row; `one`: group b alone, the last of
// an odd count, whose following 16 bytes are not read) into u. Row n's 32 bytes are 8 dwords:
// dword j < 4 holds values 4j .. 4j + 3 of group b in its low nibbles and 16 + 4j .. 16 + 4j + 3
// in its high ones, dwords 4-7 the same for group b + 1. Three rounds of two-source dword
// permutations take the 16 x 8 dwords to t[j] = dword j of rows 0-15 in order; the B operand's
// row kk < 4 of group b is then t[kk]'s low nibbles and row 4 + kk its high nibbles.
inline void unpack_pair(const uint8_t* cb, int64_t row_bytes, int64_t b, bool one,
                        Q4Unpacked& u) {
  // round 1, from rows 4q, 4q + 1 (z[2q]) and 4q + 2, 4q + 3 (z[2q + 1]): lane 4 (j - 4s) + r
  // holds dword j (4s <= j < 4s + 4) of row 4q + r
  static const __m512i idx1[2] = {
      _mm512_setr_epi32(0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27),
      _mm512_setr_epi32(4, 12, 20, 28, 5, 13, 21, 29, 6, 14, 22, 30, 7, 15, 23, 31)};
  // round 2, from rows 8h .. 8h + 3 and 8h + 4 .. 8h + 7: lane 8 e + r' holds dword 4s + 2t + e
  // of row 8h + r'
  static const __m512i idx2[2] = {
      _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23),
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31)};
  // round 3, from rows 0-7 and 8-15: lane n holds dword 4s + 2t + e of row n
  static const __m512i idx3[2] = {
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),
      _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31)};
  const __mmask8 keep = one ? 0x0f : 0xff;
  __m512i z[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    const uint8_t* p = cb + 2 * i * row_bytes + b * 16;
    z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_maskz_loadu_epi32(keep, p)),
                              _mm256_maskz_loadu_epi32(keep, p + row_bytes), 1);
  }
  __m512i y[4][2];
#pragma GCC unroll 4
  for (int q = 0; q < 4; ++q)
    for (int s = 0; s < 2; ++s)
      y[q][s] = _mm512_permutex2var_epi32(z[2 * q], idx1[s], z[2 * q + 1]);
  __m512i x[2][2][2];
  for (int h = 0; h < 2; ++h)
    for (int s = 0; s < 2; ++s)
      for (int t = 0; t < 2; ++t)
        x[h][s][t] = _mm512_permutex2var_epi32(y[2 * h][s], idx2[t], y[2 * h + 1][s]);
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int s = 0; s < (one ? 1 : 2); ++s)
    for (int t = 0; t < 2; ++t)
      for (int e = 0; e < 2; ++e) {
        const int kk = 2 * t + e;
        const __m512i d = _mm512_permutex2var_epi32(x[0][s][t], idx3[e], x[1][s][t]);
        _mm512_store_si512(u.g[s][kk], _mm512_and_si512(d, low));
        _mm512_store_si512(u.g[s][4 + kk], _mm512_and_si512(_mm512_srli_epi16(d, 4), low));
      }
}

// The float16 scales (or offsets) of groups b and b + 1 of a block's 16 rows (`groups` a row,
// b + 1 < groups) as float32, a lane per row: one gather of the dword that holds both in each
// row (`rows` = each row's byte offset), its halves widened (exact)
inline void scales_pair(const uint16_t* h, __m512i rows, int64_t b, __m512& s0, __m512& s1) {
  const __m512i two = _mm512_i32gather_epi32(rows, h + b, 1);
  s0 = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(two));
  s1 = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(two, 16)));
}

// group b alone (the last of an odd count): from the dword that ends with it where there is
// one, else (a single group) value by value
inline __m512 scales_last(const uint16_t* h, __m512i rows, int64_t groups, int64_t b) {
  if (b > 0) {
    __m512 unused, s;
    scales_pair(h, rows, b - 1, unused, s);
    return s;
  }
  alignas(64) float f[16];
  for (int r = 0; r < 16; ++r) f[r] = _cvtsh_ss(h[r * groups]);
  return _mm512_load_ps(f);
}

// acc[m] += float(sums[m]) * scale[:, b] * d_x[m, b] + offset[:, b] * bsum_x[m, b] for the
// chunk's first `rows` activation rows (lanes: the block's 16 weight rows)
inline void scale_q4(const int32_t (&sums)[16][16], __m512 (&acc)[16], int rows,
                     const float* d, const float* bsum, int64_t ld, __m512 ws, __m512 wo,
                     int64_t b) {
#pragma GCC unroll 16
  for (int m = 0; m < 16; ++m)
    if (m < rows) {
      const __m512 v = _mm512_cvtepi32_ps(_mm512_load_si512(sums[m]));
      acc[m] = _mm512_fmadd_ps(v, _mm512_mul_ps(ws, _mm512_set1_ps(d[m * ld + b])), acc[m]);
      acc[m] = _mm512_fmadd_ps(wo, _mm512_set1_ps(bsum[m * ld + b]), acc[m]);
    }
}

// As SF_Q8_PAIR: `issue_q4_S0S1` unpacks groups b and b + 1 into `u` and multiplies them into
// the sum tiles S0 and S1 (the codes prefetched 8 groups ahead), `drain_q4_S0S1` scales their
// sums into acc.
#define SF_Q4_PAIR(S0, S1) \
inline void issue_q4_##S0##S1(const uint8_t* cb, int64_t row_bytes, int64_t groups, \
                              const int8_t* xq, int64_t kp, int64_t b, Q4Unpacked& u) { \
  prefetch_rows(reinterpret_cast<const char*>(cb), row_bytes, groups, b, 8, 16); \
  unpack_pair(cb, row_bytes, b, false, u); \
  _tile_zero(S0); \
  _tile_zero(S1); \
  SF_TILE_LOADD(4, u.g[0], 64); \
  SF_TILE_LOADD(6, xq + b * 32, kp); \
  SF_TILE_LOADD(5, u.g[1], 64); \
  SF_TILE_LOADD(7, xq + (b + 1) * 32, kp); \
  _tile_dpbsud(S0, 6, 4); \
  _tile_dpbsud(S1, 7, 5); \
} \
 \
inline void drain_q4_##S0##S1(__m512 (&acc)[16], int rows, const float* d, const float* bsum, \
                              int64_t ld, const uint16_t* gs, const uint16_t* go, \
                              __m512i srows, int64_t b) { \
  alignas(64) int32_t s0[16][16]; \
  alignas(64) int32_t s1[16][16]; \
  __m512 ws0, ws1, wo0, wo1; \
  scales_pair(gs, srows, b, ws0, ws1); \
  scales_pair(go, srows, b, wo0, wo1); \
  SF_TILE_STORED(S0, s0, 64); \
  SF_TILE_STORED(S1, s1, 64); \
  scale_q4(s0, acc, rows, d, bsum, ld, ws0, wo0, b); \
  scale_q4(s1, acc, rows, d, bsum, ld, ws1, wo1, b + 1); \
}
SF_Q4_PAIR(0, 1)
SF_Q4_PAIR(2, 3)
#undef SF_Q4_PAIR

// one block of 16 weight rows (n) against the activation rows [m0, m0 + rows) (whose chunk of
// mc rows the tiles are configured for)
void block_q4(const Q8Act& a, int64_t m0, int rows, const uint8_t* codes,
               const uint16_t* gscale, const uint16_t* goffset, const float* bias, int64_t n,
               Out out) {
  const int64_t k = a.k, groups = k / 32, row_bytes = groups * 16, ld = a.kp / 32;
  const uint8_t* cb = codes + n * row_bytes;
  const uint16_t* gs = gscale + n * groups;
  const uint16_t* go = goffset + n * groups;
  // each of the block's rows' byte offset in its scales and offsets
  const __m512i srows = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int>(2 * groups)));
  const int8_t* xq = a.q + m0 * a.kp;
  const float* d = a.d + m0 * ld;
  const float* bsum = a.bsum + m0 * ld;
  __m512 acc[16];
  for (int m = 0; m < 16; ++m) acc[m] = _mm512_setzero_ps();
  Q4Unpacked u;
  pairs_in_flight(
      groups / 2,
      [&](bool hi, int64_t b) {
        if (hi)
          issue_q4_23(cb, row_bytes, groups, xq, a.kp, b, u);
        else
          issue_q4_01(cb, row_bytes, groups, xq, a.kp, b, u);
      },
      [&](bool hi, int64_t b) {
        if (hi)
          drain_q4_23(acc, rows, d, bsum, ld, gs, go, srows, b);
        else
          drain_q4_01(acc, rows, d, bsum, ld, gs, go, srows, b);
      });
  if (groups % 2) {
    const int64_t b = groups - 1;
    alignas(64) int32_t s0[16][16];
    unpack_pair(cb, row_bytes, b, true, u);
    _tile_zero(0);
    SF_TILE_LOADD(4, u.g[0], 64);
    SF_TILE_LOADD(6, xq + b * 32, a.kp);
    _tile_dpbsud(0, 6, 4);
    SF_TILE_STORED(0, s0, 64);
    scale_q4(s0, acc, rows, d, bsum, ld, scales_last(gs, srows, groups, b),
              scales_last(go, srows, groups, b), b);
  }
  const __m512 bv = bias ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();
  for (int m = 0; m < rows; ++m)
    store_row(out, (m0 + m) * out.ldo + n, _mm512_add_ps(acc[m], bv));
}

}  // namespace

void gemv_q4(const Q8Act& a, const uint8_t* codes, const uint16_t* gscale,
             const uint16_t* goffset, const float* bias, int64_t n0, int64_t n1, Out out) {
  const int64_t m = a.m;
  const int mc = static_cast<int>(chunk_rows(m));
  configure_q4(mc);
  for (int64_t n = n0; n + 16 <= n1; n += 16)
    for (int64_t m0 = 0; m0 < m; m0 += mc)
      block_q4(a, m0, static_cast<int>(std::min<int64_t>(mc, m - m0)), codes, gscale, goffset,
                bias, n, out);
  _tile_release();
}

}  // namespace amx
}  // namespace sf

#pragma GCC pop_options

#else  // no AMX intrinsics in this compiler: the tiles are never granted

namespace sf {
namespace amx {
bool request_tiles() { return false; }
int64_t packed_size(int64_t, int64_t) { return 0; }
void pack_x(const uint16_t*, int64_t, int64_t, uint32_t*) {}
void gemv_bf16(const uint32_t*, int64_t, int64_t, const uint16_t*, int64_t, const float*,
               int64_t, int64_t, Out) {}
int64_t packed_q8_size(int64_t, int64_t) { return 0; }
int64_t packed_q8_scales(int64_t, int64_t) { return 0; }
void pack_q8(const Q8Act&, uint32_t*, float*) {}
void gemv_q8(const uint32_t*, const float*, int64_t, int64_t, const int8_t*, const float*,
             const uint16_t*, const float*, int64_t, int64_t, Out) {}
void gemv_q4(const Q8Act&, const uint8_t*, const uint16_t*, const uint16_t*, const float*,
             int64_t, int64_t, Out) {}
}  // namespace amx
}  // namespace sf

#endif  // SF_HAVE_AMX
