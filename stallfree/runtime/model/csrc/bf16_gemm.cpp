// Prompt-sized bfloat16 products on AVX-512 BF16 without the AMX tiles (a Zen 4):
// y[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]), the weight read in place (an int8 or int4
// weight dequantised 16 rows at a time into cache first: `gemm_dequant`), the activations packed
// once per call in the prompt products' order (pack_x_gemm, shared with amx_gemm.cpp), and the
// same epilogues as the tiles (blocks16.h): a row-major output, a gate/up pair's
// silu(gate) * up, or the next product's packed activations.
//
// torch's F.linear hands oneDNN the row-major weight, which it re-lays out into its blocked
// order on every call; keeping oneDNN's copy as well (`--prepack-prompt-weights`) holds the
// dense weights twice. This product needs neither. It is computed transposed, as the tiles
// compute it: a vector holds one value pair of 16 activation rows (the packed order as it
// is), a weight row's pair is broadcast from the row-major weight, and `vdpbf16ps` adds both
// products into the 16 lanes. A pass holds 8 weight rows by 3 chunks of 16 activation rows in
// 24 accumulators, so each step of a pair loads 3 activation vectors and 8 broadcasts for 24
// multiplies; 16 weight rows (two passes) finish 16 x 16 output blocks, transposed in
// registers as the tiles' are. The weight rows of a block stay in L1 or L2 while every chunk
// of a block of kMBlock activation rows passes over them, and the first chunks' passes
// prefetch the next block's rows into L2.

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "vec_exp.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c")

namespace sf {
namespace avx512 {
namespace {

#include "blocks16.h"

// weight rows and activation chunks (16 rows each) per pass: 24 accumulators, 3 activation
// vectors and a broadcast in 28 of the 32 vector registers
constexpr int kPassRows = 8;
constexpr int kPassChunks = 3;
// activation rows per walk over the weights: their packed values (16 x k bfloat16 per chunk:
// 288 KB at 576 features, 768 KB at 1536) stay in the 1 MB L2 of a Zen 4 core up to
// kResidentBytes; past that (the parked walk) a block of kKBlocks blocks of 32 values of them
// does, while kNGroup blocks of 16 weight rows take turns over it
constexpr int64_t kMBlockChunks = 16;
constexpr int64_t kResidentBytes = int64_t{768} << 10;
constexpr int64_t kKBlocks = 16;
constexpr int64_t kNGroup = 8;

inline __m512i broadcast_pair(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm512_set1_epi32(v);
}

// Accumulators for weight rows w[0..7] (each at its first value of this pass) against XC chunks
// of packed activations (`x` at the first chunk's first block of this pass, `cstride` values
// from one block of 32 to the next) over `kb` blocks of 32 values, starting from zero (`first`)
// or from `dst`, stored to dst + c * 256 + j * 16 (a chunk's 16 x 16 block, weight row j's
// lanes). With `pf`, each block's line of the rows pf[0..7] is prefetched into L2 as it goes.
template <int XC>
void pass(const uint16_t* const (&w)[kPassRows], const uint32_t* x, int64_t kb, int64_t cstride,
          bool first, float* dst, const char* const* pf) {
  __m512 acc[kPassRows][XC];
#pragma GCC unroll 8
  for (int j = 0; j < kPassRows; ++j)
#pragma GCC unroll 3
    for (int c = 0; c < XC; ++c)
      acc[j][c] = first ? _mm512_setzero_ps() : _mm512_load_ps(dst + c * 256 + j * 16);
  for (int64_t b = 0; b < kb; ++b) {
    if (pf)
#pragma GCC unroll 8
      for (int j = 0; j < kPassRows; ++j) _mm_prefetch(pf[j] + b * 64, _MM_HINT_T1);
    const uint32_t* xb = x + b * cstride;
#pragma GCC unroll 16
    for (int p = 0; p < 16; ++p) {
      __m512i xv[XC];
#pragma GCC unroll 3
      for (int c = 0; c < XC; ++c) xv[c] = _mm512_load_si512(xb + c * 256 + p * 16);
#pragma GCC unroll 8
      for (int j = 0; j < kPassRows; ++j) {
        const __m512i wv = broadcast_pair(w[j] + b * 32 + 2 * p);
#pragma GCC unroll 3
        for (int c = 0; c < XC; ++c)
          acc[j][c] = _mm512_dpbf16_ps(acc[j][c], (__m512bh)xv[c], (__m512bh)wv);
      }
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < kPassRows; ++j)
#pragma GCC unroll 3
    for (int c = 0; c < XC; ++c) _mm512_store_ps(dst + c * 256 + j * 16, acc[j][c]);
}

using PassFn = void (*)(const uint16_t* const (&)[kPassRows], const uint32_t*, int64_t, int64_t,
                        bool, float*, const char* const*);
constexpr PassFn kPasses[kPassChunks] = {pass<1>, pass<2>, pass<3>};

// The chunks [c0, c1) in groups of at most kPassChunks, as even as they go (16 chunks as 3, 3,
// 3, 3, 2, 2: a pass of one chunk makes 9 loads for 8 multiplies): fn(first chunk, count)
template <class Fn>
void chunk_groups(int64_t c0, int64_t c1, const Fn& fn) {
  const int64_t count = c1 - c0, groups = (count + kPassChunks - 1) / kPassChunks;
  for (int64_t g = 0, c = c0; g < groups; ++g) {
    const int xc = static_cast<int>(count / groups + (g < count % groups));
    fn(c, xc);
    c += xc;
  }
}

// One call's product over its blocks of 16 output rows (a gate/up pair's 16 gate rows and
// their up rows, whose outputs meet in write_silu), in one of two walks.
struct Walk {
  const uint32_t* xp;
  int64_t m;
  int64_t kb;      // blocks of 32 values
  int64_t chunks;  // of 16 activation rows
  const uint16_t* w;
  int64_t ldw;
  const float* bias;
  int64_t pair;
  Out out;
  // an integer weight's source (`src.fill` set): each block's rows are dequantised into
  // `dq` (tile t's 16 rows of k values at dq + t * 16 * k) before its passes, and `w` is unused
  RowSource src;
  uint16_t* dq;

  int tiles() const { return pair ? 2 : 1; }
  // the first weight row of tile t of the output block at n
  int64_t row(int64_t n, int t) const { return t ? pair + n : n; }
  // where the passes read weight row r of tile t of the output block at n (r < 16)
  const uint16_t* weight_row(int64_t n, int t, int64_t r) const {
    return src.fill ? dq + (t * 16 + r) * (kb * 32) : w + (row(n, t) + r) * ldw;
  }
  // an integer weight's rows of the output block at n into `dq`
  void dequantise(int64_t n) const {
    if (src.fill)
      for (int t = 0; t < tiles(); ++t) src.fill(src.ctx, row(n, t), dq + t * 16 * (kb * 32));
  }

  // The passes of the output block at n for chunks [c, c + xc) over blocks of 32 [b0, b1),
  // tile t's accumulators at acc[t] (a chunk's 16 x 16 block each, 256 floats apart). With
  // `nn` >= 0, the lines of the block at nn from block nb0 on are prefetched meanwhile.
  void passes(int64_t n, int64_t c, int xc, int64_t b0, int64_t b1, bool first,
              float* const* acc, int64_t nn, int64_t nb0) const {
    for (int t = 0; t < tiles(); ++t)
      for (int h = 0; h < 16 / kPassRows; ++h) {
        const uint16_t* rows[kPassRows];
        const char* next[kPassRows];
        for (int j = 0; j < kPassRows; ++j) {
          rows[j] = weight_row(n, t, h * kPassRows + j) + b0 * 32;
          if (nn >= 0)
            next[j] = reinterpret_cast<const char*>(w + (row(nn, t) + h * kPassRows + j) * ldw +
                                                    nb0 * 32);
        }
        kPasses[xc - 1](rows, xp + (b0 * chunks + c) * 256, b1 - b0, chunks * 256, first,
                        acc[t] + h * kPassRows * 16, nn >= 0 ? next : nullptr);
      }
  }

  // the finished outputs of the block at n for chunks [c, c + xc), tile t's at acc[t]
  void finish(int64_t n, int64_t c, int xc, const float* const* acc) const {
    for (int i = 0; i < xc; ++i) {
      const int64_t m0 = (c + i) * 16;
      const int live = static_cast<int>(std::min<int64_t>(16, m - m0));
      if (pair)
        write_silu(acc[0] + i * 256, acc[1] + i * 256, live, bias, n, pair, m0, out);
      else
        write_tile(acc[0] + i * 256, live, bias, n, m0, out);
    }
  }

  // Each block of weight rows over all of k while kMBlockChunks chunks of activations pass
  // over it, its accumulators in registers and then on the stack; the first chunks' passes
  // prefetch the next block's rows (this walk's, or the next walk's first).
  void resident(int64_t n0, int64_t n1) const {
    alignas(64) float a[2][kPassChunks * 256];
    float* acc[2] = {a[0], a[1]};
    for (int64_t mb = 0; mb < chunks; mb += kMBlockChunks) {
      const int64_t mbe = std::min(chunks, mb + kMBlockChunks);
      for (int64_t n = n0; n < n1; n += 16) {
        // (an integer weight's next rows are read in order by its dequantisation instead)
        int64_t nn = n + 16 < n1 ? n + 16 : (mbe < chunks ? n0 : -1);
        if (src.fill) nn = -1;
        dequantise(n);
        chunk_groups(mb, mbe, [&](int64_t c, int xc) {
          passes(n, c, xc, 0, kb, true, acc, c == mb ? nn : -1, 0);
          finish(n, c, xc, acc);
        });
      }
    }
  }

  // Where a walk's packed activations pass kResidentBytes (long rows: a 1B model's 2048 and
  // 8192 features), k in blocks of kKBlocks: up to kNGroup blocks of weight rows take turns
  // over one block of k of the walk's activations (256 KB at 256 rows) while it is in L2,
  // their accumulators parked in L2 between blocks of k.
  void parked(int64_t n0, int64_t n1) const {
    thread_local std::vector<float> park_buf;
    const int64_t per_block = int64_t{2} * kMBlockChunks * 256;  // two tiles' chunks
    float* park = scratch(park_buf, kNGroup * per_block + 16);
    park = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(park) + 63) & ~uintptr_t{63});
    for (int64_t mb = 0; mb < chunks; mb += kMBlockChunks) {
      const int64_t mbe = std::min(chunks, mb + kMBlockChunks);
      for (int64_t g0 = n0; g0 < n1; g0 += 16 * kNGroup) {
        const int64_t g1 = std::min(n1, g0 + 16 * kNGroup);
        for (int64_t b0 = 0; b0 < kb; b0 += kKBlocks) {
          const int64_t b1 = std::min(kb, b0 + kKBlocks);
          for (int64_t n = g0; n < g1; n += 16) {
            float* base = park + (n - g0) / 16 * per_block;
            // the next block's slice: the group's next block, or its first at the next block
            // of k, or the next group's (or the next walk's) first
            int64_t nn = n + 16, nb0 = b0;
            if (nn >= g1) {
              nn = g0;
              nb0 = b1;
              if (b1 >= kb) {
                nn = g1 < n1 ? g1 : (mbe < chunks ? n0 : -1);
                nb0 = 0;
              }
            }
            chunk_groups(mb, mbe, [&](int64_t c, int xc) {
              float* acc[2] = {base + (c - mb) * 256, base + (kMBlockChunks + c - mb) * 256};
              passes(n, c, xc, b0, b1, b0 == 0, acc, c == mb ? nn : -1, nb0);
              if (b1 == kb) finish(n, c, xc, acc);
            });
          }
        }
      }
    }
  }
};

}  // namespace

int64_t packed_gemm_size(int64_t m, int64_t k) { return (m + 15) / 16 * 16 * (k / 2); }

void pack_x_gemm(const uint16_t* x, int64_t m, int64_t k, uint32_t* xp, int64_t b0, int64_t b1) {
  const int64_t chunks = (m + 15) / 16;
  for (int64_t b = b0; b < b1; ++b)
    for (int64_t c = 0; c < chunks; ++c) {
      __m512 r[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i)
        r[i] = c * 16 + i < m
                   ? _mm512_loadu_ps(reinterpret_cast<const float*>(x + (c * 16 + i) * k + b * 32))
                   : _mm512_setzero_ps();
      transpose16(r);  // r[p]: value pair p of each of the 16 rows
      uint32_t* dst = xp + (b * chunks + c) * 256;
#pragma GCC unroll 16
      for (int p = 0; p < 16; ++p) _mm512_store_ps(reinterpret_cast<float*>(dst + p * 16), r[p]);
    }
}

void gemm_dequant(const uint32_t* xp, int64_t m, int64_t k, RowSource src, const float* bias,
                  int64_t n0, int64_t n1, int64_t pair, Out out) {
  if (n0 >= n1 || m <= 0) return;
  // a block's rows dequantised once per walk of 256 activation rows, read from L1 or L2 by
  // every pass (the resident walk only: the parked one would dequantise them per block of k)
  thread_local std::vector<uint16_t> dq_buf;
  uint16_t* dq = scratch(dq_buf, 2 * 16 * k + 32);
  dq = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(dq) + 63) & ~uintptr_t{63});
  const Walk walk{xp, m, k / 32, (m + 15) / 16, nullptr, k, bias, pair, out, src, dq};
  walk.resident(n0, n1);
}

void gemm_bf16(const uint32_t* xp, int64_t m, int64_t k, const uint16_t* w, int64_t ldw,
               const float* bias, int64_t n0, int64_t n1, int64_t pair, Out out) {
  if (n0 >= n1 || m <= 0) return;
  const Walk walk{xp, m, k / 32, (m + 15) / 16, w, ldw, bias, pair, out, RowSource{}, nullptr};
  if (std::min(walk.chunks, kMBlockChunks) * 16 * k * 2 <= kResidentBytes)
    walk.resident(n0, n1);
  else
    walk.parked(n0, n1);
}

}  // namespace avx512
}  // namespace sf

#pragma GCC pop_options
