// Paged decode attention, AVX2 + FMA variant: the kernel in attention_impl.h on 8-lane
// float32 vectors.

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
#pragma GCC target("avx2,fma,f16c")

namespace sf {
namespace avx2 {
namespace {

struct V {
  using T = __m256;
  static constexpr int64_t W = 8;
  static T zero() { return _mm256_setzero_ps(); }
  static T set1(float x) { return _mm256_set1_ps(x); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static T load_bf16(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  // int8 codes, as float32 (the row's scale is applied to its scores, not here)
  static T load_i8(const int8_t* p) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  }
  // fp8 e5m2 is the high byte of a float16
  static T load_e5m2(const uint8_t* p) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(b), 8));
  }
  // fp8 e4m3 (bias 7) moved into a float16's fields (bias 15), then times 2^8; subnormals too
  static T load_e4m3(const uint8_t* p) {
    const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m128i sign = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8);
    const __m128i mag = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7F)), 7);
    return _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(sign, mag)), _mm256_set1_ps(256.0f));
  }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static void store_bf16(uint16_t* p, T v) {
    alignas(32) float f[8];
    _mm256_store_ps(f, v);
    for (int i = 0; i < 8; ++i) p[i] = f32_to_bf16(f[i]);
  }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static float sum(T v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // the sums of four vectors, into out[0..3]
  static void sum4(T a0, T a1, T a2, T a3, float* out) {
    const T t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
  }
  // lanes [0, n) of v, zeros after
  static T keep_first(T v, int64_t n) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), idx);
    return _mm256_and_ps(v, _mm256_castsi256_ps(keep));
  }
  // exp(x): 2^n * p(r), |r| <= ln2 / 2, degree-6 polynomial (relative error about 1e-7)
  // p where x is a score (finite), 0 where x is a masked score (-inf)
  static T keep_finite(T x, T p) {
    return _mm256_and_ps(_mm256_cmp_ps(x, set1(-INFINITY), _CMP_NEQ_OQ), p);
  }
  static T max(T a, T b) { return _mm256_max_ps(a, b); }
  static float reduce_max(T v) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  }
  // x in lanes [lo, hi) (clamped to the vector), -inf in the others
  static T lanes_or_minus_inf(T x, int64_t lo, int64_t hi) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i a = _mm256_set1_epi32(static_cast<int>(std::clamp<int64_t>(lo, 0, W)));
    const __m256i b = _mm256_set1_epi32(static_cast<int>(std::clamp<int64_t>(hi, 0, W)));
    // lane >= a and lane < b
    const __m256i in = _mm256_andnot_si256(_mm256_cmpgt_epi32(a, lane), _mm256_cmpgt_epi32(b, lane));
    return _mm256_blendv_ps(set1(-INFINITY), x, _mm256_castsi256_ps(in));
  }
  static T exp(T x) { return exp_avx2(x); }
};

// no bfloat16 dot products on this variant: a bfloat16 prompt's scores widen to float32
constexpr bool kScorePairs = false;
template <int NQ>
void prompt_scores_pairs(const uint32_t* qs, int64_t dp, const uint32_t* kt, int64_t kt_stride,
                         float scale, float* s);  // never instantiated (kScorePairs)

#include "attention_impl.h"
#include "prefill_attention_impl.h"

}  // namespace

const DecodeAttnFn decode_attention = decode_attention_impl;
const PrefillTransposeFn prefill_transpose = prefill_transpose_impl;
const PrefillAttnFn prefill_attention = prefill_attention_impl;

}  // namespace avx2
}  // namespace sf

#pragma GCC pop_options
