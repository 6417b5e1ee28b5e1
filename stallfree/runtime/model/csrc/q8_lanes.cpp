// int8 weights with their output rows in the vector lanes, for the AVX-512 variant without
// the AMX tiles.
//
// The row-major kernel (isa_avx512.cpp, gemv_q8) holds 64 inputs of one weight row in a
// vector, so each `vpdpbusd` yields sums that span two of the activation's blocks of 32, and
// every one is converted to float and scaled at once: a convert and an FMA per dot, per
// activation row. Here a vector holds 4 inputs of 16 weight rows ([n / 16, k / 4, 16, 4]):
// the activation's 4 codes are broadcast to every lane, 8 dots cover a block of 32 inputs in
// int32, and only then is the block converted and scaled, once per 8 dots. On a Zen 4 that
// took SmolLM2's five projection shapes at 16 rows from 3.3 to 2.0-2.2 ms a step (section
// "int8 weights with their rows in the lanes" of docs/performance.md), where `vpdpbusd`
// itself, not the conversions, is now what binds.
//
// The weight is stored as w + 128 (unsigned, `vpdpbusd`'s first operand); each activation
// row's block sum starts from -128 times the sum of its 32 codes (`corr`), so the int32 lanes
// hold exactly sum(w * x), a code of -128 included.

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,fma,f16c")

namespace sf {
namespace lanes {
namespace {

constexpr int kRows = 8;        // activation rows a tile holds (the rest in further passes)
constexpr int kAheadBytes = 2048;  // prefetch distance into L2: four blocks ahead

inline void store16(Out out, int64_t m, int64_t n, __m512 v) {
  if (out.bf16) {
    auto* p = static_cast<uint16_t*>(out.ptr) + m * out.ldo + n;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
  } else {
    if (out.bf16_values)
      v = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
    _mm512_storeu_ps(static_cast<float*>(out.ptr) + m * out.ldo + n, v);
  }
}

// Four vectors of 16 lanes (lane r: row r's 4 bytes) into rows: out[j]'s 128-bit lane L holds
// row 4L + j's 16 bytes, the four inputs' pieces in order.
inline void transpose4(const __m512i* v, __m512i* out) {
  const __m512i t0 = _mm512_unpacklo_epi32(v[0], v[1]), t1 = _mm512_unpackhi_epi32(v[0], v[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(v[2], v[3]), t3 = _mm512_unpackhi_epi32(v[2], v[3]);
  out[0] = _mm512_unpacklo_epi64(t0, t2);
  out[1] = _mm512_unpackhi_epi64(t0, t2);
  out[2] = _mm512_unpacklo_epi64(t1, t3);
  out[3] = _mm512_unpackhi_epi64(t1, t3);
}

// MB activation rows from m0 against the 16 weight rows of group g. Blocked: a float16 scale
// per (weight row, block) in `bscale` [n / 16, k / 32, 16]; else one per row (`scale`).
// S chains of dots per row, the block's 8 dots split between them where the rows are too few
// to hide the dot's latency, added before the block is scaled. One group at a time keeps a
// thread's reads one stream: SmolLM2's four layer shapes (2 MB pages, 30 copies) took 0.81-0.84
// of the row-major kernel's time at 1 row this way, 0.93 with four groups side by side.
template <int MB, bool Blocked>
void tile(const Q8Act& a, const int32_t* corr, const uint8_t* w, const float* scale,
          const uint16_t* bscale, const float* bias, int64_t m0, int64_t g, bool prefetch,
          Out out) {
  constexpr int S = MB >= 4 ? 1 : (MB >= 2 ? 2 : 4);
  const int64_t k = a.k, kb = k / 32, cb = a.kp / 32;
  const uint8_t* wg = w + g * 16 * k;
  const uint16_t* sg = Blocked ? bscale + g * kb * 16 : nullptr;
  const int8_t* xq[MB];
  const float* xd[MB];
  const int32_t* xc[MB];
  for (int i = 0; i < MB; ++i) {
    xq[i] = a.q + (m0 + i) * a.kp;
    xd[i] = a.d + (m0 + i) * cb;
    xc[i] = corr + (m0 + i) * kb;
  }
  __m512 acc[MB];
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < kb; ++b) {
    __m512i dot[MB][S];
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) {
      dot[i][0] = _mm512_set1_epi32(xc[i][b]);
#pragma GCC unroll 4
      for (int t = 1; t < S; ++t) dot[i][t] = _mm512_setzero_si512();
    }
#pragma GCC unroll 8
    for (int q = 0; q < 8; ++q) {
      const uint8_t* p = wg + (b * 8 + q) * 64;
      const __m512i wv = _mm512_loadu_si512(p);
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(p) + kAheadBytes, _MM_HINT_T1);
#pragma GCC unroll 8
      for (int i = 0; i < MB; ++i) {
        int32_t four;
        __builtin_memcpy(&four, xq[i] + b * 32 + q * 4, 4);
        dot[i][q % S] = _mm512_dpbusd_epi32(dot[i][q % S], wv, _mm512_set1_epi32(four));
      }
    }
    __m512 ws = _mm512_set1_ps(1.f);
    if constexpr (Blocked)
      ws = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sg + b * 16)));
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) {
      __m512i sum = dot[i][0];
#pragma GCC unroll 4
      for (int t = 1; t < S; ++t) sum = _mm512_add_epi32(sum, dot[i][t]);
      const __m512 v = _mm512_cvtepi32_ps(sum);
      const __m512 d = _mm512_set1_ps(xd[i][b]);
      if constexpr (Blocked) {
        acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(v, d), ws, acc[i]);
      } else {
        acc[i] = _mm512_fmadd_ps(v, d, acc[i]);
      }
    }
  }
  const int64_t n = g * 16;
  const __m512 s = Blocked ? _mm512_set1_ps(1.f) : _mm512_loadu_ps(scale + n);
  const __m512 bv = bias ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i) store16(out, m0 + i, n, _mm512_fmadd_ps(acc[i], s, bv));
}

// Every activation row against the groups [g0, g1), kRows rows a pass over a group (its
// weights stay in L1 for the passes after the first, which alone prefetches): `run(mb, m0,
// g, first)` runs one tile, `mb` a std::integral_constant of its rows.
template <class Run>
void over_tiles(int64_t m, int64_t g0, int64_t g1, Run run) {
  using std::integral_constant;
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t m0 = 0; m0 < m; m0 += kRows) {
      const bool first = m0 == 0;
      switch (std::min<int64_t>(kRows, m - m0)) {
        case 1: run(integral_constant<int, 1>{}, m0, g, first); break;
        case 2: run(integral_constant<int, 2>{}, m0, g, first); break;
        case 3: run(integral_constant<int, 3>{}, m0, g, first); break;
        case 4: run(integral_constant<int, 4>{}, m0, g, first); break;
        case 5: run(integral_constant<int, 5>{}, m0, g, first); break;
        case 6: run(integral_constant<int, 6>{}, m0, g, first); break;
        case 7: run(integral_constant<int, 7>{}, m0, g, first); break;
        default: run(integral_constant<int, 8>{}, m0, g, first); break;
      }
    }
  }
}

template <bool Blocked>
void gemv_t(const Q8Act& a, const int32_t* corr, const uint8_t* w, const float* scale,
            const uint16_t* bscale, const float* bias, int64_t g0, int64_t g1, Out out) {
  over_tiles(a.m, g0, g1, [&](auto mb, int64_t m0, int64_t g, bool first) {
    tile<decltype(mb)::value, Blocked>(a, corr, w, scale, bscale, bias, m0, g, first, out);
  });
}

// int4 codes with 16 weight rows in the lanes: per group of 16 rows and block of 32 inputs,
// 4 vectors of 64 bytes (`codes` [n / 16, k / 32, 4, 64]); byte t of lane r in vector q holds
// row r's code q * 4 + t of the block in its low nibble and code 16 + q * 4 + t in its high
// one, so the low nibbles meet the activation's codes q * 4 .. + 3 and the high ones 16 + q *
// 4 .. + 3, 8 dots a block in int32 (the codes are unsigned, the activation's signed: no
// correction). w = code * scale + offset per (row, block): the block's sum is d * scale *
// dot + offset * d * sum(x codes), the second term from the activation's `bsum`.
template <int MB>
void tile4(const Q8Act& a, const uint8_t* codes, const uint16_t* gscale, const uint16_t* goffset,
           const float* bias, int64_t m0, int64_t g, bool prefetch, Out out) {
  constexpr int S = MB >= 4 ? 1 : (MB >= 2 ? 2 : 4);
  const int64_t kb = a.k / 32, cb = a.kp / 32;
  const uint8_t* cg = codes + g * 16 * (a.k / 2);
  const uint16_t* sg = gscale + g * kb * 16;
  const uint16_t* og = goffset + g * kb * 16;
  const __m512i low = _mm512_set1_epi8(0x0f);
  const int8_t* xq[MB];
  const float* xd[MB];
  const float* xs[MB];
  for (int i = 0; i < MB; ++i) {
    xq[i] = a.q + (m0 + i) * a.kp;
    xd[i] = a.d + (m0 + i) * cb;
    xs[i] = a.bsum + (m0 + i) * cb;
  }
  __m512 acc[MB];
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < kb; ++b) {
    __m512i dot[MB][S];
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
      for (int t = 0; t < S; ++t) dot[i][t] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {
      const uint8_t* p = cg + (b * 4 + q) * 64;
      const __m512i v = _mm512_loadu_si512(p);
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(p) + kAheadBytes, _MM_HINT_T1);
      const __m512i lo = _mm512_and_si512(v, low);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
#pragma GCC unroll 8
      for (int i = 0; i < MB; ++i) {
        int32_t x0, x1;
        __builtin_memcpy(&x0, xq[i] + b * 32 + q * 4, 4);
        __builtin_memcpy(&x1, xq[i] + b * 32 + 16 + q * 4, 4);
        __m512i& d0 = dot[i][(2 * q) % S];
        d0 = _mm512_dpbusd_epi32(d0, lo, _mm512_set1_epi32(x0));
        __m512i& d1 = dot[i][(2 * q + 1) % S];
        d1 = _mm512_dpbusd_epi32(d1, hi, _mm512_set1_epi32(x1));
      }
    }
    const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sg + b * 16)));
    const __m512 of = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(og + b * 16)));
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) {
      __m512i sum = dot[i][0];
#pragma GCC unroll 4
      for (int t = 1; t < S; ++t) sum = _mm512_add_epi32(sum, dot[i][t]);
      const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(xd[i][b]));
      acc[i] = _mm512_fmadd_ps(v, sc, acc[i]);
      acc[i] = _mm512_fmadd_ps(of, _mm512_set1_ps(xs[i][b]), acc[i]);
    }
  }
  const int64_t n = g * 16;
  const __m512 bv = bias ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i) store16(out, m0 + i, n, _mm512_add_ps(acc[i], bv));
}

}  // namespace

void block_corrections(const Q8Act& a, int32_t* corr) {
  const int64_t kb = a.k / 32;
  for (int64_t r = 0; r < a.m; ++r) {
    const int8_t* q = a.q + r * a.kp;
    for (int64_t b = 0; b < kb; ++b) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + b * 32));
      const __m512i wide = _mm512_cvtepi8_epi16(v);
      const __m512i pairs = _mm512_madd_epi16(wide, _mm512_set1_epi16(1));
      corr[r * kb + b] = -128 * _mm512_reduce_add_epi32(pairs);
    }
  }
}

void gemv_q8(const Q8Act& a, const int32_t* corr, const uint8_t* w, const float* scale,
             const uint16_t* bscale, const float* bias, int64_t g0, int64_t g1, Out out) {
  if (bscale)
    gemv_t<true>(a, corr, w, scale, bscale, bias, g0, g1, out);
  else
    gemv_t<false>(a, corr, w, scale, bscale, bias, g0, g1, out);
}

// Dequantising transposes each block in registers (gathering each row's 8 pieces took a
// 64-row Q8_0 prompt's products from 54-63% to 43-44% of the bfloat16 peak). The codes stay
// w + 128, read unsigned: (c - 128) * s is c * s - 128 * s, one FMA.
template <int L>
inline void dequant_q8_lane(const __m512i* t, int64_t g, int64_t b, int64_t kb,
                            const float* scale, const uint16_t* bscale, Out out) {
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    const int r = 4 * L + j;
    const int64_t n = g * 16 + r;
    const float sc = bscale ? _cvtsh_ss(bscale[(g * kb + b) * 16 + r]) : scale[n];
    const __m512 sv = _mm512_set1_ps(sc), off = _mm512_set1_ps(-128.f * sc);
    const __m128i first = _mm512_extracti32x4_epi32(t[j], L);
    const __m128i second = _mm512_extracti32x4_epi32(t[j + 4], L);
    store16(out, n, b * 32, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(first)), sv, off));
    store16(out, n, b * 32 + 16,
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(second)), sv, off));
  }
}

void dequant_q8(const uint8_t* w, const float* scale, const uint16_t* bscale, int64_t k,
                int64_t g0, int64_t g1, Out out) {
  const int64_t kb = k / 32;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* wg = w + g * 16 * k;
    for (int64_t b = 0; b < kb; ++b) {
      __m512i v[8], t[8];
#pragma GCC unroll 8
      for (int q = 0; q < 8; ++q) v[q] = _mm512_loadu_si512(wg + (b * 8 + q) * 64);
      transpose4(v, t);          // inputs 0-15 of each row
      transpose4(v + 4, t + 4);  // inputs 16-31
      dequant_q8_lane<0>(t, g, b, kb, scale, bscale, out);
      dequant_q8_lane<1>(t, g, b, kb, scale, bscale, out);
      dequant_q8_lane<2>(t, g, b, kb, scale, bscale, out);
      dequant_q8_lane<3>(t, g, b, kb, scale, bscale, out);
    }
  }
}

void gemv_q4(const Q8Act& a, const uint8_t* codes, const uint16_t* gscale,
             const uint16_t* goffset, const float* bias, int64_t g0, int64_t g1, Out out) {
  over_tiles(a.m, g0, g1, [&](auto mb, int64_t m0, int64_t g, bool first) {
    tile4<decltype(mb)::value>(a, codes, gscale, goffset, bias, m0, g, first, out);
  });
}

template <int L>
inline void dequant_q4_lane(const __m512i* t, int64_t g, int64_t b, int64_t kb,
                            const uint16_t* gscale, const uint16_t* goffset, Out out) {
  const __m512i low = _mm512_set1_epi32(0x0f);
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    const int r = 4 * L + j;
    const int64_t n = g * 16 + r;
    const __m512i c = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(t[j], L));
    const __m512 sc = _mm512_set1_ps(_cvtsh_ss(gscale[(g * kb + b) * 16 + r]));
    const __m512 of = _mm512_set1_ps(_cvtsh_ss(goffset[(g * kb + b) * 16 + r]));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(c, low));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(c, 4));
    store16(out, n, b * 32, _mm512_fmadd_ps(lo, sc, of));
    store16(out, n, b * 32 + 16, _mm512_fmadd_ps(hi, sc, of));
  }
}

void dequant_q4(const uint8_t* codes, const uint16_t* gscale, const uint16_t* goffset,
                int64_t k, int64_t g0, int64_t g1, Out out) {
  const int64_t kb = k / 32;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* cg = codes + g * 16 * (k / 2);
    for (int64_t b = 0; b < kb; ++b) {
      __m512i v[4], t[4];
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) v[q] = _mm512_loadu_si512(cg + (b * 4 + q) * 64);
      transpose4(v, t);  // each row's 16 bytes: the nibble pairs of its block
      dequant_q4_lane<0>(t, g, b, kb, gscale, goffset, out);
      dequant_q4_lane<1>(t, g, b, kb, gscale, goffset, out);
      dequant_q4_lane<2>(t, g, b, kb, gscale, goffset, out);
      dequant_q4_lane<3>(t, g, b, kb, gscale, goffset, out);
    }
  }
}

}  // namespace lanes
}  // namespace sf

#pragma GCC pop_options
