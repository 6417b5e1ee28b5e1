// The AVX-512 matrix-vector kernels' tile shape and epilogue, shared by the dense kernel (isa_avx512.cpp)
// and the compact bfloat16 one (compact_bf16.cpp), whose outputs must be the dense kernel's bits.
// Intrinsics only, no standard headers: it is included after a file's AVX-512 target pragma.
#pragma once

namespace sf {
namespace avx512 {

constexpr int kTileN = 4;  // weight rows a tile
constexpr int kTileM = 4;  // activation rows a tile

// the four sums of a tile row's accumulators, in one register
inline __m128 hsum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(u), _mm512_extractf32x8_ps(u, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// outputs n .. n + nb - 1 of row m: v (times `scale`, plus `bias`, where given)
inline void store4(Out out, int64_t m, int64_t n, int nb, __m128 v, const float* scale,
                   const float* bias) {
  const __mmask8 lm = static_cast<__mmask8>((1u << nb) - 1);
  if (scale) v = _mm_mul_ps(v, _mm_maskz_loadu_ps(lm, scale + n));
  if (bias) v = _mm_add_ps(v, _mm_maskz_loadu_ps(lm, bias + n));
  if (out.bf16) {
    const __m128i b = (__m128i)_mm_cvtneps_pbh(v);
    _mm_mask_storeu_epi16(static_cast<uint16_t*>(out.ptr) + m * out.ldo + n, lm, b);
  } else {
    _mm_mask_storeu_ps(static_cast<float*>(out.ptr) + m * out.ldo + n, lm, v);
  }
}

}  // namespace avx512
}  // namespace sf
