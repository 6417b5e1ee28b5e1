// The AVX2 + FMA variant: x86-64 machines without AVX-512 BF16/VNNI.
//
// The same products as isa_avx512.cpp on 256-bit registers: integer dots as llama.cpp does
// them without VNNI (|x| times w with x's sign, `vpmaddubsw` then `vpmaddwd`), bfloat16
// widened to float32 and multiplied with FMA.

#include <immintrin.h>

#include <algorithm>
#include <cmath>

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

void quantize(const void* x, bool x_bf16, int64_t row, Q8Act& a) {
  const int64_t k = a.k, kp = a.kp;
  int8_t* q = a.q + row * kp;
  uint8_t* absq = a.absq + row * kp;
  float* d = a.d + row * (kp / 32);
  float* bsum = a.bsum + row * (kp / 32);
  const void* xr = static_cast<const char*>(x) + row * k * (x_bf16 ? 2 : 4);
  for (int64_t b = 0; b < kp / 32; ++b) {
    const int64_t k0 = b * 32;
    float amax = 0.f;
    if (k0 < k)
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xval(xr, x_bf16, k0 + i)));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int sum = 0;
    for (int i = 0; i < 32; ++i) {
      int v = 0;
      if (k0 < k) v = static_cast<int>(std::nearbyint(xval(xr, x_bf16, k0 + i) * inv));
      v = std::min(127, std::max(-127, v));
      q[k0 + i] = static_cast<int8_t>(v);
      absq[k0 + i] = static_cast<uint8_t>(v < 0 ? -v : v);
      sum += v;
    }
    d[b] = amax / 127.f;
    bsum[b] = d[b] * static_cast<float>(sum);
  }
}

void gemv_q8(const Q8Act& a, const int8_t* w, const float* scale, const uint16_t* bscale,
             const float* bias, int64_t n0, int64_t n1, Out out) {
  const int64_t k = a.k, blocks = k / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wr = w + n * k;
    for (int64_t m = 0; m < a.m; ++m) {
      __m256 acc = _mm256_setzero_ps();
      const int8_t* xq = a.q + m * a.kp;
      const uint8_t* xa = a.absq + m * a.kp;
      const float* d = a.d + m * (a.kp / 32);
      for (int64_t b = 0; b < blocks; ++b) {
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + b * 32));
        const __m256i xs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * 32));
        const __m256i ax = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xa + b * 32));
        const __m256i p16 = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv, xs));
        const __m256i p32 = _mm256_madd_epi16(p16, ones);
        const float db = bscale ? d[b] * _cvtsh_ss(bscale[n * blocks + b]) : d[b];
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p32), _mm256_set1_ps(db), acc);
      }
      float v = bscale ? hsum(acc) : hsum(acc) * scale[n];
      if (bias) v += bias[n];
      store(out, m, n, v);
    }
  }
}

void gemv_q4(const Q8Act& a, const uint8_t* codes, const uint16_t* gscale,
             const uint16_t* goffset, const float* bias, int64_t n0, int64_t n1, Out out) {
  const int64_t groups = a.k / 32;
  const __m128i low = _mm_set1_epi8(0x0f);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t m = 0; m < a.m; ++m) {
      __m256 acc = _mm256_setzero_ps();
      float off = 0.f;
      const int8_t* xq = a.q + m * a.kp;
      const float* d = a.d + m * (a.kp / 32);
      const float* bs = a.bsum + m * (a.kp / 32);
      for (int64_t g = 0; g < groups; ++g) {
        const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + (n * groups + g) * 16));
        const __m256i wv = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(c, 4), low), _mm_and_si128(c, low));
        const __m256i xs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + g * 32));
        const __m256i p32 = _mm256_madd_epi16(_mm256_maddubs_epi16(wv, xs), ones);
        const float sc = _cvtsh_ss(gscale[n * groups + g]);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p32), _mm256_set1_ps(d[g] * sc), acc);
        off += _cvtsh_ss(goffset[n * groups + g]) * bs[g];
      }
      float v = hsum(acc) + off;
      if (bias) v += bias[n];
      store(out, m, n, v);
    }
  }
}

template <bool BF16>
void gemv_dense_t(const void* x, int64_t m, int64_t k, const void* w, const float* bias,
                  int64_t n0, int64_t n1, Out out) {
  const int64_t k8 = k - k % 8;
  for (int64_t n = n0; n < n1; n += kTileN) {
    const int nb = static_cast<int>(std::min<int64_t>(kTileN, n1 - n));
    for (int64_t i = 0; i < m; ++i) {
      __m256 acc[kTileN];
      float tail[kTileN] = {0.f, 0.f, 0.f, 0.f};
      for (auto& v : acc) v = _mm256_setzero_ps();
      for (int64_t k0 = 0; k0 < k8; k0 += 8) {
        __m256 xv;
        if constexpr (BF16) xv = load_bf16x8(static_cast<const uint16_t*>(x) + i * k + k0);
        else xv = _mm256_loadu_ps(static_cast<const float*>(x) + i * k + k0);
        for (int j = 0; j < nb; ++j) {
          __m256 wv;
          if constexpr (BF16) wv = load_bf16x8(static_cast<const uint16_t*>(w) + (n + j) * k + k0);
          else wv = _mm256_loadu_ps(static_cast<const float*>(w) + (n + j) * k + k0);
          acc[j] = _mm256_fmadd_ps(xv, wv, acc[j]);
        }
      }
      for (int j = 0; j < nb; ++j) {
        for (int64_t kk = k8; kk < k; ++kk)
          tail[j] += xval(x, BF16, i * k + kk) * xval(w, BF16, (n + j) * k + kk);
        float v = hsum(acc[j]) + tail[j];
        if (bias) v += bias[n + j];
        store(out, i, n + j, v);
      }
    }
  }
}

void gemv_dense_bf16(const void* x, int64_t m, int64_t k, const void* w, const float* bias,
                     int64_t n0, int64_t n1, Out out) {
  gemv_dense_t<true>(x, m, k, w, bias, n0, n1, out);
}

void gemv_dense_f32(const void* x, int64_t m, int64_t k, const void* w, const float* bias,
                    int64_t n0, int64_t n1, Out out) {
  gemv_dense_t<false>(x, m, k, w, bias, n0, n1, out);
}

void rms_norm(const void* x, const void* delta, void* sum, const void* w, void* out, int64_t r0,
              int64_t r1, int64_t dim, float eps, bool bf16) {
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t base = r * dim;
    const void* src = x;
    if (delta) {
      for (int64_t i = 0; i < dim; ++i) {
        const float s = xval(x, bf16, base + i) + xval(delta, bf16, base + i);
        if (bf16) static_cast<uint16_t*>(sum)[base + i] = f32_to_bf16(s);
        else static_cast<float*>(sum)[base + i] = s;
      }
      src = sum;
    }
    float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int64_t i = 0; i < dim; ++i) {
      const float v = xval(src, bf16, base + i);
      part[i % 8] += v * v;
    }
    float ss = 0.f;
    for (float p : part) ss += p;
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
    for (int64_t i = 0; i < dim; ++i) {
      const float h = xval(src, bf16, base + i) * inv;
      if (bf16) {
        const float v = xval(w, true, i) * round_bf16(h);
        static_cast<uint16_t*>(out)[base + i] = f32_to_bf16(v);
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
      alignas(32) float sv[8];
      _mm256_store_ps(sv, s);
      alignas(32) float uv[8];
      _mm256_store_ps(uv, u);
      for (int j = 0; j < 8; ++j) {
        if (bf16) static_cast<uint16_t*>(out)[r * inter + i + j] = f32_to_bf16(round_bf16(sv[j]) * uv[j]);
        else static_cast<float*>(out)[r * inter + i + j] = sv[j] * uv[j];
      }
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
// rounds a finite value)
inline void store8(Out out, int64_t row, int64_t c, __m256 v) {
  if (!out.bf16) {
    _mm256_storeu_ps(static_cast<float*>(out.ptr) + row * out.ldo + c, v);
    return;
  }
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
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
                         dequant_q8,      dequant_q4};
  return k;
}

}  // namespace avx2
}  // namespace sf

#pragma GCC pop_options
