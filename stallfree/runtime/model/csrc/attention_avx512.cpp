// Paged decode attention, AVX-512 variant (F, BW, VL, DQ): the kernel in attention_impl.h on
// 16-lane float32 vectors.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "attention.h"
#include "kernels.h"
#include "vec_exp.h"

// Only this file's own code gets the instruction set: the standard and project headers above
// are compiled for the baseline (GCC 13 refused to inline libstdc++'s always-inline helpers
// into code under a target pragma that preceded their headers).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c")

namespace sf {
namespace avx512 {
namespace {

struct V {
  using T = __m512;
  static constexpr int64_t W = 16;
  static T zero() { return _mm512_setzero_ps(); }
  static T set1(float x) { return _mm512_set1_ps(x); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T load_bf16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  // int8 codes, as float32 (the row's scale is applied to its scores, not here)
  static T load_i8(const int8_t* p) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  }
  // fp8 e5m2 is the high byte of a float16
  static T load_e5m2(const uint8_t* p) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8));
  }
  // fp8 e4m3 (bias 7) moved into a float16's fields (bias 15), then times 2^8; subnormals too
  static T load_e4m3(const uint8_t* p) {
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8);
    const __m256i mag = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7);
    return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(sign, mag)), _mm512_set1_ps(256.0f));
  }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static void store_bf16(uint16_t* p, T v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
  }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static float sum(T v) { return _mm512_reduce_add_ps(v); }
  // the sums of four vectors, into out[0..3]
  static void sum4(T a0, T a1, T a2, T a3, float* out) {
    const T t0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const T t1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    const T u = _mm512_add_ps(_mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(u), _mm512_extractf32x8_ps(u, 1));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  }
  // lanes [0, n) of v, zeros after
  static T keep_first(T v, int64_t n) {
    return _mm512_maskz_mov_ps(static_cast<__mmask16>((1u << n) - 1), v);
  }
  // p where x is a score (finite), 0 where x is a masked score (-inf)
  static T keep_finite(T x, T p) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, set1(-INFINITY), _CMP_NEQ_OQ), p);
  }
  static T max(T a, T b) { return _mm512_max_ps(a, b); }
  static float reduce_max(T v) { return _mm512_reduce_max_ps(v); }
  // x in lanes [lo, hi) (clamped to the vector), -inf in the others
  static T lanes_or_minus_inf(T x, int64_t lo, int64_t hi) {
    const int64_t a = std::clamp<int64_t>(lo, 0, W), b = std::clamp<int64_t>(hi, 0, W);
    const uint32_t keep = ((1u << b) - 1) & ~((1u << a) - 1);
    return _mm512_mask_mov_ps(set1(-INFINITY), static_cast<__mmask16>(keep), x);
  }
  static T exp(T x) { return exp_avx512(x); }
};

// A bfloat16 prompt's scores on `vdpbf16ps` (prefill_attention_impl.h: its keys transposed
// as value pairs, the queries' pairs broadcast, the scale applied to the sums)
constexpr bool kScorePairs = true;

// scores[i, 0 .. kPromptKeys) = scale * q_i . k_(tb + j) for NQ query vectors of `qs` (each
// `dp` value pairs), the keys' pairs at kt + d * kt_stride (kPromptKeys lanes a pair row)
template <int NQ>
void prompt_scores_pairs(const uint32_t* qs, int64_t dp, const uint32_t* kt, int64_t kt_stride,
                         float scale, float* s) {
  constexpr int NV = kPromptKeys / 16;
  __m512 acc[NQ][NV];
  for (int i = 0; i < NQ; ++i)
    for (int c = 0; c < NV; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int64_t d = 0; d < dp; ++d) {
    __m512i k[NV];
    for (int c = 0; c < NV; ++c) k[c] = _mm512_loadu_si512(kt + d * kt_stride + c * 16);
    for (int i = 0; i < NQ; ++i) {
      const __m512i q = _mm512_set1_epi32(static_cast<int>(qs[i * dp + d]));
      for (int c = 0; c < NV; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], (__m512bh)k[c], (__m512bh)q);
    }
  }
  const __m512 sv = _mm512_set1_ps(scale);
  for (int i = 0; i < NQ; ++i)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(s + i * kPromptKeys + c * 16, _mm512_mul_ps(acc[i][c], sv));
}

#include "attention_impl.h"
#include "prefill_attention_impl.h"

}  // namespace

const DecodeAttnFn decode_attention = decode_attention_impl;
const PrefillTransposeFn prefill_transpose = prefill_transpose_impl;
const PrefillAttnFn prefill_attention = prefill_attention_impl;

}  // namespace avx512
}  // namespace sf

#pragma GCC pop_options
