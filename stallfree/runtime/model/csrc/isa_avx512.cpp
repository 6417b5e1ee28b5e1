// The AVX-512 variant (F, BW, VL, DQ, VNNI, BF16): Zen 4, Ice Lake server and newer.
//
// Matrix-vector products stream each weight row once for every activation row of the call:
// a tile of 4 weight rows is loaded per 64 bytes and multiplied into up to 4 activation rows
// (more rows re-read the tile from L1). Integer products use VNNI's u8 x s8 dot
// (`vpdpbusd`) on activations quantised to blocks of 32; bfloat16 uses `vdpbf16ps`.

#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "kernels.h"
#include "vec_exp.h"

// Only this file's own code gets the instruction set: the standard and project headers above
// are compiled for the baseline (GCC 13 refused to inline libstdc++'s always-inline helpers
// into code under a target pragma that preceded their headers).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,fma,f16c")

#include "avx512_tile.h"

namespace sf {
namespace avx512 {
namespace {

inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

inline __m512 load_bf16(const uint16_t* p, __mmask16 m) {
  __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __m256i to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

inline void store(Out out, int64_t m, int64_t n, float v) {
  if (out.bf16) {
    static_cast<uint16_t*>(out.ptr)[m * out.ldo + n] = f32_to_bf16(v);
  } else {
    static_cast<float*>(out.ptr)[m * out.ldo + n] = v;
  }
}

inline __m512 exp_ps(__m512 x) { return exp_avx512(x); }

void quantize(const void* x, bool x_bf16, int64_t row, Q8Act& a) {
  const int64_t k = a.k, kp = a.kp;
  int8_t* q = a.q + row * kp;
  float* d = a.d + row * (kp / 32);
  float* bsum = a.bsum + row * (kp / 32);
  for (int64_t b = 0; b < kp / 32; ++b) {
    const int64_t k0 = b * 32;
    if (k0 >= k) {
      std::fill(q + k0, q + k0 + 32, 0);
      d[b] = 0.f;
      bsum[b] = 0.f;
      continue;
    }
    __m512 v0, v1;
    if (x_bf16) {
      const uint16_t* xp = static_cast<const uint16_t*>(x) + row * k + k0;
      v0 = load_bf16(xp, 0xffff);
      v1 = load_bf16(xp + 16, 0xffff);
    } else {
      const float* xp = static_cast<const float*>(x) + row * k + k0;
      v0 = _mm512_loadu_ps(xp);
      v1 = _mm512_loadu_ps(xp + 16);
    }
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    float scale = amax / 127.f;
    float inv = amax > 0.f ? 127.f / amax : 0.f;
    __m512 iv = _mm512_set1_ps(inv);
    __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, iv));  // round to nearest even
    __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, iv));
    __m128i c0 = _mm512_cvtsepi32_epi8(i0), c1 = _mm512_cvtsepi32_epi8(i1);
    __m256i c = _mm256_set_m128i(c1, c0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k0), c);
    d[b] = scale;
    bsum[b] = scale * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1)));
  }
  int32_t* offset = a.offset + row * (kp / 4);
  float* dvec = a.dvec + row * (kp / 64) * 16;
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t c = 0; c < kp / 64; ++c) {
    const __m512i v = _mm512_loadu_si512(q + c * 64);
    const __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), bias, v);  // 128 * sums
    _mm512_storeu_si512(offset + c * 16, _mm512_sub_epi32(_mm512_setzero_si512(), sum));
    __m512 dv = _mm512_insertf32x8(_mm512_set1_ps(d[2 * c]), _mm256_set1_ps(d[2 * c + 1]), 1);
    _mm512_storeu_ps(dvec + c * 16, dv);
  }
}

// Epilogue of a tile: row i's four sums (times `scale`, plus `bias`) stored.
struct TileOut {
  Out out;
  int64_t m0, n;
  int nb;
  const float* scale;
  const float* bias;
};

// The loop bodies are macros, written once for the whole chunks and once for the masked
// tail: a lambda or a helper taking the accumulators by reference made GCC keep them in
// memory (16 stores per iteration).
//
// `vpdpbusd` multiplies unsigned bytes by signed ones. The weight goes in as the unsigned
// operand, w + 128 (its sign bit flipped, once per weight vector), the activation's signed
// codes as they are, and each lane's sum starts from -128 times the sum of its four codes
// (`Q8Act::offset`, once per row): the lane holds exactly sum(w * x), in one instruction per
// weight vector and activation row. (|x| against w negated where x < 0 took a masked subtract
// more, and wrapped a weight of -128.)
#define SF_Q8_STEP(c, lm)                                                        \
  {                                                                              \
    __m512i wv[kTileN];                                                          \
    __m512 ws[kTileN];                                                           \
    _Pragma("GCC unroll 4") for (int j = 0; j < kTileN; ++j) {                    \
      wv[j] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(lm, w[j] + (c) * 64), bias); \
      _mm_prefetch(reinterpret_cast<const char*>(w[j] + (c) * 64) + ahead, _MM_HINT_T1); \
      if constexpr (Blocked) ws[j] = expand2(bs[j] + (c) * 2, lm);               \
    }                                                                            \
    _Pragma("GCC unroll 4") for (int i = 0; i < MB; ++i) {                        \
      const __m512i xq = _mm512_loadu_si512(xs[i] + (c) * 64);                   \
      const __m512i off = _mm512_loadu_si512(offset[i] + (c) * 16);              \
      const __m512 dv = _mm512_loadu_ps(dvec[i] + (c) * 16);                     \
      _Pragma("GCC unroll 4") for (int j = 0; j < kTileN; ++j) {                  \
        const __m512i dot = _mm512_dpbusd_epi32(off, wv[j], xq);                  \
        const __m512 d = Blocked ? _mm512_mul_ps(dv, ws[j]) : dv;                \
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), d, acc[i][j]);      \
      }                                                                          \
    }                                                                            \
  }

// The two float16 block scales of 64 weights, as 8 lanes each (the dot's lane order); a last
// chunk of 32 values reads one.
inline __m512 expand2(const uint16_t* p, __mmask64 lm) {
  const __m128i h = _mm_maskz_loadu_epi16(lm == ~0ull ? 0x3 : 0x1, p);
  const __m512 f = _mm512_castps128_ps512(_mm_cvtph_ps(h));
  return _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0), f);
}

// Blocked: the weights carry a float16 scale per block of 32 (GGUF's Q8_0 as stored, bs[j]
// rows of [n, k / 32]), applied per lane with the activation's; otherwise one scale per row
// in the epilogue.
template <int MB, bool Blocked>
void q8_tile(const Q8Act& a, const int8_t* const* w, const uint16_t* const* bs,
             const TileOut& t) {
  const int64_t stride = a.kp / 64, full = a.k / 64;  // a last chunk may hold 32 values
  const int64_t ahead = prefetch_ahead(kTileN * a.k);
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  const int8_t* xs[MB];
  const int32_t* offset[MB];
  const float* dvec[MB];
  for (int i = 0; i < MB; ++i) {
    xs[i] = a.q + (t.m0 + i) * a.kp;
    offset[i] = a.offset + (t.m0 + i) * (a.kp / 4);
    dvec[i] = a.dvec + (t.m0 + i) * stride * 16;
  }
  __m512 acc[MB][kTileN];
#pragma GCC unroll 4
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < kTileN; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < full; ++c) SF_Q8_STEP(c, ~0ull)
  if (a.k % 64) SF_Q8_STEP(full, 0xffffffffull)
#pragma GCC unroll 4
  for (int i = 0; i < MB; ++i) store4(t.out, t.m0 + i, t.n, t.nb, hsum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]), t.scale, t.bias);
}
#undef SF_Q8_STEP

template <bool Blocked>
void gemv_q8_t(const Q8Act& a, const int8_t* w, const float* scale, const uint16_t* bscale,
               const float* bias, int64_t n0, int64_t n1, Out out) {
  const int64_t k = a.k;
  for (int64_t n = n0; n < n1; n += kTileN) {
    const int nb = static_cast<int>(std::min<int64_t>(kTileN, n1 - n));
    const int8_t* rows[kTileN];
    const uint16_t* bsr[kTileN];
    for (int j = 0; j < kTileN; ++j) {
      rows[j] = w + (n + std::min(j, nb - 1)) * k;
      bsr[j] = Blocked ? bscale + (n + std::min(j, nb - 1)) * (k / 32) : nullptr;
    }
    for (int64_t m0 = 0; m0 < a.m; m0 += kTileM) {
      const TileOut t{out, m0, n, nb, Blocked ? nullptr : scale, bias};
      switch (std::min<int64_t>(kTileM, a.m - m0)) {
        case 1: q8_tile<1, Blocked>(a, rows, bsr, t); break;
        case 2: q8_tile<2, Blocked>(a, rows, bsr, t); break;
        case 3: q8_tile<3, Blocked>(a, rows, bsr, t); break;
        default: q8_tile<4, Blocked>(a, rows, bsr, t); break;
      }
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

// Four groups of int4 codes (64 bytes) against the activation's matching 128 values. Per
// group g: d_x[g] * scale[g] * dot(codes, x codes) in the lanes here; the offsets' term,
// sum over g of offset[g] * d_x[g] * sum(x codes), is a dot product over the groups done once
// per tile row after the loop (`offset_sums`, on the activation's precomputed `bsum`), sixteen
// groups a vector instead of four lanes per group in every step.
#define SF_Q4_STEP(c, g_here)                                                            \
  {                                                                                      \
    const __mmask64 lm = (g_here) == 4 ? ~0ull : ((1ull << (16 * (g_here))) - 1);       \
    const __mmask8 sm = static_cast<__mmask8>((1u << (g_here)) - 1);                    \
    __m512i lo[kTileN], hi[kTileN];                                                      \
    __m512 sc[kTileN];                                                                   \
    _Pragma("GCC unroll 4") for (int j = 0; j < kTileN; ++j) {                           \
      const __m512i cv = _mm512_maskz_loadu_epi8(lm, codes[j] + (c) * 64);               \
      _mm_prefetch(reinterpret_cast<const char*>(codes[j] + (c) * 64) + ahead, _MM_HINT_T1); \
      lo[j] = _mm512_and_si512(cv, low);                                                 \
      hi[j] = _mm512_and_si512(_mm512_srli_epi16(cv, 4), low);                           \
      sc[j] = expand4(_mm_maskz_loadu_epi16(sm, gs[j] + (c) * 4));                       \
    }                                                                                    \
    _Pragma("GCC unroll 4") for (int i = 0; i < MB; ++i) {                               \
      const int8_t* xp = xq[i] + (c) * 128;                                              \
      const __m512i xa = _mm512_loadu_si512(xp);                                         \
      const __m512i xb = _mm512_loadu_si512(xp + 64);                                    \
      const __m512i xlo = _mm512_shuffle_i64x2(xa, xb, 0x88);                            \
      const __m512i xhi = _mm512_shuffle_i64x2(xa, xb, 0xdd);                            \
      const __m512 dx = _mm512_permutexvar_ps(                                           \
          expand, _mm512_castps128_ps512(_mm_maskz_loadu_ps(sm, xd[i] + (c) * 4)));      \
      _Pragma("GCC unroll 4") for (int j = 0; j < kTileN; ++j) {                         \
        __m512i dot = _mm512_dpbusd_epi32(zero, lo[j], xlo);                             \
        dot = _mm512_dpbusd_epi32(dot, hi[j], xhi);                                      \
        acc[i][j] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), sc[j]), dx, acc[i][j]); \
      }                                                                                  \
    }                                                                                    \
  }

// sum over groups of offset[g] * bsum[g] (bsum: the activation's d * sum(codes) per block of
// 32), in 16 lanes; the caller reduces
inline __m512 offset_sum(const uint16_t* go, const float* bsum, int64_t groups) {
  __m512 s = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g += 16) {
    const __mmask16 m = groups - g >= 16 ? 0xffff : static_cast<__mmask16>((1u << (groups - g)) - 1);
    const __m512 o = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, go + g));
    s = _mm512_fmadd_ps(o, _mm512_maskz_loadu_ps(m, bsum + g), s);
  }
  return s;
}

template <int MB>
void q4_tile(const Q8Act& a, const uint8_t* const* codes, const uint16_t* const* gs,
             const uint16_t* const* go, const TileOut& t) {
  const int64_t groups = a.k / 32, full = groups / 4;
  // tiles ahead, as the int8 and dense kernels fetch (with prefetcht0 on an Intel machine, one
  // tile ahead, half an int8 tile's bytes, left SmolLM2's four shapes at 1-2 rows 1.09-1.10x
  // the time of two)
  const int64_t ahead = prefetch_ahead(kTileN * groups * 16);
  const __m512i low = _mm512_set1_epi8(0x0f);
  const __m512i zero = _mm512_setzero_si512();
  const __m512i expand = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  auto expand4 = [&](__m128i h) __attribute__((always_inline)) {
    return _mm512_permutexvar_ps(expand, _mm512_castps128_ps512(_mm_cvtph_ps(h)));
  };
  const int8_t* xq[MB];
  const float* xd[MB];
  for (int i = 0; i < MB; ++i) {
    xq[i] = a.q + (t.m0 + i) * a.kp;
    xd[i] = a.d + (t.m0 + i) * (a.kp / 32);
  }
  __m512 acc[MB][kTileN];
#pragma GCC unroll 4
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < kTileN; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < full; ++c) SF_Q4_STEP(c, 4)
  if (groups % 4) SF_Q4_STEP(full, static_cast<int>(groups % 4))
#pragma GCC unroll 4
  for (int i = 0; i < MB; ++i) {
    const float* bsum = a.bsum + (t.m0 + i) * (a.kp / 32);
    const __m128 off = hsum4(offset_sum(go[0], bsum, groups), offset_sum(go[1], bsum, groups),
                             offset_sum(go[2], bsum, groups), offset_sum(go[3], bsum, groups));
    store4(t.out, t.m0 + i, t.n, t.nb,
           _mm_add_ps(hsum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]), off), nullptr, t.bias);
  }
}
#undef SF_Q4_STEP

void gemv_q4(const Q8Act& a, const uint8_t* codes, const uint16_t* gscale,
             const uint16_t* goffset, const float* bias, int64_t n0, int64_t n1, Out out) {
  const int64_t groups = a.k / 32;
  for (int64_t n = n0; n < n1; n += kTileN) {
    const int nb = static_cast<int>(std::min<int64_t>(kTileN, n1 - n));
    const uint8_t* rows[kTileN];
    const uint16_t* gs[kTileN];
    const uint16_t* go[kTileN];
    for (int j = 0; j < kTileN; ++j) {
      const int64_t r = n + std::min(j, nb - 1);
      rows[j] = codes + r * groups * 16;
      gs[j] = gscale + r * groups;
      go[j] = goffset + r * groups;
    }
    for (int64_t m0 = 0; m0 < a.m; m0 += kTileM) {
      const TileOut t{out, m0, n, nb, nullptr, bias};
      switch (std::min<int64_t>(kTileM, a.m - m0)) {
        case 1: q4_tile<1>(a, rows, gs, go, t); break;
        case 2: q4_tile<2>(a, rows, gs, go, t); break;
        case 3: q4_tile<3>(a, rows, gs, go, t); break;
        default: q4_tile<4>(a, rows, gs, go, t); break;
      }
    }
  }
}

#define SF_DENSE_STEP(k0, lm, LOADW, LOADX, FMA, WT)                         \
  {                                                                            \
    WT wv[kTileN];                                                             \
    _Pragma("GCC unroll 4") for (int j = 0; j < kTileN; ++j) {                  \
      wv[j] = LOADW(lm, ws[j] + (k0));                                         \
      _mm_prefetch(reinterpret_cast<const char*>(ws[j] + (k0)) + ahead, _MM_HINT_T1); \
    }                                                                          \
    _Pragma("GCC unroll 4") for (int i = 0; i < MB; ++i) {                      \
      const WT xv = LOADX(lm, xs[i] + (k0));                                   \
      _Pragma("GCC unroll 4") for (int j = 0; j < kTileN; ++j) acc[i][j] =      \
          FMA(acc[i][j], xv, wv[j]);                                           \
    }                                                                          \
  }

// One activation row: the four weight rows are taken one after another, not unrolled, so the
// four sums live in memory (a store and a load per step). That paces the loads: on a Zen 4 the
// unrolled loop (sums in registers) took 4-16% longer on a decode step's weights from memory,
// with the same prefetches (docs/performance.md, "A paced loop for one row").
#define SF_PACED_STEP(k0, LOAD, FMA, WT)                                           \
  {                                                                               \
    const WT xv = LOAD(xs[0] + (k0));                                             \
    _Pragma("GCC unroll 1") for (int j = 0; j < kTileN; ++j) {                     \
      const WT wv = LOAD(ws[j] + (k0));                                           \
      _mm_prefetch(reinterpret_cast<const char*>(ws[j] + (k0)) + ahead, _MM_HINT_T1); \
      acc[0][j] = FMA(acc[0][j], xv, wv);                                         \
    }                                                                             \
  }

inline __m512 dot_bf16(__m512 acc, __m512i x, __m512i w) {
  return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w);
}
inline __m512 dot_f32(__m512 acc, __m512 x, __m512 w) { return _mm512_fmadd_ps(x, w, acc); }

template <int MB, bool BF16>
void dense_tile(const void* x, int64_t k, int64_t ldw, const void* const* w, const TileOut& t) {
  __m512 acc[MB][kTileN];
#pragma GCC unroll 4
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < kTileN; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t ahead = prefetch_ahead(kTileN * ldw * (BF16 ? 2 : 4));
  if constexpr (BF16) {
    const uint16_t* ws[kTileN];
    const uint16_t* xs[MB];
    for (int j = 0; j < kTileN; ++j) ws[j] = static_cast<const uint16_t*>(w[j]);
    for (int i = 0; i < MB; ++i) xs[i] = static_cast<const uint16_t*>(x) + (t.m0 + i) * k;
    int64_t k0 = 0;
    if constexpr (MB == 1)
      for (; k0 + 32 <= k; k0 += 32) SF_PACED_STEP(k0, _mm512_loadu_si512, dot_bf16, __m512i)
    for (; k0 + 32 <= k; k0 += 32)
      SF_DENSE_STEP(k0, 0xffffffffu, _mm512_maskz_loadu_epi16, _mm512_maskz_loadu_epi16, dot_bf16, __m512i)
    if (k0 < k) {
      const __mmask32 lm = (1u << (k - k0)) - 1;
      SF_DENSE_STEP(k0, lm, _mm512_maskz_loadu_epi16, _mm512_maskz_loadu_epi16, dot_bf16, __m512i)
    }
  } else {
    const float* ws[kTileN];
    const float* xs[MB];
    for (int j = 0; j < kTileN; ++j) ws[j] = static_cast<const float*>(w[j]);
    for (int i = 0; i < MB; ++i) xs[i] = static_cast<const float*>(x) + (t.m0 + i) * k;
    int64_t k0 = 0;
    if constexpr (MB == 1)
      for (; k0 + 16 <= k; k0 += 16) SF_PACED_STEP(k0, _mm512_loadu_ps, dot_f32, __m512)
    for (; k0 + 16 <= k; k0 += 16)
      SF_DENSE_STEP(k0, 0xffff, _mm512_maskz_loadu_ps, _mm512_maskz_loadu_ps, dot_f32, __m512)
    if (k0 < k) {
      const __mmask16 lm = static_cast<__mmask16>((1u << (k - k0)) - 1);
      SF_DENSE_STEP(k0, lm, _mm512_maskz_loadu_ps, _mm512_maskz_loadu_ps, dot_f32, __m512)
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < MB; ++i) store4(t.out, t.m0 + i, t.n, t.nb, hsum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]), nullptr, t.bias);
}
#undef SF_DENSE_STEP
#undef SF_PACED_STEP

template <bool BF16>
void gemv_dense_t(const void* x, int64_t m, int64_t k, const void* w, int64_t ldw,
                  const float* bias, int64_t n0, int64_t n1, Out out) {
  const int64_t esize = BF16 ? 2 : 4;
  for (int64_t n = n0; n < n1; n += kTileN) {
    const int nb = static_cast<int>(std::min<int64_t>(kTileN, n1 - n));
    const void* rows[kTileN];
    for (int j = 0; j < kTileN; ++j)
      rows[j] = static_cast<const char*>(w) + (n + std::min(j, nb - 1)) * ldw * esize;
    for (int64_t m0 = 0; m0 < m; m0 += kTileM) {
      const TileOut t{out, m0, n, nb, nullptr, bias};
      switch (std::min<int64_t>(kTileM, m - m0)) {
        case 1: dense_tile<1, BF16>(x, k, ldw, rows, t); break;
        case 2: dense_tile<2, BF16>(x, k, ldw, rows, t); break;
        case 3: dense_tile<3, BF16>(x, k, ldw, rows, t); break;
        default: dense_tile<4, BF16>(x, k, ldw, rows, t); break;
      }
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

// float32: torch.rms_norm's arithmetic, x * rsqrt(mean(x^2) + eps) * w.
// bfloat16: transformers' order, w * bf16(float(x) * rsqrt(mean + eps)), the sum x + delta
// rounded to bfloat16 before its statistics.
void rms_norm(const void* x, const void* delta, void* sum, const void* w, void* out, int64_t r0,
              int64_t r1, int64_t dim, float eps, bool bf16) {
  for (int64_t r = r0; r < r1; ++r) {
    __m512 ss = _mm512_setzero_ps();
    if (bf16) {
      const uint16_t* xr = static_cast<const uint16_t*>(x) + r * dim;
      const uint16_t* dr = delta ? static_cast<const uint16_t*>(delta) + r * dim : nullptr;
      uint16_t* sr = dr ? static_cast<uint16_t*>(sum) + r * dim : nullptr;
      for (int64_t k0 = 0; k0 < dim; k0 += 16) {
        const __mmask16 lm = dim - k0 >= 16 ? 0xffff : ((1u << (dim - k0)) - 1);
        __m512 v = load_bf16(xr + k0, lm);
        if (dr) {
          const __m256i s = to_bf16(_mm512_add_ps(v, load_bf16(dr + k0, lm)));
          _mm256_mask_storeu_epi16(sr + k0, lm, s);
          v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(s), 16));
        }
        ss = _mm512_fmadd_ps(v, v, ss);
      }
      const float inv = 1.f / std::sqrt(hsum(ss) / static_cast<float>(dim) + eps);
      const __m512 iv = _mm512_set1_ps(inv);
      const uint16_t* src = sr ? sr : xr;
      const uint16_t* wr = static_cast<const uint16_t*>(w);
      uint16_t* o = static_cast<uint16_t*>(out) + r * dim;
      for (int64_t k0 = 0; k0 < dim; k0 += 16) {
        const __mmask16 lm = dim - k0 >= 16 ? 0xffff : ((1u << (dim - k0)) - 1);
        const __m256i h = to_bf16(_mm512_mul_ps(load_bf16(src + k0, lm), iv));
        const __m512 hv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        _mm256_mask_storeu_epi16(o + k0, lm, to_bf16(_mm512_mul_ps(load_bf16(wr + k0, lm), hv)));
      }
    } else {
      const float* xr = static_cast<const float*>(x) + r * dim;
      const float* dr = delta ? static_cast<const float*>(delta) + r * dim : nullptr;
      float* sr = dr ? static_cast<float*>(sum) + r * dim : nullptr;
      for (int64_t k0 = 0; k0 < dim; k0 += 16) {
        const __mmask16 lm = dim - k0 >= 16 ? 0xffff : ((1u << (dim - k0)) - 1);
        __m512 v = _mm512_maskz_loadu_ps(lm, xr + k0);
        if (dr) {
          v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(lm, dr + k0));
          _mm512_mask_storeu_ps(sr + k0, lm, v);
        }
        ss = _mm512_fmadd_ps(v, v, ss);
      }
      const float inv = 1.f / std::sqrt(hsum(ss) / static_cast<float>(dim) + eps);
      const __m512 iv = _mm512_set1_ps(inv);
      const float* src = sr ? sr : xr;
      const float* wr = static_cast<const float*>(w);
      float* o = static_cast<float*>(out) + r * dim;
      for (int64_t k0 = 0; k0 < dim; k0 += 16) {
        const __mmask16 lm = dim - k0 >= 16 ? 0xffff : ((1u << (dim - k0)) - 1);
        const __m512 h = _mm512_mul_ps(_mm512_maskz_loadu_ps(lm, src + k0), iv);
        _mm512_mask_storeu_ps(o + k0, lm, _mm512_mul_ps(h, _mm512_maskz_loadu_ps(lm, wr + k0)));
      }
    }
  }
}

void silu_mul(const void* gu, void* out, int64_t r0, int64_t r1, int64_t inter, bool bf16) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t k0 = 0; k0 < inter; k0 += 16) {
      const __mmask16 lm = inter - k0 >= 16 ? 0xffff : ((1u << (inter - k0)) - 1);
      if (bf16) {
        const uint16_t* g = static_cast<const uint16_t*>(gu) + r * 2 * inter + k0;
        const __m512 gv = load_bf16(g, lm);
        const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
        const __m256i sb = to_bf16(s);
        const __m512 sv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(sb), 16));
        const __m512 p = _mm512_mul_ps(sv, load_bf16(g + inter, lm));
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + r * inter + k0, lm, to_bf16(p));
      } else {
        const float* g = static_cast<const float*>(gu) + r * 2 * inter + k0;
        const __m512 gv = _mm512_maskz_loadu_ps(lm, g);
        const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
        const __m512 p = _mm512_mul_ps(s, _mm512_maskz_loadu_ps(lm, g + inter));
        _mm512_mask_storeu_ps(static_cast<float*>(out) + r * inter + k0, lm, p);
      }
    }
  }
}

// 16 values to the output row at `p` (float32 or bfloat16, round to nearest even; float32
// holding the bfloat16 values with `bf16_values`)
inline void store16(Out out, int64_t row, int64_t c, __m512 v) {
  if (out.bf16) {
    _mm256_storeu_si256(
        reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out.ptr) + row * out.ldo + c), to_bf16(v));
  } else {
    if (out.bf16_values)
      v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
    _mm512_storeu_ps(static_cast<float*>(out.ptr) + row * out.ldo + c, v);
  }
}

void dequant_q8(const int8_t* w, const float* scale, const uint16_t* bscale, int64_t k,
                int64_t n0, int64_t n1, Out out) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wr = w + n * k;
    for (int64_t c = 0; c < k; c += 32) {
      const float s = bscale ? _cvtsh_ss(bscale[n * (k / 32) + c / 32]) : scale[n];
      const __m512 sv = _mm512_set1_ps(s);
      const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + c));
      const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + c + 16));
      store16(out, n, c, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)), sv));
      store16(out, n, c + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)), sv));
    }
  }
}

void dequant_q4(const uint8_t* codes, const uint16_t* gscale, const uint16_t* goffset, int64_t k,
                int64_t n0, int64_t n1, Out out) {
  const int64_t groups = k / 32;
  const __m512i low = _mm512_set1_epi32(0x0f);
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t g = 0; g < groups; ++g) {
      const __m512i b = _mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + (n * groups + g) * 16)));
      const __m512 sc = _mm512_set1_ps(_cvtsh_ss(gscale[n * groups + g]));
      const __m512 of = _mm512_set1_ps(_cvtsh_ss(goffset[n * groups + g]));
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, low));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
      store16(out, n, g * 32, _mm512_fmadd_ps(lo, sc, of));
      store16(out, n, g * 32 + 16, _mm512_fmadd_ps(hi, sc, of));
    }
  }
}

}  // namespace

const Kernels& kernels() {
  static const Kernels k{"avx512",        quantize,       gemv_q8,  gemv_q4,
                         gemv_dense_bf16, gemv_dense_f32, rms_norm, silu_mul,
                         dequant_q8,      dequant_q4,     compact::gemv};
  return k;
}

}  // namespace avx512
}  // namespace sf

#pragma GCC pop_options
