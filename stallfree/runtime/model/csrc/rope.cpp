// torch.ops.stallfree.rope: rope.py's apply_rope on every head of many rows in one call, for
// prompt steps (a decode step rotates inside decode_attention). apply_rope is four torch
// kernels (x * cos, roll, * signed_sin, +), each a pass over the prompt's q and k; here each
// value is read once, with the same arithmetic: both products and the sum rounded to the
// dtype as torch rounds each elementwise result, in that order. No multiply-add is fused, so
// the bits equal torch's: the AVX2 part's target has no FMA, and the AVX-512 part (bfloat16,
// where that variant is in use) rounds each product with integer operations before the sum.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "kernels.h"


namespace sf {
namespace {

// AVX2 without FMA (the kernels only load on CPUs with AVX2, cpu_kernels.py): wider vectors
// for the loops below, and still no fused multiply-add. After the headers, which are compiled
// for the baseline; the torch-facing code below the pop is too.
#pragma GCC push_options
#pragma GCC target("avx2")

// kernels.h's conversions without its early return, so the loops below vectorize: round to
// nearest even, a NaN kept quiet
inline uint32_t bits(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  return u;
}
inline float from_bits(uint32_t u) {
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
inline uint16_t to_bf16(float f) {
  const uint32_t u = bits(f);
  const uint32_t nearest = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet = (u >> 16) | 0x40u;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet : nearest);
}
inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) { return from_bits(uint32_t{p[i]} << 16); }
inline float rounded(float v, const float*) { return v; }
inline float rounded(float v, const uint16_t*) { return from_bits(uint32_t{to_bf16(v)} << 16); }
inline void put(float* p, int64_t i, float v) { p[i] = v; }
inline void put(uint16_t* p, int64_t i, float v) { p[i] = to_bf16(v); }

// one head: y[i] = x[i] * cos[i] + roll(x, half)[i] * sin[i], roll(x, half)[i] being
// x[i + half] in the first half and x[i - half] in the second
template <typename T>
void rotate_head(const T* x, const T* cos, const T* sin, int64_t dim, T* y) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = rounded(load(x, i) * load(cos, i), x);
    const float b = rounded(load(x, i + half) * load(sin, i), x);
    put(y, i, a + b);
  }
  for (int64_t i = half; i < dim; ++i) {
    const float a = rounded(load(x, i) * load(cos, i), x);
    const float b = rounded(load(x, i - half) * load(sin, i), x);
    put(y, i, a + b);
  }
}

// bfloat16 heads with half % 8 == 0: the same arithmetic, eight values a step
inline __m256 load8(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
// to_bf16 on eight values, as 32-bit lanes holding the 16 bits
inline __m256i round8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i nearest =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  return _mm256_blendv_epi8(nearest, quiet, nan);
}
inline __m256 rounded8(__m256 v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(round8(v), 16));
}
inline void store8(uint16_t* p, __m256 v) {
  const __m256i r = round8(v);
  const __m128i packed =
      _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

void rotate_head8(const uint16_t* x, const uint16_t* cos, const uint16_t* sin, int64_t dim,
                  uint16_t* y) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < dim; i += 8) {
    const int64_t j = i < half ? i + half : i - half;
    const __m256 a = rounded8(_mm256_mul_ps(load8(x + i), load8(cos + i)));
    const __m256 b = rounded8(_mm256_mul_ps(load8(x + j), load8(sin + i)));
    store8(y + i, _mm256_add_ps(a, b));
  }
}

#pragma GCC pop_options

// bfloat16 heads with half % 16 == 0 where the AVX-512 variant is in use: the same arithmetic,
// sixteen values a step. Still no fused multiply-add: each product is rounded (integer
// operations) before the sum, so no multiply feeds an add.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw")

inline __m512 load16(const uint16_t* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

// to_bf16 on sixteen values, as 32-bit lanes holding the 16 bits
inline __m512i round16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i nearest =
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  return _mm512_mask_blend_epi32(nan, nearest, quiet);
}

inline __m512 rounded16(__m512 v) { return _mm512_castsi512_ps(_mm512_slli_epi32(round16(v), 16)); }

void rotate_head16(const uint16_t* x, const uint16_t* cos, const uint16_t* sin, int64_t dim,
                   uint16_t* y) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < dim; i += 16) {
    const int64_t j = i < half ? i + half : i - half;
    const __m512 a = rounded16(_mm512_mul_ps(load16(x + i), load16(cos + i)));
    const __m512 b = rounded16(_mm512_mul_ps(load16(x + j), load16(sin + i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i),
                        _mm512_cvtepi32_epi16(round16(_mm512_add_ps(a, b))));
  }
}

#pragma GCC pop_options

template <typename T>
void rotate_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                 at::Tensor& out, int64_t t0, int64_t t1) {
  const int64_t heads = x.size(1), dim = x.size(2);
  const T* xp = static_cast<const T*>(x.data_ptr());
  const T* cp = static_cast<const T*>(cos.data_ptr());
  const T* sp = static_cast<const T*>(sin.data_ptr());
  T* op = static_cast<T*>(out.data_ptr());
  const char* isa = selected_isa();
  const bool wide = isa != nullptr && std::strcmp(isa, "avx512") == 0;
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      if constexpr (sizeof(T) == 2) {
        if (wide && dim % 32 == 0) {
          rotate_head16(xp + t * x.stride(0) + h * x.stride(1), cp + t * cos.stride(0),
                        sp + t * sin.stride(0), dim, op + (t * heads + h) * dim);
          continue;
        }
        if (dim % 16 == 0) {
          rotate_head8(xp + t * x.stride(0) + h * x.stride(1), cp + t * cos.stride(0),
                       sp + t * sin.stride(0), dim, op + (t * heads + h) * dim);
          continue;
        }
      }
      rotate_head(xp + t * x.stride(0) + h * x.stride(1), cp + t * cos.stride(0),
                  sp + t * sin.stride(0), dim, op + (t * heads + h) * dim);
    }
}

// x [T, H, D] (any row and head strides, contiguous values), cos and signed_sin [T, 1, D]
// (rope.RotaryEmbedding's tables) -> rotated [T, H, D], contiguous
// rotate_rows in x's dtype
void rotate_any(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                at::Tensor& out, int64_t t0, int64_t t1) {
  if (x.scalar_type() == at::kBFloat16)
    rotate_rows<uint16_t>(x, cos, sin, out, t0, t1);
  else
    rotate_rows<float>(x, cos, sin, out, t0, t1);
}

void check_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "rope: x must be a CPU [tokens, heads, dim] tensor with contiguous values and an "
              "even dim");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "rope: x must be float32 or bfloat16");
  for (const at::Tensor* t : {&cos, &signed_sin}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == x.scalar_type() && t->dim() == 3 &&
                    t->size(0) == x.size(0) && t->size(1) == 1 && t->size(2) == x.size(2) &&
                    t->stride(2) == 1,
                "rope: cos and signed_sin must be [tokens, 1, dim] tensors of x's dtype with "
                "contiguous values");
  }
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin) {
  check_rope(x, cos, signed_sin);
  at::Tensor out = at::empty(x.sizes(), x.options());
  at::parallel_for(0, x.size(0), 16, [&](int64_t t0, int64_t t1) {
    rotate_any(x, cos, signed_sin, out, t0, t1);
  });
  return out;
}

// `rope` on a prompt's joint q and k heads x [T, heads + kv, D], then the rotated k heads and
// v's rows [T, kv, D] written into the caches [slots, kv, D] at slots `loc` [T] (int64), each
// token's rows as the threads rotate them: KVCache.write's two index_put calls and their
// dispatch, for a cache stored in x's dtype. Returns the rotated x, as `rope` does.
at::Tensor rope_write(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin,
                      int64_t heads, const at::Tensor& v, at::Tensor& k_cache,
                      at::Tensor& v_cache, const at::Tensor& loc) {
  check_rope(x, cos, signed_sin);
  const int64_t tokens = x.size(0), kv = x.size(1) - heads, dim = x.size(2);
  TORCH_CHECK(heads >= 0 && kv > 0, "rope_write: x has ", x.size(1), " heads, q ", heads);
  TORCH_CHECK(v.scalar_type() == x.scalar_type() && v.dim() == 3 && v.size(0) == tokens &&
                  v.size(1) == kv && v.size(2) == dim && v.stride(2) == 1 && (kv == 1 || v.stride(1) == dim),
              "rope_write: v must be [tokens, kv heads, dim] of x's dtype, each row's heads "
              "contiguous");
  for (const at::Tensor* c : {&k_cache, &v_cache}) {
    TORCH_CHECK(c->device().is_cpu() && c->scalar_type() == x.scalar_type() &&
                    c->is_contiguous() && c->dim() == 3 && c->size(1) == kv && c->size(2) == dim,
                "rope_write: the caches must be contiguous [slots, kv heads, dim] tensors of "
                "x's dtype");
  }
  TORCH_CHECK(k_cache.size(0) == v_cache.size(0), "rope_write: the caches differ in slots");
  TORCH_CHECK(loc.device().is_cpu() && loc.scalar_type() == at::kLong && loc.dim() == 1 &&
                  loc.numel() == tokens && loc.is_contiguous(),
              "rope_write: loc must be a contiguous int64 [tokens] tensor");
  const int64_t slots = k_cache.size(0);
  const int64_t* where = loc.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(where[t] >= 0 && where[t] < slots, "rope_write: slot ", where[t],
                " outside the cache's ", slots);
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t bytes = kv * dim * static_cast<int64_t>(x.element_size());
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const auto* oc = static_cast<const char*>(out.data_ptr());
  const auto* vs = static_cast<const char*>(v.data_ptr());
  const int64_t es = x.element_size();
  at::parallel_for(0, tokens, 16, [&](int64_t t0, int64_t t1) {
    rotate_any(x, cos, signed_sin, out, t0, t1);
    for (int64_t t = t0; t < t1; ++t) {
      std::memcpy(kc + where[t] * bytes, oc + (t * (heads + kv) + heads) * dim * es, bytes);
      std::memcpy(vc + where[t] * bytes, vs + t * v.stride(0) * es, bytes);
    }
  });
  return out;
}

}  // namespace
}  // namespace sf

TORCH_LIBRARY_FRAGMENT(stallfree, m) {
  m.def("rope(Tensor x, Tensor cos, Tensor signed_sin) -> Tensor");
  m.def(
      "rope_write(Tensor x, Tensor cos, Tensor signed_sin, int heads, Tensor v, "
      "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor loc) -> Tensor");
}

TORCH_LIBRARY_IMPL(stallfree, CPU, m) {
  m.impl("rope", &sf::rope);
  m.impl("rope_write", &sf::rope_write);
}
