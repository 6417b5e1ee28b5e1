// bfloat16 weights in 12 bits a value, losslessly, for the decode steps' products
// (`--compact-decode-weights`).
//
// A one-row decode step reads every weight once and does little with it, so its time is the
// weights' bytes over the memory's bandwidth. A bfloat16 value is a sign, 8 exponent bits and
// 7 mantissa bits; its high byte (the sign and the exponent's top 7 bits) takes few values in
// a trained weight's row, since the row's magnitudes span a few powers of two. So a row is
// kept as its values' low bytes (the exponent's last bit and the mantissa) and a 4-bit code per
// value into a table of the row's own 16 most frequent high bytes (0x00, zero and the
// subnormals, is one like any other). A row whose values take more high bytes than that does
// not fit; it is marked (its table's code 0 is 0xFF, which a row that fits never has there:
// 0xFF is a negative NaN or infinity's, moved off code 0 where a row has the most of them),
// and its values are read from the dense weight instead, in the same tile as the rows around
// it. In a 1B Llama's random Gaussian weights (rows of 2048 and 8192 values, no zeros) 2.1% of
// the rows did not fit, most in the down projection's rows of 8192 (8.5% while code 0 was kept
// for 0x00); trained weights fit almost everywhere (all-MiniLM-L6-v2, rounded to bfloat16:
// 302 of 52,157 rows did not fit with 0x00 kept, SmolLM2: 9 of 204,672).
//
// A row is k low bytes, then k / 2 code bytes (1.5 bytes a value, 0.75 of bfloat16's), rows
// back to back. Within each block of 64 values the low bytes and codes are laid out so that
// `vpshufb` (the table lookup, per 128-bit lane) and `vpunpck{l,h}bw` (low and high bytes into
// 16-bit values) give the block's values 0-31 and 32-63 in order: value j < 32 of the block at
// position 16 (j / 8) + j % 8, value 32 + j at 16 (j / 8) + 8 + j % 8; the code of position
// p < 32 in the low nibble of code byte p, of p >= 32 in the high nibble of code byte p - 32.
//
// The product below (the AVX-512 variant's) takes the dense kernel's steps in its order
// (isa_avx512.cpp: `vdpbf16ps` on 32 values at a time, four weight rows a tile, the same sums
// and epilogue), so its outputs are the dense kernel's bits; the AVX2 variant's, in
// isa_avx2.cpp, takes its own dense kernel's from the same layout. Only k % 64 == 0 is
// compacted (the loader keeps the others dense).

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "kernels.h"

namespace sf {
namespace compact {

namespace {

constexpr uint8_t kUnfit = 0xFF;

// where value j (0-63) of a block of 64 sits in the block's low bytes and codes
inline int position(int j) {
  const int i = j < 32 ? j : j - 32;
  return 16 * (i / 8) + (j < 32 ? 0 : 8) + i % 8;
}

}  // namespace

void pack(const uint16_t* w, int64_t ldw, int64_t k, int64_t r0, int64_t r1, uint8_t* codes,
          uint8_t* tables) {
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t* row = w + r * ldw;
    uint8_t* table = tables + r * kCodes;
    std::array<int64_t, 256> count{};
    for (int64_t i = 0; i < k; ++i) ++count[row[i] >> 8];
    // the 16 most frequent (ties: the lower byte first); 0xFF, the mark of a row that does not
    // fit, never at code 0
    std::array<int, 256> order{};
    for (int b = 0; b < 256; ++b) order[b] = b;
    std::partial_sort(order.begin(), order.begin() + kCodes, order.end(), [&](int a, int b) {
      return count[a] > count[b] || (count[a] == count[b] && a < b);
    });
    if (order[0] == kUnfit) std::swap(order[0], order[1]);
    std::array<int, 256> code;
    code.fill(-1);
    int64_t fits = 0;
    for (int c = 0; c < kCodes; ++c) {
      table[c] = static_cast<uint8_t>(order[c]);
      code[order[c]] = c;
      fits += count[order[c]];
    }
    if (fits != k) {
      table[0] = kUnfit;
      continue;
    }
    uint8_t* rec = codes + r * (k + k / 2);
    for (int64_t b = 0; b < k / 64; ++b) {
      uint8_t* lo = rec + b * kBlockBytes;
      uint8_t* nib = lo + 64;
      std::fill(nib, nib + 32, uint8_t{0});
      for (int j = 0; j < 64; ++j) {
        const uint16_t v = row[b * 64 + j];
        const int p = position(j);
        lo[p] = static_cast<uint8_t>(v & 0xFF);
        const auto c = static_cast<uint8_t>(code[v >> 8]);
        if (p < 32) {
          nib[p] |= c;
        } else {
          nib[p - 32] |= static_cast<uint8_t>(c << 4);
        }
      }
    }
  }
}

void unpack(const uint8_t* codes, const uint8_t* tables, int64_t k, int64_t r0, int64_t r1,
            uint16_t* out) {
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* table = tables + r * kCodes;
    for (int64_t b = 0; b < k / 64; ++b) {
      const uint8_t* lo = codes + r * (k + k / 2) + b * kBlockBytes;
      const uint8_t* nib = lo + 64;
      for (int j = 0; j < 64; ++j) {
        const int p = position(j);
        const int c = p < 32 ? nib[p] & 0xF : nib[p - 32] >> 4;
        out[r * k + b * 64 + j] = static_cast<uint16_t>(table[c] << 8 | lo[p]);
      }
    }
  }
}

bool fits(const uint8_t* tables, int64_t r) { return tables[r * kCodes] != kUnfit; }

}  // namespace compact
}  // namespace sf

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,fma,f16c")

#include "avx512_tile.h"

namespace sf {
namespace compact {
namespace {

using avx512::hsum4;
using avx512::store4;

using avx512::kTileM;
using avx512::kTileN;

// The values of a block of 64 of one row: 0-31 in `w0`, 32-63 in `w1`
inline void decode(const uint8_t* lo, const uint8_t* nib, __m512i table, __m512i& w0,
                   __m512i& w1) {
  const __m512i low = _mm512_loadu_si512(lo);
  const __m256i n = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nib));
  const __m512i idx = _mm512_and_si512(
      _mm512_inserti64x4(_mm512_castsi256_si512(n), _mm256_srli_epi16(n, 4), 1),
      _mm512_set1_epi8(0x0F));
  const __m512i high = _mm512_shuffle_epi8(table, idx);
  w0 = _mm512_unpacklo_epi8(low, high);
  w1 = _mm512_unpackhi_epi8(low, high);
}

// How far into a row that does not fit its dense values are fetched ahead (it is read where the
// row's codes would be; the rows around it usually fit, so the next tiles' are not fetched)
constexpr int64_t kDenseAhead = 1024;

// Block b of weight row j: decoded from its codes, or (`dense` not null: a row that does not
// fit) its values as they are
inline void block(const uint8_t* row, const uint16_t* dense, __m512i table, int64_t b,
                  int64_t ahead, __m512i& w0, __m512i& w1) {
  if (dense != nullptr) {
    const uint16_t* p = dense + b * 64;
    _mm_prefetch(reinterpret_cast<const char*>(p) + kDenseAhead, _MM_HINT_T1);
    w0 = _mm512_loadu_si512(p);
    w1 = _mm512_loadu_si512(p + 32);
    return;
  }
  const uint8_t* lo = row + b * kBlockBytes;
  _mm_prefetch(reinterpret_cast<const char*>(lo) + ahead, _MM_HINT_T1);
  _mm_prefetch(reinterpret_cast<const char*>(lo + 64) + ahead, _MM_HINT_T1);
  decode(lo, lo + 64, table, w0, w1);
}

inline __m512 dot(__m512 acc, __m512i x, __m512i w) {
  return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w);
}

// rows n .. n + nb - 1 (their codes at rows[j], or their dense values at dense[j] where not
// null) times activation rows m0 .. m0 + MB - 1. One activation row takes the weight rows one
// after another, not unrolled (the dense kernel's paced loop, for the same reason).
template <int MB>
void tile(const uint16_t* x, int64_t k, const uint8_t* const* rows, const uint16_t* const* dense,
          const __m512i* tables, int64_t m0, int64_t n, int nb, const float* bias, Out out,
          int64_t ahead) {
  __m512 acc[MB][kTileN];
#pragma GCC unroll 4
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < kTileN; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint16_t* xs[MB];
  for (int i = 0; i < MB; ++i) xs[i] = x + (m0 + i) * k;
  for (int64_t b = 0; b < k / 64; ++b) {
    if constexpr (MB == 1) {
      const __m512i x0 = _mm512_loadu_si512(xs[0] + b * 64);
      const __m512i x1 = _mm512_loadu_si512(xs[0] + b * 64 + 32);
#pragma GCC unroll 1
      for (int j = 0; j < kTileN; ++j) {
        __m512i w0, w1;
        block(rows[j], dense[j], tables[j], b, ahead, w0, w1);
        acc[0][j] = dot(dot(acc[0][j], x0, w0), x1, w1);
      }
    } else {
      __m512i w0[kTileN], w1[kTileN];
#pragma GCC unroll 4
      for (int j = 0; j < kTileN; ++j) block(rows[j], dense[j], tables[j], b, ahead, w0[j], w1[j]);
      // the dense kernel's order: each 32 values into every row's sums before the next 32
#pragma GCC unroll 4
      for (int i = 0; i < MB; ++i) {
        const __m512i x0 = _mm512_loadu_si512(xs[i] + b * 64);
#pragma GCC unroll 4
        for (int j = 0; j < kTileN; ++j) acc[i][j] = dot(acc[i][j], x0, w0[j]);
      }
#pragma GCC unroll 4
      for (int i = 0; i < MB; ++i) {
        const __m512i x1 = _mm512_loadu_si512(xs[i] + b * 64 + 32);
#pragma GCC unroll 4
        for (int j = 0; j < kTileN; ++j) acc[i][j] = dot(acc[i][j], x1, w1[j]);
      }
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < MB; ++i)
    store4(out, m0 + i, n, nb, hsum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]), nullptr, bias);
}

}  // namespace

void gemv(const uint16_t* x, int64_t m, int64_t k, const uint8_t* codes, const uint8_t* tables,
          const uint16_t* dense, int64_t ldw, const float* bias, int64_t n0, int64_t n1,
          Out out) {
  const int64_t row_bytes = k + k / 2;
  const int64_t ahead = prefetch_ahead(kTileN * row_bytes);
  for (int64_t n = n0; n < n1; n += kTileN) {
    const int nb = static_cast<int>(std::min<int64_t>(kTileN, n1 - n));
    const uint8_t* rows[kTileN];
    const uint16_t* dense_rows[kTileN];
    __m512i tabs[kTileN];
    for (int j = 0; j < kTileN; ++j) {
      const int64_t r = n + std::min(j, nb - 1);
      rows[j] = codes + r * row_bytes;
      dense_rows[j] = fits(tables, r) ? nullptr : dense + r * ldw;
      tabs[j] = _mm512_broadcast_i32x4(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(tables + r * kCodes)));
    }
    for (int64_t m0 = 0; m0 < m; m0 += kTileM) {
      switch (std::min<int64_t>(kTileM, m - m0)) {
        case 1: tile<1>(x, k, rows, dense_rows, tabs, m0, n, nb, bias, out, ahead); break;
        case 2: tile<2>(x, k, rows, dense_rows, tabs, m0, n, nb, bias, out, ahead); break;
        case 3: tile<3>(x, k, rows, dense_rows, tabs, m0, n, nb, bias, out, ahead); break;
        default: tile<4>(x, k, rows, dense_rows, tabs, m0, n, nb, bias, out, ahead); break;
      }
    }
  }
}

}  // namespace compact
}  // namespace sf

#pragma GCC pop_options
