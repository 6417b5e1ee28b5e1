// Prompt-sized products on AMX tiles: y[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]) for many
// bfloat16 activation rows (a prefill chunk), w a bfloat16 weight read in place, or an int8 or
// int4 weight dequantised block by block as the product walks it.
//
// torch's F.linear hands oneDNN a plain weight, which it re-lays out into its blocked order on
// every call: the whole weight is read, written and read again (and an integer layer's prompt
// path first dequantised its whole weight into a bfloat16 workspace). Keeping oneDNN's blocked
// copy as well would hold the weights twice (the decode kernels read the row-major weight).
// Here each block of 32 weight rows is read once (an integer one dequantised to the dense
// path's values: q * scale, or code * scale + offset, rounded to bfloat16) into a buffer the
// tiles read from cache; only the order of the float32 sums differs from the dense path.
//
// As in isa_amx.cpp the product is computed transposed, C[n, m] = W[n, :] . X[m, :]: a weight
// tile is 16 rows of 32 values, and the activations are packed once per call into the
// pair-interleaved order the instruction reads (chunks of 16 rows). Each step multiplies two
// weight tiles into two activation chunks (four accumulators, the most that eight tiles allow),
// so each tile loaded feeds two multiplies. A finished accumulator is transposed in AVX-512
// registers and written as 16 output rows.
//
// Two walks (gemm_resident, gemm_parked). Where the packed activations fit in half of L2 (up
// to kResidentBytes: 256 rows at 2048 features), and for any prompt of up to four chunks,
// each block of 32 weight rows is taken whole, all of k, into a slab that stays in L2, and
// every accumulator walks the whole of k in its tile: loaded once, stored once, the
// activations streaming from L2. Past that the weight is walked in blocks of 32 rows by
// kKBlock values: a block stays in L1 while every chunk of activation rows passes over it,
// the accumulators parked in a buffer between blocks of k (a quarter more tile loads and
// stores than multiplies). Either way the next block's lines are prefetched meanwhile, a
// share per chunk pair.
//
// A bfloat16 weight is not copied first: its tiles load straight from the weight, 16 rows at
// a stride, into the first four chunks at once, with each row's line a few blocks ahead
// prefetched as the decode tiles do, and are stored to the slab or L1 buffer only when more
// chunks follow. Copying it first read it at about 10 GB/s a core, the decode tiles' way
// reads it at about 19.

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels.h"
#include "vec_exp.h"

#if SF_HAVE_AMX
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c,amx-tile,amx-bf16")

namespace sf {
namespace amx {
namespace {

// values of k per block: 32 weight rows x 256 values (16 KB) and an activation chunk pair's
// 16 KB share L1
constexpr int64_t kKBlock = 256;
// activation rows per pass over the weights: their packed values for one block of k (16 KB a
// chunk pair) and their parked accumulators (2 KB per chunk) stay in L2
constexpr int64_t kMBlock = 256;
// blocks of 32 weight rows that take turns over one block of k of the activations (128 KB at
// kMBlock rows) while it is in L2; their parked accumulators take 32 KB each
constexpr int64_t kNGroup = 8;
// activation chunks a bfloat16 weight tile loaded from memory is multiplied into at once
// (accumulator tiles 0-3)
constexpr int64_t kDirectChunks = 4;
// packed activations (16 rows x k bfloat16 per chunk) up to which every accumulator walks
// the whole of k in its tile: half of the 2 MB L2 a core that Sapphire and Emerald Rapids
// have, beside a block of 32 weight rows' slab (up to 512 KB at 8192 features). Past it the
// activations would stream from L3 once per block of weight rows; the parked walk blocks k
// instead. At 128 rows on the 1B model's 2048-feature shapes the resident walk took 0.77-0.81
// of the parked one's time, at 256 rows 0.94-1.0 (bfloat16, one process, alternating)
constexpr int64_t kResidentBytes = int64_t{1} << 20;

#include "amx_tiles.h"

// tiles 0-3: accumulators C[weight tile][chunk] at 2 * t + c; 4, 5: weights; 6, 7: activations.
// Every tile is 16 rows of 64 bytes.
void configure_gemm() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  load_config(cfg);
}

// Prefetches the lines of one block of weights (`rows` rows from `base`, `bytes` of each) a
// share at a time, while the block before it is multiplied
struct BlockPrefetch {
  const char* base = nullptr;
  int64_t stride = 0;
  int rows = 0;
  int64_t lines = 0;  // per row
  int row = 0;        // the next line to fetch: `line` of row `row`
  int64_t line = 0;

  int64_t jump = 0;  // bytes added to the address of rows 16 and on (a gate/up pair's up rows)

  void start(const char* b, int64_t s, int r, int64_t bytes, int64_t j) {
    base = b;
    stride = s;
    rows = r;
    jump = j;
    lines = bytes / 64;
    row = 0;
    line = 0;
  }
  void fetch(int64_t count) {
    for (; count > 0 && row < rows; --count) {
      _mm_prefetch(base + row * stride + (row >= 16 ? jump : 0) + line * 64, _MM_HINT_T1);
      if (++line == lines) {
        line = 0;
        ++row;
      }
    }
  }
  int64_t left() const { return (rows - row) * lines - line; }
};

// A call's weight rows [n0, n1) in blocks of 32 rows, n .. n + 31, two tiles of 16; paired
// (`pair` > 0: a gate and up projection's stacked weight), the 16 gate rows n .. n + 15 and
// their up rows pair + n .. pair + n + 15, whose outputs meet in write_silu. Both walks take
// the blocks this way and write a finished block's outputs with `finish`.
struct BlockRows {
  int64_t m;  // activation rows
  int64_t n1;
  int64_t pair;
  const float* bias;
  Out out;

  int64_t step() const { return pair ? 16 : 32; }
  // the first weight row of tile t of the block at n
  int64_t row(int64_t n, int t) const { return pair ? (t ? pair + n : n) : n + 16 * t; }
  // its tiles: one where a last block has only 16 rows
  int tiles(int64_t n) const { return pair || n1 - n >= 32 ? 2 : 1; }
  // the outputs of the block at n for chunk c (activation rows 16c ..): tile t's finished
  // accumulator at acc(t)
  template <class Acc>
  void finish(int wt, int64_t n, int64_t c, const Acc& acc) const {
    const int64_t m0 = c * 16;
    const int rows = static_cast<int>(std::min<int64_t>(16, m - m0));
    if (pair) {
      write_silu(acc(0), acc(1), rows, bias, n, pair, m0, out);
    } else {
      for (int t = 0; t < wt; ++t) write_tile(acc(t), rows, bias, n + 16 * t, m0, out);
    }
  }
};

// One block of k (`nb` blocks of 32 values) of WT weight tiles (`wpk`, from pack_block)
// against XC activation chunks (`x0`, `x1` at the block's first 32 values, `chunks` tiles
// from one block of 32 to the next, pack_x_gemm's order): the accumulators
// start from zero (`first`) or from `park`, and end in `park`. With `pf`, `per` of its lines
// are prefetched before each block of 32.
template <int WT, int XC>
inline void step_block(const char* wpk, const uint32_t* x0, const uint32_t* x1, int64_t nb,
                       int64_t chunks, bool first, float* park, BlockPrefetch* pf, int64_t per) {
  if (first) {
    _tile_zero(0);
    if (XC == 2) _tile_zero(1);
    if (WT == 2) _tile_zero(2);
    if (WT == 2 && XC == 2) _tile_zero(3);
  } else {
    SF_TILE_LOADD(0, park, 64);
    if (XC == 2) SF_TILE_LOADD(1, park + 256, 64);
    if (WT == 2) SF_TILE_LOADD(2, park + 512, 64);
    if (WT == 2 && XC == 2) SF_TILE_LOADD(3, park + 768, 64);
  }
  for (int64_t b = 0; b < nb; ++b) {
    if (pf) pf->fetch(per);
    SF_TILE_LOADD(4, wpk + b * 2048, 64);
    SF_TILE_LOADD(6, x0 + b * chunks * 256, 64);
    if (XC == 2) SF_TILE_LOADD(7, x1 + b * chunks * 256, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (XC == 2) _tile_dpbf16ps(1, 4, 7);
    if (WT == 2) {
      SF_TILE_LOADD(5, wpk + b * 2048 + 1024, 64);
      _tile_dpbf16ps(2, 5, 6);
      if (XC == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  SF_TILE_STORED(0, park, 64);
  if (XC == 2) SF_TILE_STORED(1, park + 256, 64);
  if (WT == 2) SF_TILE_STORED(2, park + 512, 64);
  if (WT == 2 && XC == 2) SF_TILE_STORED(3, park + 768, 64);
}

// The first pass over a block of k (`nb` blocks of 32 values) for a bfloat16 weight read in
// place: one weight tile of 16 rows (`w` at the block's first value, `stride` bytes a row)
// against XC (1-4) activation chunks at once (`x` at the first chunk's block, pack_x_gemm's
// order), so each tile loaded from memory feeds XC multiplies. Each row's line `kPf` blocks
// ahead is prefetched as the decode tiles do, running on into `next`, the 16 rows visited
// after these; when later chunks reuse the tiles (`keep`), they are stored to `wpk` in
// step_block's order. Accumulator i starts from zero (`first`) or `park[i]` and ends there.
constexpr int64_t kPf = 4;
template <int XC>
inline void step_direct(const char* w, int64_t stride, const char* next, char* wpk, bool keep,
                        const uint32_t* x, int64_t nb, int64_t chunks, bool first,
                        float* const* park) {
  if (first) {
    _tile_zero(0);
    if (XC > 1) _tile_zero(1);
    if (XC > 2) _tile_zero(2);
    if (XC > 3) _tile_zero(3);
  } else {
    SF_TILE_LOADD(0, park[0], 64);
    if (XC > 1) SF_TILE_LOADD(1, park[1], 64);
    if (XC > 2) SF_TILE_LOADD(2, park[2], 64);
    if (XC > 3) SF_TILE_LOADD(3, park[3], 64);
  }
  // weight tiles alternate between 4 and 5 and activation tiles between 6 and 7, so no load
  // replaces a tile that the multiply just before it reads
#define SF_DIRECT_ONE(B, W)                                                               \
  do {                                                                                    \
    const int64_t at = (B) + kPf;                                                         \
    const char* pbase = at < nb ? w + at * 64 : (next ? next + (at - nb) * 64 : nullptr);   \
    if (pbase) {                                                                          \
      _Pragma("GCC unroll 16") for (int r = 0; r < 16; ++r)                               \
          _mm_prefetch(pbase + r * stride, _MM_HINT_T0);                                  \
    }                                                                                     \
    const uint32_t* xb = x + (B) * chunks * 256;                                          \
    SF_TILE_LOADD(W, w + (B) * 64, stride);                                               \
    SF_TILE_LOADD(6, xb, 64);                                                             \
    _tile_dpbf16ps(0, W, 6);                                                              \
    if (XC > 1) {                                                                         \
      SF_TILE_LOADD(7, xb + 256, 64);                                                     \
      _tile_dpbf16ps(1, W, 7);                                                            \
    }                                                                                     \
    if (XC > 2) {                                                                         \
      SF_TILE_LOADD(6, xb + 512, 64);                                                     \
      _tile_dpbf16ps(2, W, 6);                                                            \
    }                                                                                     \
    if (XC > 3) {                                                                         \
      SF_TILE_LOADD(7, xb + 768, 64);                                                     \
      _tile_dpbf16ps(3, W, 7);                                                            \
    }                                                                                     \
    if (keep) SF_TILE_STORED(W, wpk + (B) * 2048, 64);                                    \
  } while (0)
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    SF_DIRECT_ONE(b, 4);
    SF_DIRECT_ONE(b + 1, 5);
  }
  if (b < nb) SF_DIRECT_ONE(b, 4);
#undef SF_DIRECT_ONE
  SF_TILE_STORED(0, park[0], 64);
  if (XC > 1) SF_TILE_STORED(1, park[1], 64);
  if (XC > 2) SF_TILE_STORED(2, park[2], 64);
  if (XC > 3) SF_TILE_STORED(3, park[3], 64);
}

using DirectFn = void (*)(const char*, int64_t, const char*, char*, bool, const uint32_t*,
                          int64_t, int64_t, bool, float* const*);

DirectFn direct_for(int xc) {
  switch (xc) {
    case 1: return step_direct<1>;
    case 2: return step_direct<2>;
    case 3: return step_direct<3>;
    default: return step_direct<4>;
  }
}

// 32 int8 weights times their scale, rounded to bfloat16 (round to nearest even, as the dense
// path's dequantisation rounds them), as the 64 bytes of one tile row
inline __m512i dequant32(const int8_t* q, __m512 s) {
  const __m512 lo = _mm512_mul_ps(
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)))), s);
  const __m512 hi = _mm512_mul_ps(
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)))), s);
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

// The int8 weight and its scales: one float32 per row (`scale`) or a float16 per block of 32
// (`bscale`, [n, k / 32])
struct Q8Weight {
  static constexpr int64_t kBlockBytes = 32;  // stored bytes per block of 32 values
  static constexpr bool kDirect = false;
  const int8_t* w;
  const float* scale;
  const uint16_t* bscale;
  int64_t k;

  const char* row(int64_t n) const { return reinterpret_cast<const char*>(w + n * k); }
  // the 32 values of block b of row n, dequantised and rounded to bfloat16
  __m512i block(int64_t n, int64_t b) const {
    const __m512 s =
        _mm512_set1_ps(bscale ? _cvtsh_ss(bscale[n * (k / 32) + b]) : scale[n]);
    return dequant32(w + n * k + b * 32, s);
  }
};

// int4 codes (16 bytes per group of 32: byte j holds value j in its low nibble and value
// j + 16 in its high one) with a float16 scale and offset per group: code * scale + offset,
// fused as the dense path's dequantisation computes it, rounded to bfloat16
struct Q4Weight {
  static constexpr int64_t kBlockBytes = 16;
  static constexpr bool kDirect = false;
  const uint8_t* codes;
  const uint16_t* gscale;
  const uint16_t* goffset;
  int64_t k;

  const char* row(int64_t n) const { return reinterpret_cast<const char*>(codes + n * (k / 2)); }
  __m512i block(int64_t n, int64_t b) const {
    const int64_t g = n * (k / 32) + b;
    const __m512i c = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + g * 16)));
    const __m512 sc = _mm512_set1_ps(_cvtsh_ss(gscale[g]));
    const __m512 of = _mm512_set1_ps(_cvtsh_ss(goffset[g]));
    const __m512 lo = _mm512_fmadd_ps(
        _mm512_cvtepi32_ps(_mm512_and_si512(c, _mm512_set1_epi32(0x0f))), sc, of);
    const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(c, 4)), sc, of);
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  }
};

// A bfloat16 weight as it is, `ld` values from one row to the next: a block is its 64 bytes
struct BF16Weight {
  static constexpr int64_t kBlockBytes = 64;
  static constexpr bool kDirect = true;
  const uint16_t* w;
  int64_t k;
  int64_t ld;

  const char* row(int64_t n) const { return reinterpret_cast<const char*>(w + n * ld); }
  __m512i block(int64_t n, int64_t b) const { return _mm512_loadu_si512(w + n * ld + b * 32); }
};

// A block of weights, `rows` (16 or 32) rows from row n by `nb` blocks of 32 values from block
// kb, dequantised contiguous in the order step_block reads (piece, tile, row): in place the
// weight's rows lie a power of two apart in the models' shapes, so they would all fall in a
// few L1 sets and leave L1 before the next chunk of activations comes back to them
template <typename Wt>
inline void pack_block(const Wt& q, int64_t n, int rows, int64_t kb, int64_t nb, char* wpk) {
  for (int r = 0; r < rows; ++r) {
    char* dst = wpk + (r / 16) * 1024 + (r % 16) * 64;
    for (int64_t b = 0; b < nb; ++b) _mm512_store_si512(dst + b * 2048, q.block(n + r, kb + b));
  }
}

using StepFn = void (*)(const char*, const uint32_t*, const uint32_t*, int64_t, int64_t, bool,
                        float*, BlockPrefetch*, int64_t);

StepFn step_for(int wt, int xc) {
  if (wt == 2) return xc == 2 ? step_block<2, 2> : step_block<2, 1>;
  return xc == 2 ? step_block<1, 2> : step_block<1, 1>;
}

}  // namespace

namespace {

// Rows n0 .. n1 of the product for activations past kResidentBytes: k in blocks of kKBlock,
// the accumulators parked between them (the file's header)
template <typename Wt>
void gemm_parked(const uint32_t* xp, int64_t m, int64_t k, const Wt& q, const float* bias,
                 int64_t n0, int64_t n1, int64_t pair, Out out) {
  configure_gemm();
  constexpr int64_t bb = Wt::kBlockBytes;  // stored bytes per block of 32 values
  const int64_t stride = q.row(1) - q.row(0);  // bytes per weight row
  const int64_t kblocks = k / 32;
  const int64_t kstep = kKBlock / 32;
  const int64_t chunks = (m + 15) / 16;
  const int64_t mchunks = kMBlock / 16;
  const int64_t pairs_max = (std::min(chunks, mchunks) + 1) / 2;
  const BlockRows br{m, n1, pair, bias, out};
  const int64_t step = br.step();
  // groups of kNGroup blocks share each block of k of the activations (more than
  // kDirectChunks chunks come here: fewer take the resident walk)
  const int64_t ngroup = kNGroup;
  // parked accumulators: 4 tiles (1 KB each) per chunk pair of one M block (of at most
  // kMBlock rows), per block of weight rows of a group
  thread_local std::vector<float> park_buf;
  scratch(park_buf, static_cast<size_t>(ngroup * pairs_max * 1024 + 16));
  float* park = reinterpret_cast<float*>(
      (reinterpret_cast<uintptr_t>(park_buf.data()) + 63) & ~uintptr_t{63});
  thread_local std::vector<char> wpk_buf;
  scratch(wpk_buf, kstep * 2048 + 64);
  char* wpk = reinterpret_cast<char*>(
      (reinterpret_cast<uintptr_t>(wpk_buf.data()) + 63) & ~uintptr_t{63});
  BlockPrefetch pf;
  for (int64_t c0 = 0; c0 < chunks; c0 += mchunks) {
    const int64_t c1 = std::min(chunks, c0 + mchunks);
    // a group of weight rows shares each block of k of the activations while it is in L2
    for (int64_t g0 = n0; g0 < n1; g0 += step * ngroup) {
      const int64_t g1 = std::min(n1, g0 + step * ngroup);
      for (int64_t kb = 0; kb < kblocks; kb += kstep) {
        const int64_t kb1 = std::min(kblocks, kb + kstep);
        for (int64_t n = g0; n < g1; n += step) {
          const int wt = br.tiles(n);
          // a bfloat16 weight's tiles load from the weight itself in the first pass (which
          // stores them for the later chunks); an integer one is dequantised first
          const bool direct = Wt::kDirect;
          // the block after this one: the group's next rows, else its first rows' next k,
          // else the next group's first. It is prefetched while the chunk pairs multiply this
          // one, a share per pair; a bfloat16 weight's first pass prefetches for itself, so
          // only what pairs follow it fetch for the next block's
          const int64_t later = direct ? std::max<int64_t>(0, c1 - c0 - kDirectChunks) : c1 - c0;
          const int64_t fetchers = (later + 1) / 2;
          int64_t nn = -1, nkb = 0, nkb1 = 0;  // the next block: rows from nn, k nkb .. nkb1
          if (n + step < g1) {
            nn = n + step, nkb = kb, nkb1 = kb1;
          } else if (kb1 < kblocks) {
            nn = g0, nkb = kb1, nkb1 = std::min(kblocks, kb1 + kstep);
          } else if (g1 < n1) {
            nn = g1, nkb = 0, nkb1 = std::min(kstep, kblocks);
          }
          if (fetchers == 0 || nn < 0)
            pf.start(nullptr, 0, 0, 0, 0);
          else
            pf.start(q.row(br.row(nn, 0)) + nkb * bb, stride, 16 * br.tiles(nn), (nkb1 - nkb) * bb,
                     (br.row(nn, 1) - br.row(nn, 0) - 16) * stride);
          if (!direct)
            for (int t = 0; t < wt; ++t) pack_block(q, br.row(n, t), 16, kb, kb1 - kb, wpk + t * 1024);
          const int64_t share = fetchers ? (pf.left() + fetchers - 1) / fetchers : 0;
          float* gpark = park + (n - g0) / step * pairs_max * 1024;
          int64_t cstart = c0;
          if (direct) {
            // the first (up to) kDirectChunks chunks take each weight tile from memory, 16 rows
            // at a time
            const int xq = static_cast<int>(std::min<int64_t>(kDirectChunks, c1 - c0));
            const auto acc = [&](int t, int i) { return gpark + i / 2 * 1024 + (2 * t + i % 2) * 256; };
            for (int t = 0; t < wt; ++t) {
              float* pks[4];
              for (int i = 0; i < xq; ++i) pks[i] = acc(t, i);
              // the slab visited after this one, whose first lines the prefetch runs into
              const char* next = nullptr;
              if (t + 1 < wt) next = q.row(br.row(n, t + 1)) + kb * bb;
              else if (nn >= 0) next = q.row(br.row(nn, 0)) + nkb * bb;
              direct_for(xq)(q.row(br.row(n, t)) + kb * bb, stride, next, wpk + t * 1024,
                             c1 - c0 > xq, xp + (kb * chunks + c0) * 256, kb1 - kb, chunks,
                             kb == 0, pks);
            }
            if (kb1 == kblocks)
              for (int i = 0; i < xq; ++i) br.finish(wt, n, c0 + i, [&](int t) { return acc(t, i); });
            cstart = c0 + xq;
          }
          for (int64_t c = cstart; c < c1; c += 2) {
            const int xc = c1 - c >= 2 ? 2 : 1;
            float* pk = gpark + (c - c0) / 2 * 1024;
            const uint32_t* x0 = xp + (kb * chunks + c) * 256;
            step_for(wt, xc)(wpk, x0, x0 + 256, kb1 - kb, chunks, kb == 0, pk, nullptr, 0);
            pf.fetch(share);
            if (kb1 == kblocks)
              for (int i = 0; i < xc; ++i)
                br.finish(wt, n, c + i, [&](int t) { return pk + (2 * t + i) * 256; });
          }
        }
      }
    }
  }
  _tile_release();
}

// Rows n0 .. n1 of the product with every accumulator resident in its tile over the whole of
// k (the file's header): per block of 32 weight rows, a bfloat16 weight's first up to four
// chunks load its tiles from memory (storing them to the slab when more chunks follow), an
// integer weight is dequantised into the slab whole; the remaining chunks, in pairs, read
// the slab from L2, each pair prefetching a share of an integer weight's next rows.
template <typename Wt>
void gemm_resident(const uint32_t* xp, int64_t m, int64_t k, const Wt& q, const float* bias,
                   int64_t n0, int64_t n1, int64_t pair, Out out) {
  configure_gemm();
  constexpr int64_t bb = Wt::kBlockBytes;
  const int64_t stride = q.row(1) - q.row(0);  // bytes per weight row
  const int64_t kblocks = k / 32;
  const int64_t chunks = (m + 15) / 16;
  const BlockRows br{m, n1, pair, bias, out};
  const int64_t step = br.step();
  // the block's weight tiles, step_block's order: 2 KB per block of 32 values
  thread_local std::vector<char> slab_buf;
  scratch(slab_buf, kblocks * 2048 + 64);
  char* slab = reinterpret_cast<char*>(
      (reinterpret_cast<uintptr_t>(slab_buf.data()) + 63) & ~uintptr_t{63});
  // finished accumulators: the direct pass's C[t][i] at (4 * t + i) * 256, a pair's at
  // (2 * t + i) * 256
  alignas(64) float acc[8 * 256];
  for (int64_t n = n0; n < n1; n += step) {
    const int wt = br.tiles(n);
    const int64_t nn = n + step < n1 ? n + step : -1;  // the next block's first row
    int64_t cstart = 0;
    if (Wt::kDirect) {
      const int xq = static_cast<int>(std::min<int64_t>(kDirectChunks, chunks));
      for (int t = 0; t < wt; ++t) {
        float* at[4];
        for (int i = 0; i < xq; ++i) at[i] = acc + (4 * t + i) * 256;
        // the slab visited after this one, whose first lines the prefetch runs into
        const char* next = nullptr;
        if (t + 1 < wt) next = q.row(br.row(n, t + 1));
        else if (nn >= 0) next = q.row(br.row(nn, 0));
        direct_for(xq)(q.row(br.row(n, t)), stride, next, slab + t * 1024, chunks > xq, xp,
                       kblocks, chunks, true, at);
      }
      for (int i = 0; i < xq; ++i)
        br.finish(wt, n, i, [&](int t) { return acc + (4 * t + i) * 256; });
      cstart = xq;
    } else {
      for (int t = 0; t < wt; ++t) pack_block(q, br.row(n, t), 16, 0, kblocks, slab + t * 1024);
    }
    // an integer weight's next block is fetched a share per block of 32 of the pairs' walk (a
    // bfloat16 one's direct pass prefetches its own)
    BlockPrefetch pf;
    const int64_t walks = (chunks - cstart + 1) / 2 * kblocks;
    const bool fetch = !Wt::kDirect && nn >= 0 && walks > 0;
    if (fetch)
      pf.start(q.row(br.row(nn, 0)), stride, 16 * br.tiles(nn), stride,
               (br.row(nn, 1) - br.row(nn, 0) - 16) * stride);
    const int64_t per = fetch ? (pf.left() + walks - 1) / walks : 0;
    for (int64_t c = cstart; c < chunks; c += 2) {
      const int xc = chunks - c >= 2 ? 2 : 1;
      const uint32_t* x0 = xp + c * 256;
      step_for(wt, xc)(slab, x0, x0 + 256, kblocks, chunks, true, acc, fetch ? &pf : nullptr,
                       per);
      for (int i = 0; i < xc; ++i)
        br.finish(wt, n, c + i, [&](int t) { return acc + (2 * t + i) * 256; });
    }
  }
  _tile_release();
}

template <typename Wt>
void gemm_impl(const uint32_t* xp, int64_t m, int64_t k, const Wt& q, const float* bias,
               int64_t n0, int64_t n1, int64_t pair, Out out) {
  if (n0 >= n1) return;
  const int64_t chunks = (m + 15) / 16;
  if (chunks <= kDirectChunks || chunks * 16 * k * 2 <= kResidentBytes)
    gemm_resident(xp, m, k, q, bias, n0, n1, pair, out);
  else
    gemm_parked(xp, m, k, q, bias, n0, n1, pair, out);
}

}  // namespace

void gemm_q8(const uint32_t* xp, int64_t m, int64_t k, const int8_t* w, const float* scale,
             const uint16_t* bscale, const float* bias, int64_t n0, int64_t n1, int64_t pair,
             Out out) {
  gemm_impl(xp, m, k, Q8Weight{w, scale, bscale, k}, bias, n0, n1, pair, out);
}

void gemm_q4(const uint32_t* xp, int64_t m, int64_t k, const uint8_t* codes,
             const uint16_t* gscale, const uint16_t* goffset, const float* bias, int64_t n0,
             int64_t n1, int64_t pair, Out out) {
  gemm_impl(xp, m, k, Q4Weight{codes, gscale, goffset, k}, bias, n0, n1, pair, out);
}

void gemm_bf16(const uint32_t* xp, int64_t m, int64_t k, const uint16_t* w, int64_t ldw,
               const float* bias, int64_t n0, int64_t n1, int64_t pair, Out out) {
  gemm_impl(xp, m, k, BF16Weight{w, k, ldw}, bias, n0, n1, pair, out);
}

}  // namespace amx
}  // namespace sf

#pragma GCC pop_options

#else  // no AMX intrinsics in this compiler: the tiles are never granted (isa_amx.cpp)

namespace sf {
namespace amx {
void gemm_q8(const uint32_t*, int64_t, int64_t, const int8_t*, const float*, const uint16_t*,
             const float*, int64_t, int64_t, int64_t, Out) {}
void gemm_q4(const uint32_t*, int64_t, int64_t, const uint8_t*, const uint16_t*,
             const uint16_t*, const float*, int64_t, int64_t, int64_t, Out) {}
void gemm_bf16(const uint32_t*, int64_t, int64_t, const uint16_t*, int64_t, const float*,
               int64_t, int64_t, int64_t, Out) {}
}  // namespace amx
}  // namespace sf

#endif  // SF_HAVE_AMX
