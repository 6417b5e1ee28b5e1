// The AVX2 + FMA variant: x86-64 machines without AVX-512 BF16/VNNI.
//
// The same products as isa_avx512.cpp on 256-bit registers: integer dots as llama.cpp does
// them without VNNI (|x| times w with x's sign, `vpmaddubsw` then `vpmaddwd`), bfloat16
// widened to float32 and multiplied with FMA. The matrix-vector products walk tiles of four
// weight rows, each weight vector multiplied into up to three (dense) or two (integer)
// activation rows, with the weight's later lines fetched in address order: a product that read each weight row
// once per activation row, one chain of FMAs at a time, read bfloat16 at 10 GB/s at one row and
// 2.7 at eight on 2 threads, under torch's own AVX2 path.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "vec_exp.h"

// Only this file's own code gets the instruction set: the standard and project headers above
// are compiled for the baseline (GCC 13 refused to inline libstdc++'s always-inline helpers
// into code under a target pragma that preceded their headers).
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace sf {
namespace avx2 {
namespace {

constexpr int kTileN = 4;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 load_bf16x8(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float xval(const void* x, bool bf16, int64_t i) {
  return bf16 ? bf16_to_f32(static_cast<const uint16_t*>(x)[i]) : static_cast<const float*>(x)[i];
}

inline void store(Out out, int64_t m, int64_t n, float v) {
  if (out.bf16) {
    static_cast<uint16_t*>(out.ptr)[m * out.ldo + n] = f32_to_bf16(v);
  } else {
    static_cast<float*>(out.ptr)[m * out.ldo + n] = v;
  }
}

inline float round_bf16(float v) { return bf16_to_f32(f32_to_bf16(v)); }

inline __m256 exp_ps(__m256 x) { return exp_avx2(x); }

// One row of activations to Q8Act's blocks of 32: the block's largest |x| over 127 as its
// scale, each value times 127 / amax rounded to nearest even (the scalar emulation's
// nearbyint under the default rounding mode), 8 values a vector
void quantize(const void* x, bool x_bf16, int64_t row, Q8Act& a) {
  const int64_t k = a.k, kp = a.kp;
  int8_t* q = a.q + row * kp;
  float* d = a.d + row * (kp / 32);
  float* bsum = a.bsum + row * (kp / 32);
  const char* xr = static_cast<const char*>(x) + row * k * (x_bf16 ? 2 : 4);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < kp / 32; ++b) {
    const int64_t k0 = b * 32;
    if (k0 >= k) {  // padding: zeros
      std::memset(q + k0, 0, 32);
      d[b] = 0.f;
      bsum[b] = 0.f;
      continue;
    }
    __m256 v[4];
    for (int h = 0; h < 4; ++h)
      v[h] = x_bf16 ? load_bf16x8(reinterpret_cast<const uint16_t*>(xr) + k0 + 8 * h)
                    : _mm256_loadu_ps(reinterpret_cast<const float*>(xr) + k0 + 8 * h);
    __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                             _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    const __m256 iv = _mm256_set1_ps(inv);
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
    __m256i c[4];
    for (int h = 0; h < 4; ++h)
      c[h] = _mm256_min_epi32(hi, _mm256_max_epi32(lo, _mm256_cvtps_epi32(_mm256_mul_ps(v[h], iv))));
    const __m256i s32 = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    // 32 int32 to 32 int8 in order: the packs work within 128-bit lanes, a permute puts the
    // lanes back
    const __m256i p16a = _mm256_packs_epi32(c[0], c[1]);
    const __m256i p16b = _mm256_packs_epi32(c[2], c[3]);
    const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b),
                                                   _mm256_set_epi32(7, 3, 6, 2, 5, 1, 4, 0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k0), p8);
    d[b] = amax / 127.f;
    bsum[b] = d[b] * static_cast<float>(_mm_cvtsi128_si32(s4));
  }
}


// ---- matrix-vector products: tiles of 4 weight rows ------------------------------------
//
// Each weight vector loaded is multiplied into every activation row of the pass (up to
// kTileM), and the four rows' sums are independent chains; the weight's lines kFetchDistance
// ahead are fetched into L1 in address order as the tile is read (Ahead).

constexpr int kTileM = 3;  // activation rows per pass: 12 accumulators of the 16 registers

// The activation rows of the next group of a pass with `left` rows to go: up to kTileM, but two
// and two of four, so that no row of a call of two or more sums alone (one row keeps its odd
// products in sums of their own, Sums<1>), and the compact product may take four rows as one
// group (compact_rows) with the same bits.
inline int group_rows(int64_t left) {
  return left == 4 ? 2 : static_cast<int>(std::min<int64_t>(kTileM, left));
}

// the horizontal sums of four vectors, as lanes 0-3
inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// The weight rows of tile n (the last row repeated past n1) and what each output takes
struct Tile4 {
  const char* w[kTileN];
  int64_t n = 0;
  int nb = 0;  // rows of the tile inside [n0, n1)
};

inline Tile4 tile_at(const void* w, int64_t row_bytes, int64_t n, int64_t n1) {
  Tile4 t;
  t.n = n;
  t.nb = static_cast<int>(std::min<int64_t>(kTileN, n1 - n));
  for (int j = 0; j < kTileN; ++j)
    t.w[j] = static_cast<const char*>(w) + (n + std::min(j, t.nb - 1)) * row_bytes;
  return t;
}

// The weight's later lines, fetched as one stream in address order. A tile's rows are
// contiguous in a row-major weight and so are successive tiles, so step s of `steps` over a
// tile fetches its share of the tile's bytes (whole lines) `distance` bytes past the tile's
// first byte plus s shares: the fetches run through memory in order at the pace the tile is
// read, whatever the row a step reads. Fetching each row's own line at the same column (four
// streams a tile, 576-1536 bytes long) read a Q8_0 weight at 8-14 GB/s on a Zen 3 against
// 16-20 this way (2 threads, a 230 MB weight, the integer product's loop; a plain read: 19-25).
struct Ahead {
  const char* from = nullptr;  // the tile's first byte plus the distance
  int64_t step = 0;            // bytes a step fetches: 0 fetches nothing

  inline void at(int64_t s) const {
    const char* p = from + s * step;
    for (int64_t o = 0; o < step; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
  }
};

// How far ahead of its reads a product fetches the weight, in bytes, whatever the tile's size.
// SmolLM2's five shapes, 30 copies, 2 threads, a Zen 3, us a step at one row, 8 KB / 4 KB ahead
// in two rounds: Q8_0 1641 / 1655, 1587 / 1583; bf16 3500 / 3113, 2813 / 2740; int4 1124 / 1542,
// 1052 / 943; f32 5785 / 6559, 5511 / 6636 (a f32 tile of 576 values is 9 KB).
constexpr int64_t kFetchDistance = 8192;

// The first kFetchDistance bytes of a thread's rows (`bytes` in all from `from`), fetched
// before its first tile: the tiles' own fetches start that far on. (A 576 x 576 projection's
// rows are 166 KB a thread, read in about 8 us at 20 GB/s.)
inline void fetch_start(const void* from, int64_t bytes) {
  const char* p = static_cast<const char*>(from);
  for (int64_t o = 0; o < std::min(bytes, kFetchDistance); o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
}

// the fetches of the tile whose first row starts at `tile`, over `steps` steps, its rows
// `row_bytes` apart
inline Ahead ahead_of(const void* tile, int64_t row_bytes, int64_t steps) {
  Ahead a;
  a.from = static_cast<const char*>(tile) + kFetchDistance;
  a.step = steps > 0 ? ((kTileN * row_bytes + steps - 1) / steps + 63) / 64 * 64 : 0;
  return a;
}

// A tile's sums for MB activation rows, and the order of their products, which the dense and
// compact bfloat16 products share so that their outputs are the same bits: per 16 values of
// weight row j, `w0` (its even-indexed values) and `w1` (its odd-indexed ones) against each
// row's split activations (`xi`: 8 even, then 8 odd). One row keeps the odd products in sums of
// their own (two chains a weight row), more rows add both into one sum.
template <int MB>
struct Sums {
  __m256 acc[MB][kTileN], odd[MB == 1 ? kTileN : 1];

  Sums() {
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < kTileN; ++j) acc[i][j] = _mm256_setzero_ps();
    for (int j = 0; j < (MB == 1 ? kTileN : 1); ++j) odd[j] = _mm256_setzero_ps();
  }

  // weight row j's 16 values at column k0 into every activation row's sum
  inline void add(int j, const float* xs, int64_t xs_stride, int64_t k0, __m256 w0, __m256 w1) {
#pragma GCC unroll 3
    for (int i = 0; i < MB; ++i) {
      const float* xi = xs + i * xs_stride + k0;
      acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xi), w0, acc[i][j]);
      if constexpr (MB == 1)
        odd[j] = _mm256_fmadd_ps(_mm256_loadu_ps(xi + 8), w1, odd[j]);
      else
        acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xi + 8), w1, acc[i][j]);
    }
  }

  // the four weight rows' totals for each activation row: v[i][j]
  inline void totals(float (*v)[4]) {
    if constexpr (MB == 1)
      for (int j = 0; j < kTileN; ++j) acc[0][j] = _mm256_add_ps(acc[0][j], odd[j]);
    for (int i = 0; i < MB; ++i)
      _mm_storeu_ps(v[i], hsum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
  }
};

// a bfloat16 weight's 16 values (32 bytes) as w0 (even-indexed) and w1 (odd-indexed) float
// vectors, without a shuffle (see dense_tile)
inline void widen_bf16x16(__m256i v, __m256& w0, __m256& w1) {
  w0 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  w1 = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// Dense: 16 values a step. A bfloat16 weight's 32 bytes become two float vectors without a
// shuffle: the even-indexed values (shifted into the high half of each lane) and the
// odd-indexed ones (masked); the activations are split the same way once per call
// (`xs`: per 16 values, 8 even then 8 odd, float32). A float32 weight's step is two plain
// vectors against the activations as they are.
template <bool BF16, int MB>
void dense_tile(const float* xs, int64_t xs_stride, const void* x, int64_t k, const Tile4& t,
                int64_t m0, const Ahead& ahead, const float* bias, Out out) {
  constexpr int64_t es = BF16 ? 2 : 4;
  const int64_t k16 = k - k % 16;
  Sums<MB> sums;
  for (int64_t k0 = 0; k0 < k16; k0 += 16) {
    ahead.at(k0 / 16);
#pragma GCC unroll 4
    for (int j = 0; j < kTileN; ++j) {
      const char* p = t.w[j] + k0 * es;
      __m256 w0, w1;
      if constexpr (BF16) {
        widen_bf16x16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), w0, w1);
      } else {
        w0 = _mm256_loadu_ps(reinterpret_cast<const float*>(p));
        w1 = _mm256_loadu_ps(reinterpret_cast<const float*>(p) + 8);
      }
      sums.add(j, xs, xs_stride, k0, w0, w1);
    }
  }
  float v[MB][4];
  sums.totals(v);
  for (int i = 0; i < MB; ++i) {
    for (int j = 0; j < t.nb; ++j) {
      for (int64_t kk = k16; kk < k; ++kk)
        v[i][j] += xval(x, BF16, (m0 + i) * k + kk) * xval(t.w[j], BF16, kk);
      store(out, m0 + i, t.n + j, bias ? v[i][j] + bias[t.n + j] : v[i][j]);
    }
  }
}

// bfloat16 activation rows [p0, p1) of x [m, k] as dense_tile reads them: per 16 values, the 8
// even-indexed then the 8 odd-indexed in float32, k16 values a row (this thread's buffer)
const float* split_bf16(const void* x, int64_t k, int64_t k16, int64_t p0, int64_t p1) {
  thread_local std::vector<float> split;
  scratch(split, static_cast<size_t>((p1 - p0) * k16 + 8));
  for (int64_t i = p0; i < p1; ++i)
    for (int64_t k0 = 0; k0 < k16; k0 += 16) {
      __m256 even, odd;
      widen_bf16x16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                        static_cast<const uint16_t*>(x) + i * k + k0)),
                    even, odd);
      float* dst = split.data() + (i - p0) * k16 + k0;
      _mm256_storeu_ps(dst, even);
      _mm256_storeu_ps(dst + 8, odd);
    }
  return split.data();
}

// activation rows per pass over the weights: a bfloat16 prompt (which stays on this kernel,
// native_layers.AVX2_BF16_MAX_ROWS) is split into float32 this many rows at a time (1.5 MB
// at 8192 features, not the whole chunk's), the weights re-read once per pass
constexpr int64_t kPassRows = 16 * kTileM;

template <bool BF16>
void gemv_dense_t(const void* x, int64_t m, int64_t k, const void* w, int64_t ldw,
                  const float* bias, int64_t n0, int64_t n1, Out out) {
  constexpr int64_t es = BF16 ? 2 : 4;
  const int64_t k16 = k - k % 16;
  fetch_start(static_cast<const char*>(w) + n0 * ldw * es, (n1 - n0) * ldw * es);
  for (int64_t p0 = 0; p0 < m; p0 += kPassRows) {
    const int64_t p1 = std::min(m, p0 + kPassRows);
    const float* xs = static_cast<const float*>(x) + p0 * k;  // row p0 of the pass
    int64_t xs_stride = k;
    if constexpr (BF16) {
      xs = split_bf16(x, k, k16, p0, p1);
      xs_stride = k16;
    }
    for (int64_t n = n0; n < n1; n += kTileN) {
      const Tile4 t = tile_at(w, ldw * es, n, n1);
      const Ahead first = ahead_of(t.w[0], ldw * es, k16 / 16);
      for (int64_t m0 = p0, mb = 0; m0 < p1; m0 += mb) {
        const float* xm = xs + (m0 - p0) * xs_stride;
        // the tile's first group of rows fetches the weight; the others read it from the cache
        const Ahead ahead = m0 == p0 ? first : Ahead{};
        mb = group_rows(p1 - m0);
        switch (mb) {
          case 1: dense_tile<BF16, 1>(xm, xs_stride, x, k, t, m0, ahead, bias, out); break;
          case 2: dense_tile<BF16, 2>(xm, xs_stride, x, k, t, m0, ahead, bias, out); break;
          default: dense_tile<BF16, 3>(xm, xs_stride, x, k, t, m0, ahead, bias, out); break;
        }
      }
    }
  }
}

// ---- bfloat16 weights in the compact form (compact_bf16.cpp's layout) ----------------------
//
// A block of 64 values of a row is decoded to its four runs of 16 values in order, each the
// vector a load of those 16 dense values gives, and each run goes into the sums as dense_tile
// puts it there: every accumulator takes the same products in the same order, so the outputs
// are gemv_dense_bf16's bits. The codes of the block's positions 0-31 (its low bytes' first 32)
// are the low nibbles of its 32 code bytes and those of positions 32-63 the high nibbles, so two
// `vpshufb` against the row's table (in both 128-bit lanes) give the high bytes of all 64, and
// `vpunpck{l,h}bw` of low and high bytes, per 128-bit lane, give values 0-15 (low of positions
// 0-31), 16-31 (low of 32-63), 32-47 (high of 0-31) and 48-63 (high of 32-63).

// the high bytes of a block's positions 0-31 (`h0`) and 32-63 (`h1`)
inline void compact_highs(const uint8_t* lo, __m256i table, __m256i& h0, __m256i& h1) {
  const __m256i nib = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + 64));
  const __m256i mask = _mm256_set1_epi8(0x0F);
  h0 = _mm256_shuffle_epi8(table, _mm256_and_si256(nib, mask));
  h1 = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(nib, 4), mask));
}

// run s (values 16 s .. 16 s + 15) of a block whose low bytes are at `lo`
inline __m256i compact_run(const uint8_t* lo, __m256i h0, __m256i h1, int s) {
  const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + (s & 1) * 32));
  const __m256i high = (s & 1) ? h1 : h0;
  return s < 2 ? _mm256_unpacklo_epi8(low, high) : _mm256_unpackhi_epi8(low, high);
}

// One or two activation rows (MB, the call's m): weight rows n .. n + nb - 1 (their codes at
// rows[j] with tables[j], or their dense values at dense[j] where not null: a row that does not
// fit) decoded block by block in the registers, each run going into dense_tile<true, MB>'s sums
// in its order (8 sums, the two high-byte vectors and a run fit the 16 registers; three rows'
// 12 sums would not)
template <int MB>
void compact_regs(const float* xs, int64_t k, const uint8_t* const* rows,
                  const uint16_t* const* dense, const __m256i* tables, int64_t n, int nb,
                  const Ahead& ahead, const float* bias, Out out) {
  static_assert(MB == 1 || MB == 2);
  Sums<MB> sums;
  for (int64_t b = 0; b < k / 64; ++b) {
    ahead.at(b);
#pragma GCC unroll 1
    for (int j = 0; j < kTileN; ++j) {
      const uint8_t* lo = rows[j] + b * compact::kBlockBytes;
      const uint16_t* d = dense[j] == nullptr ? nullptr : dense[j] + b * 64;
      __m256i h0 = _mm256_setzero_si256(), h1 = h0;
      if (d == nullptr) compact_highs(lo, tables[j], h0, h1);
#pragma GCC unroll 4
      for (int s = 0; s < 4; ++s) {
        __m256 w0, w1;
        widen_bf16x16(d == nullptr ? compact_run(lo, h0, h1, s)
                                   : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + 16 * s)),
                      w0, w1);
        sums.add(j, xs, k, b * 64 + 16 * s, w0, w1);
      }
    }
  }
  float v[MB][4];
  sums.totals(v);
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < nb; ++j) store(out, i, n + j, bias ? v[i][j] + bias[n + j] : v[i][j]);
}

// The most activation rows compact_rows takes (all of a call's, as one group); more go through
// the tile buffer (gemv_compact). SmolLM2's four decode shapes, 30 copies, 2 threads, a Zen 3,
// six processes alternating with the buffer for all, the compact product's time over the dense
// kernel's in each (medians): 3 rows 1.20 -> 1.085, 4 rows 1.25 -> 1.07. In two groups each
// decodes the tile again: at 6 rows `bench_gemv.py` gave 1.28-1.34 against the buffer's
// 1.21-1.33, at 8 and 12 0.95-1.18 of the buffer's time on two shapes.
constexpr int64_t kCompactRowsMax = 4;

// The MB activation rows (3 or 4) of a call: the tile's weight rows two at a time, each pair
// decoded block by block in the registers and each run multiplied into the MB rows' sums of
// both rows, every sum in Sums<2..3>'s order (dense_tile's for two or more rows: group_rows
// gives none of one), so the outputs are gemv_dense_bf16's bits. Each activation vector loaded
// serves both weight rows: 8 sums, the pair's two high-byte vectors each and its four weight
// vectors. Decoding into a buffer for dense_tile instead (the path past kCompactRowsMax) stored
// and re-read each run and widened it once per group of three. The pair's codes (from `codes`,
// the tile's first row's) are fetched as they are read, as Ahead does for a whole tile.
template <int MB>
void compact_rows(const float* xs, int64_t k, const uint8_t* const* rows,
                  const uint16_t* const* dense, const __m256i* tables, int64_t n, int nb,
                  const uint8_t* codes, int64_t row_bytes, const float* bias, Out out) {
  static_assert(MB == 3 || MB == 4);
  const int64_t blocks = k / 64;
  for (int p = 0; p < nb; p += 2) {
    const int ja = p, jb = p + 1;  // rows past nb repeat the tile's last (tile_at's rule)
    Ahead ahead;
    ahead.from = reinterpret_cast<const char*>(codes) + p * row_bytes + kFetchDistance;
    ahead.step = ((2 * row_bytes + blocks - 1) / blocks + 63) / 64 * 64;
    __m256 acc[MB][2];
    for (int i = 0; i < MB; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      ahead.at(b);
      const uint8_t* la = rows[ja] + b * compact::kBlockBytes;
      const uint8_t* lb = rows[jb] + b * compact::kBlockBytes;
      const uint16_t* da = dense[ja] == nullptr ? nullptr : dense[ja] + b * 64;
      const uint16_t* db = dense[jb] == nullptr ? nullptr : dense[jb] + b * 64;
      __m256i ha0 = _mm256_setzero_si256(), ha1 = ha0, hb0 = ha0, hb1 = ha0;
      if (da == nullptr) compact_highs(la, tables[ja], ha0, ha1);
      if (db == nullptr) compact_highs(lb, tables[jb], hb0, hb1);
#pragma GCC unroll 4
      for (int s = 0; s < 4; ++s) {
        __m256 a0, a1, b0, b1;
        widen_bf16x16(da == nullptr ? compact_run(la, ha0, ha1, s)
                                    : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(da + 16 * s)),
                      a0, a1);
        widen_bf16x16(db == nullptr ? compact_run(lb, hb0, hb1, s)
                                    : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(db + 16 * s)),
                      b0, b1);
#pragma GCC unroll 4
        for (int i = 0; i < MB; ++i) {
          const float* xi = xs + i * k + b * 64 + 16 * s;
          const __m256 xe = _mm256_loadu_ps(xi), xo = _mm256_loadu_ps(xi + 8);
          acc[i][0] = _mm256_fmadd_ps(xe, a0, acc[i][0]);
          acc[i][1] = _mm256_fmadd_ps(xe, b0, acc[i][1]);
          acc[i][0] = _mm256_fmadd_ps(xo, a1, acc[i][0]);
          acc[i][1] = _mm256_fmadd_ps(xo, b1, acc[i][1]);
        }
      }
    }
    for (int i = 0; i < MB; ++i) {
      // hsum4 sums each of its vectors in the same order whatever its place (Sums::totals')
      float v[4];
      _mm_storeu_ps(v, hsum4(acc[i][0], acc[i][1], acc[i][0], acc[i][1]));
      for (int j = 0; j < 2 && p + j < nb; ++j) {
        const int64_t col = n + p + j;
        store(out, i, col, bias ? v[j] + bias[col] : v[j]);
      }
    }
  }
}

// a row's values 0 .. k - 1 from its codes, as bfloat16
// (one row after another: the tile's bytes in address order, fetched kFetchDistance ahead)
void compact_decode(const uint8_t* row, __m256i table, int64_t k, uint16_t* dst) {
  for (int64_t b = 0; b < k / 64; ++b) {
    const uint8_t* lo = row + b * compact::kBlockBytes;
    const char* next = reinterpret_cast<const char*>(lo) + kFetchDistance;
    _mm_prefetch(next, _MM_HINT_T0);
    _mm_prefetch(next + 64, _MM_HINT_T0);
    __m256i h0, h1;
    compact_highs(lo, table, h0, h1);
    for (int s = 0; s < 4; ++s)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + b * 64 + 16 * s),
                          compact_run(lo, h0, h1, s));
  }
}

// a run of 16 bfloat16 values to float32 at `dst`, in order
inline void store_widened(__m256i v, float* dst) {
  const __m256i lo = _mm256_cvtepu16_epi32(_mm256_castsi256_si128(v));
  const __m256i hi = _mm256_cvtepu16_epi32(_mm256_extracti128_si256(v, 1));
  _mm256_storeu_ps(dst, _mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)));
  _mm256_storeu_ps(dst + 8, _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16)));
}

}  // namespace

void decompact(const uint8_t* codes, const uint8_t* tables, const uint16_t* dense, int64_t ldw,
               int64_t k, int64_t r0, int64_t r1, void* out, bool f32) {
  const int64_t row_bytes = k + k / 2;
  for (int64_t r = r0; r < r1; ++r) {
    const bool fit = compact::fits(tables, r);
    const uint8_t* row = codes + r * row_bytes;
    const uint16_t* d = dense + r * ldw;
    const __m256i table = _mm256_broadcastsi128_si256(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(tables + r * compact::kCodes)));
    for (int64_t b = 0; b < k / 64; ++b) {
      const uint8_t* lo = row + b * compact::kBlockBytes;
      __m256i h0 = _mm256_setzero_si256(), h1 = h0;
      if (fit) {
        const char* next = reinterpret_cast<const char*>(lo) + kFetchDistance;
        _mm_prefetch(next, _MM_HINT_T0);
        _mm_prefetch(next + 64, _MM_HINT_T0);
        compact_highs(lo, table, h0, h1);
      }
      for (int s = 0; s < 4; ++s) {
        const int64_t at = (r - r0) * k + b * 64 + 16 * s;
        const __m256i v =
            fit ? compact_run(lo, h0, h1, s)
                : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + b * 64 + 16 * s));
        if (f32) {
          store_widened(v, static_cast<float*>(out) + at);
        } else {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + at), v);
        }
      }
    }
  }
}

namespace {

// One or two rows: in the registers (compact_regs). Three and four (kCompactRowsMax): in the
// registers too, a pair of weight rows at a time (compact_rows). More: each tile's four rows decoded once
// into this thread's buffer, and dense_tile run on it for every group of activation rows, so
// the sums are dense_tile's by construction. (Decoding the whole tile per group of three in
// the registers took 1.2-1.4x the dense kernel's time at 4 and 8 rows: 12 sums and the decoded
// values overflow the 16 registers.)
void gemv_compact(const uint16_t* x, int64_t m, int64_t k, const uint8_t* codes,
                  const uint8_t* tables, const uint16_t* dense, int64_t ldw, const float* bias,
                  int64_t n0, int64_t n1, Out out) {
  const int64_t row_bytes = k + k / 2;
  fetch_start(codes + n0 * row_bytes, (n1 - n0) * row_bytes);
  thread_local std::vector<uint16_t> decoded;
  const bool in_regs = m <= kCompactRowsMax;
  uint16_t* buf = in_regs ? nullptr : scratch(decoded, static_cast<size_t>(kTileN * k));
  for (int64_t p0 = 0; p0 < m; p0 += kPassRows) {
    const int64_t p1 = std::min(m, p0 + kPassRows);
    const float* xs = split_bf16(x, k, k, p0, p1);
    for (int64_t n = n0; n < n1; n += kTileN) {
      const int nb = static_cast<int>(std::min<int64_t>(kTileN, n1 - n));
      const uint8_t* rows[kTileN];
      const uint16_t* dense_rows[kTileN];
      __m256i tabs[kTileN];
      for (int j = 0; j < kTileN; ++j) {
        const int64_t r = n + std::min(j, nb - 1);
        rows[j] = codes + r * row_bytes;
        dense_rows[j] = compact::fits(tables, r) ? nullptr : dense + r * ldw;
        tabs[j] = _mm256_broadcastsi128_si256(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(tables + r * compact::kCodes)));
      }
      if (m <= 2) {
        const Ahead ahead = ahead_of(codes + n * row_bytes, row_bytes, k / 64);
        if (m == 1) compact_regs<1>(xs, k, rows, dense_rows, tabs, n, nb, ahead, bias, out);
        else compact_regs<2>(xs, k, rows, dense_rows, tabs, n, nb, ahead, bias, out);
        continue;
      }
      if (in_regs) {  // 3 or 4 rows, one pass
        const uint8_t* tile = codes + n * row_bytes;
        if (m == 3) compact_rows<3>(xs, k, rows, dense_rows, tabs, n, nb, tile, row_bytes, bias, out);
        else compact_rows<4>(xs, k, rows, dense_rows, tabs, n, nb, tile, row_bytes, bias, out);
        continue;
      }
      Tile4 t;
      t.n = n;
      t.nb = nb;
      for (int j = 0; j < kTileN; ++j) {
        if (dense_rows[j] == nullptr) compact_decode(rows[j], tabs[j], k, buf + j * k);
        t.w[j] = reinterpret_cast<const char*>(dense_rows[j] ? dense_rows[j] : buf + j * k);
      }
      for (int64_t m0 = p0, mb = 0; m0 < p1; m0 += mb) {
        const float* xm = xs + (m0 - p0) * k;
        // no fetches: the codes were fetched as they were decoded
        const Ahead none;
        mb = group_rows(p1 - m0);
        switch (mb) {
          case 1: dense_tile<true, 1>(xm, k, x, k, t, m0, none, bias, out); break;
          case 2: dense_tile<true, 2>(xm, k, x, k, t, m0, none, bias, out); break;
          default: dense_tile<true, 3>(xm, k, x, k, t, m0, none, bias, out); break;
        }
      }
    }
  }
}

// comb[(i * kTileN + j) * blocks + b] = d[m0 + i, b] * scale[j][b] (float16 scales): the
// product each block's integer sum is scaled by, 8 blocks a vector, so the loops broadcast it
// from memory instead of converting and multiplying a scalar per block
template <int MB>
const float* combined_scales(const Q8Act& a, const uint16_t* const* scale, int64_t m0,
                             int64_t blocks) {
  thread_local std::vector<float> comb;
  scratch(comb, static_cast<size_t>(MB * kTileN * blocks));
  const int64_t dstride = a.kp / 32;
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < kTileN; ++j) {
      const float* d = a.d + (m0 + i) * dstride;
      float* c = comb.data() + (i * kTileN + j) * blocks;
      int64_t b = 0;
      for (; b + 8 <= blocks; b += 8)
        _mm256_storeu_ps(c + b, _mm256_mul_ps(_mm256_loadu_ps(d + b),
                                              _mm256_cvtph_ps(_mm_loadu_si128(
                                                  reinterpret_cast<const __m128i*>(scale[j] + b)))));
      for (; b < blocks; ++b) c[b] = d[b] * _cvtsh_ss(scale[j][b]);
    }
  return comb.data();
}

// int8: per block of 32, each weight row's codes against each activation row's without VNNI
// (|w| times x with w's sign, `vpmaddubsw` then `vpmaddwd`), scaled by the activation's block
// scale (and a Q8_0 weight's) into float lanes. The weight gives the unsigned side: |-128| is
// 0x80, which `vpmaddubsw` reads as 128, so any weight code counts as itself; the activation's
// codes are in [-127, 127], so negating them never wraps. Up to 2 activation rows a pass: 8
// accumulators and the tile's 4 weight vectors with their magnitudes.
constexpr int kTileMQ = 2;

template <int MB, bool Blocked>
void q8_tile(const Q8Act& a, const Tile4& t, const uint16_t* const* bs, int64_t m0,
             const Ahead& ahead, const float* scale, const float* bias, Out out) {
  const int64_t blocks = a.k / 32, dstride = a.kp / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  const float* comb = Blocked ? combined_scales<MB>(a, bs, m0, blocks) : nullptr;
  __m256 acc[MB][kTileN];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < kTileN; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    ahead.at(b);
    __m256i wv[kTileN], aw[kTileN];
#pragma GCC unroll 4
    for (int j = 0; j < kTileN; ++j) {
      wv[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.w[j] + b * 32));
      aw[j] = _mm256_abs_epi8(wv[j]);
    }
#pragma GCC unroll 2
    for (int i = 0; i < MB; ++i) {
      const int64_t r = m0 + i;
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + r * a.kp + b * 32));
      const __m256 dv = _mm256_set1_ps(a.d[r * dstride + b]);
#pragma GCC unroll 4
      for (int j = 0; j < kTileN; ++j) {
        const __m256i p32 = _mm256_madd_epi16(_mm256_maddubs_epi16(aw[j], _mm256_sign_epi8(xq, wv[j])), ones);
        const __m256 sc =
            Blocked ? _mm256_broadcast_ss(comb + (i * kTileN + j) * blocks + b) : dv;
        acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p32), sc, acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MB; ++i) {
    alignas(16) float v[4];
    _mm_store_ps(v, hsum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
    for (int j = 0; j < t.nb; ++j) {
      float y = Blocked ? v[j] : v[j] * scale[t.n + j];
      if (bias) y += bias[t.n + j];
      store(out, m0 + i, t.n + j, y);
    }
  }
}

template <bool Blocked>
void gemv_q8_t(const Q8Act& a, const int8_t* w, const float* scale, const uint16_t* bscale,
               const float* bias, int64_t n0, int64_t n1, Out out) {
  const int64_t k = a.k, blocks = k / 32;
  fetch_start(w + n0 * k, (n1 - n0) * k);
  for (int64_t n = n0; n < n1; n += kTileN) {
    const Tile4 t = tile_at(w, k, n, n1);
    const Ahead first = ahead_of(t.w[0], k, blocks);
    const uint16_t* bs[kTileN];
    for (int j = 0; j < kTileN; ++j)
      bs[j] = Blocked ? bscale + (n + std::min(j, t.nb - 1)) * blocks : nullptr;
    for (int64_t m0 = 0; m0 < a.m; m0 += kTileMQ) {
      const Ahead ahead = m0 == 0 ? first : Ahead{};
      if (a.m - m0 >= 2)
        q8_tile<2, Blocked>(a, t, bs, m0, ahead, scale, bias, out);
      else
        q8_tile<1, Blocked>(a, t, bs, m0, ahead, scale, bias, out);
    }
  }
}

void gemv_q8(const Q8Act& a, const int8_t* w, const float* scale, const uint16_t* bscale,
             const float* bias, int64_t n0, int64_t n1, Out out) {
  if (bscale)
    gemv_q8_t<true>(a, w, scale, bscale, bias, n0, n1, out);
  else
    gemv_q8_t<false>(a, w, scale, bscale, bias, n0, n1, out);
}

// sum over the groups of offset[g] * bsum[g] (bsum: the activation's d * sum(codes) per
// block of 32), 8 groups a vector
inline float offset_sum(const uint16_t* go, const float* bsum, int64_t groups) {
  __m256 s = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8)
    s = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(go + g))),
                        _mm256_loadu_ps(bsum + g), s);
  float r = hsum(s);
  for (; g < groups; ++g) r += _cvtsh_ss(go[g]) * bsum[g];
  return r;
}

// int4: per group of 32, each weight row's codes unpacked once (low nibbles: values 0-15,
// high: 16-31) and multiplied into each activation row's codes (`vpmaddubsw`: codes are
// unsigned); the offsets' term is a dot product over the groups after the loop
template <int MB>
void q4_tile(const Q8Act& a, const Tile4& t, const uint16_t* const* gs, const uint16_t* const* go,
             int64_t m0, const Ahead& ahead, const float* bias, Out out) {
  const int64_t groups = a.k / 32;
  // a group's 16 bytes in both lanes, the upper shifted down a nibble: low nibbles (values
  // 0-15) then high (16-31) after the mask
  const __m256i shift = _mm256_set_epi32(4, 4, 4, 4, 0, 0, 0, 0);
  const __m256i low = _mm256_set1_epi8(0x0f);
  const __m256i ones = _mm256_set1_epi16(1);
  const float* comb = combined_scales<MB>(a, gs, m0, groups);
  __m256 acc[MB][kTileN];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < kTileN; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    ahead.at(g);
    __m256i wv[kTileN];
#pragma GCC unroll 4
    for (int j = 0; j < kTileN; ++j) {
      const char* p = t.w[j] + g * 16;
      const __m256i c = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      wv[j] = _mm256_and_si256(_mm256_srlv_epi32(c, shift), low);
    }
#pragma GCC unroll 2
    for (int i = 0; i < MB; ++i) {
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + (m0 + i) * a.kp + g * 32));
#pragma GCC unroll 4
      for (int j = 0; j < kTileN; ++j) {
        const __m256i p32 = _mm256_madd_epi16(_mm256_maddubs_epi16(wv[j], xq), ones);
        acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p32),
                                    _mm256_broadcast_ss(comb + (i * kTileN + j) * groups + g), acc[i][j]);
      }
    }
  }
  const int64_t dstride = a.kp / 32;
  for (int i = 0; i < MB; ++i) {
    const float* bsum = a.bsum + (m0 + i) * dstride;
    alignas(16) float v[4];
    _mm_store_ps(v, hsum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
    for (int j = 0; j < t.nb; ++j) {
      float y = v[j] + offset_sum(go[j], bsum, groups);
      if (bias) y += bias[t.n + j];
      store(out, m0 + i, t.n + j, y);
    }
  }
}

void gemv_q4(const Q8Act& a, const uint8_t* codes, const uint16_t* gscale,
             const uint16_t* goffset, const float* bias, int64_t n0, int64_t n1, Out out) {
  const int64_t groups = a.k / 32;
  fetch_start(codes + n0 * groups * 16, (n1 - n0) * groups * 16);
  for (int64_t n = n0; n < n1; n += kTileN) {
    const Tile4 t = tile_at(codes, groups * 16, n, n1);
    const Ahead first = ahead_of(t.w[0], groups * 16, groups);
    const uint16_t* gs[kTileN];
    const uint16_t* go[kTileN];
    for (int j = 0; j < kTileN; ++j) {
      const int64_t r = n + std::min(j, t.nb - 1);
      gs[j] = gscale + r * groups;
      go[j] = goffset + r * groups;
    }
    for (int64_t m0 = 0; m0 < a.m; m0 += kTileMQ) {
      const Ahead ahead = m0 == 0 ? first : Ahead{};
      if (a.m - m0 >= 2)
        q4_tile<2>(a, t, gs, go, m0, ahead, bias, out);
      else
        q4_tile<1>(a, t, gs, go, m0, ahead, bias, out);
    }
  }
}

void gemv_dense_bf16(const void* x, int64_t m, int64_t k, const void* w, int64_t ldw,
                     const float* bias, int64_t n0, int64_t n1, Out out) {
  gemv_dense_t<true>(x, m, k, w, ldw, bias, n0, n1, out);
}

void gemv_dense_f32(const void* x, int64_t m, int64_t k, const void* w, int64_t ldw,
                    const float* bias, int64_t n0, int64_t n1, Out out) {
  gemv_dense_t<false>(x, m, k, w, ldw, bias, n0, n1, out);
}

// 8 float32 values to bfloat16, rounded to nearest even (as f32_to_bf16 rounds a finite value)
inline __m128i to_bf16x8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

inline __m256 widen_bf16x8(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// float32: x * rsqrt(mean(x^2) + eps) * w; bfloat16: transformers' order, w * bf16(float(x) *
// rsqrt(mean + eps)), the sum x + delta rounded to bfloat16 before its statistics. The squares
// are summed in 8 lanes (value i in lane i % 8), then the lanes in order: the scalar loop's
// order, 8 values a vector and the last dim % 8 one at a time.
void rms_norm(const void* x, const void* delta, void* sum, const void* w, void* out, int64_t r0,
              int64_t r1, int64_t dim, float eps, bool bf16) {
  const int64_t d8 = dim - dim % 8;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t base = r * dim;
    __m256 ss = _mm256_setzero_ps();
    if (bf16) {
      const uint16_t* xr = static_cast<const uint16_t*>(x) + base;
      const uint16_t* dr = delta ? static_cast<const uint16_t*>(delta) + base : nullptr;
      uint16_t* sr = dr ? static_cast<uint16_t*>(sum) + base : nullptr;
      for (int64_t k0 = 0; k0 < d8; k0 += 8) {
        __m256 v = load_bf16x8(xr + k0);
        if (dr) {
          const __m128i s8 = to_bf16x8(_mm256_add_ps(v, load_bf16x8(dr + k0)));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(sr + k0), s8);
          v = widen_bf16x8(s8);
        }
        ss = _mm256_fmadd_ps(v, v, ss);
      }
    } else {
      const float* xr = static_cast<const float*>(x) + base;
      const float* dr = delta ? static_cast<const float*>(delta) + base : nullptr;
      float* sr = dr ? static_cast<float*>(sum) + base : nullptr;
      for (int64_t k0 = 0; k0 < d8; k0 += 8) {
        __m256 v = _mm256_loadu_ps(xr + k0);
        if (dr) {
          v = _mm256_add_ps(v, _mm256_loadu_ps(dr + k0));
          _mm256_storeu_ps(sr + k0, v);
        }
        ss = _mm256_fmadd_ps(v, v, ss);
      }
    }
    alignas(32) float part[8];
    _mm256_store_ps(part, ss);
    for (int64_t i = d8; i < dim; ++i) {
      float v = xval(x, bf16, base + i);
      if (delta) {
        v += xval(delta, bf16, base + i);
        if (bf16) {
          static_cast<uint16_t*>(sum)[base + i] = f32_to_bf16(v);
          v = round_bf16(v);
        } else {
          static_cast<float*>(sum)[base + i] = v;
        }
      }
      part[i - d8] += v * v;
    }
    float total = 0.f;
    for (float p : part) total += p;
    const float inv = 1.f / std::sqrt(total / static_cast<float>(dim) + eps);
    const __m256 iv = _mm256_set1_ps(inv);
    const void* src = delta ? sum : x;
    if (bf16) {
      const uint16_t* sv = static_cast<const uint16_t*>(src) + base;
      const uint16_t* wv = static_cast<const uint16_t*>(w);
      uint16_t* o = static_cast<uint16_t*>(out) + base;
      for (int64_t k0 = 0; k0 < d8; k0 += 8) {
        const __m256 h = widen_bf16x8(to_bf16x8(_mm256_mul_ps(load_bf16x8(sv + k0), iv)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o + k0),
                         to_bf16x8(_mm256_mul_ps(load_bf16x8(wv + k0), h)));
      }
    } else {
      const float* sv = static_cast<const float*>(src) + base;
      const float* wv = static_cast<const float*>(w);
      float* o = static_cast<float*>(out) + base;
      for (int64_t k0 = 0; k0 < d8; k0 += 8)
        _mm256_storeu_ps(o + k0, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(sv + k0), iv),
                                               _mm256_loadu_ps(wv + k0)));
    }
    for (int64_t i = d8; i < dim; ++i) {
      const float h = xval(src, bf16, base + i) * inv;
      if (bf16) {
        static_cast<uint16_t*>(out)[base + i] = f32_to_bf16(xval(w, true, i) * round_bf16(h));
      } else {
        static_cast<float*>(out)[base + i] = h * static_cast<const float*>(w)[i];
      }
    }
  }
}

void silu_mul(const void* gu, void* out, int64_t r0, int64_t r1, int64_t inter, bool bf16) {
  const __m256 one = _mm256_set1_ps(1.f);
  const int64_t i8 = inter - inter % 8;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t g0 = r * 2 * inter;
    int64_t i = 0;
    for (; i < i8; i += 8) {
      __m256 g, u;
      if (bf16) {
        g = load_bf16x8(static_cast<const uint16_t*>(gu) + g0 + i);
        u = load_bf16x8(static_cast<const uint16_t*>(gu) + g0 + inter + i);
      } else {
        g = _mm256_loadu_ps(static_cast<const float*>(gu) + g0 + i);
        u = _mm256_loadu_ps(static_cast<const float*>(gu) + g0 + inter + i);
      }
      const __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), g))));
      if (bf16)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + r * inter + i),
                         to_bf16x8(_mm256_mul_ps(widen_bf16x8(to_bf16x8(s)), u)));
      else
        _mm256_storeu_ps(static_cast<float*>(out) + r * inter + i, _mm256_mul_ps(s, u));
    }
    for (; i < inter; ++i) {
      const float g = xval(gu, bf16, g0 + i), u = xval(gu, bf16, g0 + inter + i);
      const float s = g / (1.f + std::exp(-g));
      if (bf16) static_cast<uint16_t*>(out)[r * inter + i] = f32_to_bf16(round_bf16(s) * u);
      else static_cast<float*>(out)[r * inter + i] = s * u;
    }
  }
}

// 8 values to the output row (float32, or bfloat16 rounded to nearest even as f32_to_bf16
// rounds a finite value; float32 holding those values with `bf16_values`)
inline void store8(Out out, int64_t row, int64_t c, __m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i up = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
  if (!out.bf16) {
    const __m256 w = out.bf16_values ? _mm256_castsi256_ps(_mm256_and_si256(
                                           up, _mm256_set1_epi32(static_cast<int>(0xffff0000u))))
                                     : v;
    _mm256_storeu_ps(static_cast<float*>(out.ptr) + row * out.ldo + c, w);
    return;
  }
  const __m256i r = _mm256_srli_epi32(up, 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(
      reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out.ptr) + row * out.ldo + c), packed);
}

void dequant_q8(const int8_t* w, const float* scale, const uint16_t* bscale, int64_t k,
                int64_t n0, int64_t n1, Out out) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wr = w + n * k;
    for (int64_t c = 0; c < k; c += 32) {
      const float s = bscale ? _cvtsh_ss(bscale[n * (k / 32) + c / 32]) : scale[n];
      const __m256 sv = _mm256_set1_ps(s);
      for (int h = 0; h < 32; h += 8) {
        const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(wr + c + h));
        store8(out, n, c + h, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), sv));
      }
    }
  }
}

void dequant_q4(const uint8_t* codes, const uint16_t* gscale, const uint16_t* goffset, int64_t k,
                int64_t n0, int64_t n1, Out out) {
  const int64_t groups = k / 32;
  const __m256i low = _mm256_set1_epi32(0x0f);
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* cp = codes + (n * groups + g) * 16;
      const __m256 sc = _mm256_set1_ps(_cvtsh_ss(gscale[n * groups + g]));
      const __m256 of = _mm256_set1_ps(_cvtsh_ss(goffset[n * groups + g]));
      for (int h = 0; h < 16; h += 8) {
        const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(cp + h)));
        const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, low));
        const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
        store8(out, n, g * 32 + h, _mm256_fmadd_ps(lo, sc, of));
        store8(out, n, g * 32 + 16 + h, _mm256_fmadd_ps(hi, sc, of));
      }
    }
  }
}

}  // namespace

const Kernels& kernels() {
  static const Kernels k{"avx2",          quantize,       gemv_q8,  gemv_q4,
                         gemv_dense_bf16, gemv_dense_f32, rms_norm, silu_mul,
                         dequant_q8,      dequant_q4,     gemv_compact};
  return k;
}

}  // namespace avx2
}  // namespace sf

#pragma GCC pop_options
