// torch.ops.stallfree.decode_attention: RoPE on q and the new k, the K/V write at
// out_cache_loc, then paged split-KV attention over each request's req_to_token row
// (attention.h), in the variant ops.cpp selected.
//
// RoPE and the cache write follow torch's rounding exactly (apply_rope in rope.py, then
// KVCache.write's encoding: the cache dtype, or a quantized row as kv_format.py makes it), so
// the cache holds the same bits as on the torch path; this file has no target pragma, so no
// multiply-add is fused there.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <optional>

#include "attention.h"
#include "kernels.h"

namespace sf {
namespace {

// shortest context per split, and work items wanted per thread and KV head (so batch 1 fills
// every thread, and requests of different lengths leave the threads a share to even out)
constexpr int64_t kMinSplitKeys = 64;
constexpr int64_t kItemsPerThread = 2;

template <typename T>
float to_f32(T v);
template <>
float to_f32<float>(float v) {
  return v;
}
template <>
float to_f32<uint16_t>(uint16_t v) {
  return bf16_to_f32(v);
}

template <typename T>
T from_f32(float v);
template <>
float from_f32<float>(float v) {
  return v;
}
template <>
uint16_t from_f32<uint16_t>(float v) {
  return f32_to_bf16(v);
}

// rounded to T as torch rounds each elementwise result
template <typename T>
float round_to(float v) {
  return to_f32(from_f32<T>(v));
}

// x [dim] -> y [dim] in float32: apply_rope's x * cos + roll(x, dim / 2) * signed_sin, each
// product and the sum rounded to T; without cos, x as it is
template <typename T>
void rope_row(const T* x, const T* cos, const T* sin, int64_t dim, float* y) {
  if (cos == nullptr) {
    for (int64_t i = 0; i < dim; ++i) y[i] = to_f32(x[i]);
    return;
  }
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < dim; ++i) {
    const int64_t j = i < half ? i + half : i - half;  // roll(x, half)[i] = x[j]
    const float a = round_to<T>(to_f32(x[i]) * to_f32(cos[i]));
    const float b = round_to<T>(to_f32(x[j]) * to_f32(sin[i]));
    y[i] = round_to<T>(a + b);
  }
}

// Stored row formats (runtime/memory/kv_format.py): `E` the element, `row` a float row into
// its stored form, as KVFormat.encode makes it.
template <typename C>
struct StorePlain {
  using E = C;
  static void row(const float* y, int64_t dim, E* out) {
    for (int64_t i = 0; i < dim; ++i) out[i] = from_f32<C>(y[i]);
  }
};

// int8: codes round(y / s) (to nearest even) with s = max|y| / 127, then s's 4 bytes
struct StoreI8 {
  using E = int8_t;
  static void row(const float* y, int64_t dim, E* out) {
    float amax = 0;
    for (int64_t i = 0; i < dim; ++i) amax = std::max(amax, std::fabs(y[i]));
    const float s = amax / 127.0f;
    for (int64_t i = 0; i < dim; ++i) {
      const float c = s > 0 ? std::nearbyint(y[i] / s) : 0.0f;
      out[i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, c)));
    }
    std::memcpy(out + dim, &s, sizeof s);
  }
};

// fp8 with M mantissa bits and exponent bias BIAS: y / s with s = max|y| / max (max the
// format's largest value, MAX_BITS its float32 bits), clamped to +-max, rounded to nearest even
// (subnormals included) as torch converts a float32, then s's 4 bytes
template <int M, int BIAS, int MAX_BITS>
struct StoreFp8 {
  using E = uint8_t;
  static float max_value() {
    float max;
    const uint32_t max_bits = MAX_BITS;
    std::memcpy(&max, &max_bits, sizeof max);
    return max;
  }
  static uint8_t encode(float x) {
    const uint8_t sign = std::signbit(x) ? 0x80 : 0;
    const float a = std::min(std::fabs(x), max_value());
    if (a == 0) return sign;
    int e = 0;
    std::frexp(a, &e);  // a = f * 2^e, f in [0.5, 1)
    const int ex = std::max(e - 1, 1 - BIAS);  // subnormals share the least normal's quantum
    const float q = std::nearbyint(std::ldexp(a, M - ex));  // exact scaling, then the rounding
    // a rounding up to 2^(M+1) carries into the exponent, as the encoding's layout does
    return sign | static_cast<uint8_t>(((ex + BIAS) << M) + static_cast<int>(q) - (1 << M));
  }
  static void row(const float* y, int64_t dim, E* out) {
    float amax = 0;
    for (int64_t i = 0; i < dim; ++i) amax = std::max(amax, std::fabs(y[i]));
    const float s = amax / max_value();
    for (int64_t i = 0; i < dim; ++i) out[i] = encode(s > 0 ? y[i] / s : 0.0f);
    std::memcpy(out + dim, &s, sizeof s);
  }
};
using StoreE4M3 = StoreFp8<3, 7, 0x43E00000>;   // max 448
using StoreE5M2 = StoreFp8<2, 15, 0x47600000>;  // max 57344

struct RopeWrite {
  const at::Tensor *q, *k, *v, *cos, *sin;  // cos/sin null without RoPE
  const int64_t* loc;
  void *k_cache, *v_cache;
  int64_t row;  // stored row width, in the cache's elements
  float scale;
  float* qbuf;
};

// rows [b0, b1): rotated, scaled q into qbuf; rotated k and v into the cache at loc[b]
template <typename T, typename S>
void rope_write_rows(const RopeWrite& w, int64_t b0, int64_t b1) {
  const int64_t H = w.q->size(1), KVH = w.k->size(1), D = w.q->size(2);
  const T* q = static_cast<const T*>(w.q->data_ptr());
  const T* k = static_cast<const T*>(w.k->data_ptr());
  const T* v = static_cast<const T*>(w.v->data_ptr());
  std::vector<float> y(D);
  for (int64_t b = b0; b < b1; ++b) {
    const T* cos = nullptr;
    const T* sin = nullptr;
    if (w.cos) {
      cos = static_cast<const T*>(w.cos->data_ptr()) + b * w.cos->stride(0);
      sin = static_cast<const T*>(w.sin->data_ptr()) + b * w.sin->stride(0);
    }
    for (int64_t h = 0; h < H; ++h) {
      float* out = w.qbuf + (b * H + h) * D;
      rope_row(q + b * w.q->stride(0) + h * w.q->stride(1), cos, sin, D, out);
      for (int64_t i = 0; i < D; ++i) out[i] *= w.scale;
    }
    const int64_t slot = w.loc[b];
    using E = typename S::E;
    for (int64_t h = 0; h < KVH; ++h) {
      rope_row(k + b * w.k->stride(0) + h * w.k->stride(1), cos, sin, D, y.data());
      S::row(y.data(), D, static_cast<E*>(w.k_cache) + (slot * KVH + h) * w.row);
      rope_row<T>(v + b * w.v->stride(0) + h * w.v->stride(1), nullptr, nullptr, D, y.data());
      S::row(y.data(), D, static_cast<E*>(w.v_cache) + (slot * KVH + h) * w.row);
    }
  }
}

template <typename T>
void rope_write_as(const RopeWrite& w, CacheKind kind, int64_t b0, int64_t b1) {
  switch (kind) {
    case CacheKind::kF32: return rope_write_rows<T, StorePlain<float>>(w, b0, b1);
    case CacheKind::kBF16: return rope_write_rows<T, StorePlain<uint16_t>>(w, b0, b1);
    case CacheKind::kI8: return rope_write_rows<T, StoreI8>(w, b0, b1);
    case CacheKind::kE4M3: return rope_write_rows<T, StoreE4M3>(w, b0, b1);
    case CacheKind::kE5M2: return rope_write_rows<T, StoreE5M2>(w, b0, b1);
  }
}

void rope_write(const RopeWrite& w, bool bf16, CacheKind kind, int64_t b0, int64_t b1) {
  if (bf16) return rope_write_as<uint16_t>(w, kind, b0, b1);
  return rope_write_as<float>(w, kind, b0, b1);
}

// the cache's row format from its dtype, and the stored row width it implies for head dim d
CacheKind cache_kind_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return CacheKind::kF32;
    case at::kBFloat16: return CacheKind::kBF16;
    case at::kChar: return CacheKind::kI8;
    case at::kFloat8_e4m3fn: return CacheKind::kE4M3;
    case at::kFloat8_e5m2: return CacheKind::kE5M2;
    default:
      TORCH_CHECK(false, "decode_attention: the cache must be float32, bfloat16, or int8, "
                         "float8_e4m3fn or float8_e5m2 rows with scales, got ", t);
  }
}

// int8 and fp8 rows carry their float32 scale after their codes
int64_t row_width(CacheKind kind, int64_t d) {
  return kind == CacheKind::kF32 || kind == CacheKind::kBF16 ? d : d + 4;
}

// rows [r0, r1) of [batch * heads]: the splits' partial states merged into the output
void reduce_splits(const DecodeAttn& a, int64_t r0, int64_t r1) {
  const int64_t D = a.dim, S = a.splits;
  std::vector<float> y(D);
  for (int64_t r = r0; r < r1; ++r) {
    const float* p = a.partial + r * S * (D + 2);
    float m = -INFINITY;
    for (int64_t s = 0; s < S; ++s) m = std::max(m, p[s * (D + 2) + D]);
    std::fill(y.begin(), y.end(), 0.0f);
    float l = 0;
    for (int64_t s = 0; s < S; ++s) {
      const float* ps = p + s * (D + 2);
      if (ps[D + 1] == 0) continue;  // an empty split
      const float w = std::exp(ps[D] - m);
      l += w * ps[D + 1];
      for (int64_t i = 0; i < D; ++i) y[i] += w * ps[i];
    }
    const float inv = l > 0 ? 1.0f / l : 0.0f;
    if (a.out_bf16) {
      uint16_t* o = static_cast<uint16_t*>(a.out) + r * D;
      for (int64_t i = 0; i < D; ++i) o[i] = f32_to_bf16(y[i] * inv);
    } else {
      float* o = static_cast<float*>(a.out) + r * D;
      for (int64_t i = 0; i < D; ++i) o[i] = y[i] * inv;
    }
  }
}

DecodeAttnFn selected_kernel() {
  const char* isa = selected_isa();
  TORCH_CHECK(isa != nullptr, "decode_attention: no instruction set selected");
  return std::strcmp(isa, "avx512") == 0 ? avx512::decode_attention : avx2::decode_attention;
}

void check_rows(const at::Tensor& t, const char* what, int64_t b, int64_t heads, int64_t d) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 3 && t.size(0) == b && t.size(1) == heads &&
                  t.size(2) == d && t.stride(2) == 1,
              "decode_attention: ", what, " must be a CPU [", b, ", ", heads, ", ", d,
              "] tensor with a contiguous last dimension");
}

void check_index(const at::Tensor& t, const char* what, int64_t b) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.is_contiguous() &&
                  t.dim() == 1 && t.size(0) == b,
              "decode_attention: ", what, " must be a contiguous int64 CPU tensor of ", b,
              " values");
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                            const std::optional<at::Tensor>& cos,
                            const std::optional<at::Tensor>& signed_sin,
                            const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& out_cache_loc, const at::Tensor& req_to_token,
                            const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                            std::optional<double> scale, std::optional<double> softcap,
                            std::optional<int64_t> window) {
  TORCH_CHECK(q.dim() == 3, "decode_attention: q must be [batch, heads, dim]");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(k_cache.dim() == 3, "decode_attention: k_cache must be [slots, kv_heads, dim]");
  const int64_t KVH = k_cache.size(1);
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "decode_attention: q must be float32 or bfloat16, got ", dtype);
  TORCH_CHECK(D % 16 == 0, "decode_attention: head dim must be a multiple of 16, got ", D);
  TORCH_CHECK(KVH > 0 && H % KVH == 0 && H / KVH <= 64,
              "decode_attention: heads must be a multiple of kv_heads (at most 64 per group)");
  check_rows(q, "q", B, H, D);
  check_rows(k_new, "k_new", B, KVH, D);
  check_rows(v_new, "v_new", B, KVH, D);
  TORCH_CHECK(k_new.scalar_type() == dtype && v_new.scalar_type() == dtype,
              "decode_attention: k_new and v_new must have q's dtype");
  TORCH_CHECK(cos.has_value() == signed_sin.has_value(),
              "decode_attention: give both cos and signed_sin, or neither");
  if (cos.has_value()) {
    for (const at::Tensor* t : {&*cos, &*signed_sin}) {
      check_rows(*t, "cos/signed_sin", B, 1, D);
      TORCH_CHECK(t->scalar_type() == dtype, "decode_attention: cos/signed_sin need q's dtype");
    }
  }
  const auto cache_dtype = k_cache.scalar_type();
  const CacheKind kind = cache_kind_of(cache_dtype);
  const int64_t row = row_width(kind, D);
  for (const at::Tensor* t : {&k_cache, &v_cache}) {
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && t->sizes() == k_cache.sizes() &&
                    t->size(2) == row && t->scalar_type() == cache_dtype,
                "decode_attention: k_cache and v_cache must be contiguous CPU [slots, ", KVH,
                ", ", row, "] tensors of one dtype (a quantized row: ", D, " codes and its scale)");
  }
  check_index(out_cache_loc, "out_cache_loc", B);
  check_index(req_pool_indices, "req_pool_indices", B);
  check_index(seq_lens, "seq_lens", B);
  TORCH_CHECK(req_to_token.device().is_cpu() && req_to_token.dim() == 2 &&
                  req_to_token.stride(1) == 1 &&
                  (req_to_token.scalar_type() == at::kLong ||
                   req_to_token.scalar_type() == at::kInt),
              "decode_attention: req_to_token must be an int32 or int64 CPU [rows, max_len] "
              "tensor with contiguous rows");
  TORCH_CHECK(!window.has_value() || *window > 0, "decode_attention: window must be positive");
  TORCH_CHECK(!softcap.has_value() || *softcap > 0, "decode_attention: softcap must be positive");
  const auto options = q.options().dtype(dtype);
  at::Tensor out = at::empty({B, H, D}, options);
  if (B == 0) return out;
  const bool bf16 = dtype == at::kBFloat16;
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t rows = req_to_token.size(0), max_len = req_to_token.size(1);
  const int64_t* pool = req_pool_indices.data_ptr<int64_t>();
  const int64_t* loc = out_cache_loc.data_ptr<int64_t>();
  const int64_t slots = k_cache.size(0);
  int64_t longest = 0, keys = 0;  // keys attended, per request
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_len && pool[b] >= 0 && pool[b] < rows &&
                    loc[b] >= 0 && loc[b] < slots,
                "decode_attention: request ", b, " is out of range (seq_len ", lens[b],
                ", req_pool_index ", pool[b], ", out_cache_loc ", loc[b], ")");
    const int64_t n = window.has_value() ? std::min(lens[b], *window) : lens[b];
    longest = std::max(longest, n);
    keys += n;
  }

  at::Tensor qbuf = at::empty({B, H, D}, q.options().dtype(at::kFloat));
  RopeWrite w{&q, &k_new, &v_new, cos ? &*cos : nullptr, signed_sin ? &*signed_sin : nullptr,
              loc, k_cache.data_ptr(), v_cache.data_ptr(), row,
              static_cast<float>(scale.has_value() ? *scale : 1.0 / std::sqrt(double(D))),
              qbuf.data_ptr<float>()};
  at::parallel_for(0, B, 4,
                   [&](int64_t b0, int64_t b1) { rope_write(w, bf16, kind, b0, b1); });

  DecodeAttn a;
  a.batch = B;
  a.heads = H;
  a.kv_heads = KVH;
  a.dim = D;
  // splits: the longest request cut so that no work item (a request's keys over every KV
  // head) is much above an even share of kItemsPerThread items per thread and KV head (batch
  // 1 fills every thread; one long request among short ones is cut too), but never below
  // kMinSplitKeys keys
  const int64_t threads = at::get_num_threads();
  const int64_t wanted = kItemsPerThread * threads * KVH;
  a.splits = std::max<int64_t>(
      1, std::min((longest * wanted + keys - 1) / keys, longest / kMinSplitKeys));
  a.q = qbuf.data_ptr<float>();
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  a.cache_kind = kind;
  a.row = row;
  a.req_to_token = req_to_token.data_ptr();
  a.rtt_stride = req_to_token.stride(0);
  a.rtt_i32 = req_to_token.scalar_type() == at::kInt;
  a.req_pool_indices = pool;
  a.seq_lens = lens;
  a.softcap = softcap.has_value() ? static_cast<float>(*softcap) : 0.0f;
  a.window = window.has_value() ? *window : 0;
  a.out = out.data_ptr();
  a.out_bf16 = bf16;
  at::Tensor partial;
  if (a.splits > 1) {
    partial = at::empty({B, H, a.splits, D + 2}, q.options().dtype(at::kFloat));
    a.partial = partial.data_ptr<float>();
  }
  const DecodeAttnFn fn = selected_kernel();
  // items taken in turn by whichever thread is free: requests of different lengths make
  // items of different sizes, which halves given out in advance would leave one thread waiting on
  const int64_t total = B * a.splits;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, total), 1, [&](int64_t, int64_t) {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < total;) fn(a, i, i + 1);
  });
  if (a.splits > 1) {
    at::parallel_for(0, B * H, 16, [&](int64_t r0, int64_t r1) { reduce_splits(a, r0, r1); });
  }
  return out;
}

// `decode_attention` on the q/k/v projection's joint output [B, (H + 2 KVH) * D] (q, then k,
// then v in each row, as a fused projection writes them), returning [B, H * D] for the output
// projection: the model's split and reshapes are views taken here, not ops of its own.
at::Tensor decode_attention_qkv(const at::Tensor& qkv, int64_t num_heads, int64_t num_kv_heads,
                                const std::optional<at::Tensor>& cos,
                                const std::optional<at::Tensor>& signed_sin,
                                const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& out_cache_loc, const at::Tensor& req_to_token,
                                const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                                std::optional<double> scale, std::optional<double> softcap,
                                std::optional<int64_t> window) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1,
              "decode_attention_qkv: qkv must be [batch, (heads + 2 * kv_heads) * dim] with a "
              "contiguous last dimension");
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0, "decode_attention_qkv: head counts must be > 0");
  const int64_t width = num_heads + 2 * num_kv_heads;
  TORCH_CHECK(qkv.size(1) % width == 0, "decode_attention_qkv: ", qkv.size(1),
              " columns do not split into ", width, " heads");
  const int64_t B = qkv.size(0), D = qkv.size(1) / width, row = qkv.stride(0);
  const at::Tensor q = qkv.as_strided({B, num_heads, D}, {row, D, 1}, qkv.storage_offset());
  const at::Tensor k = qkv.as_strided({B, num_kv_heads, D}, {row, D, 1},
                                      qkv.storage_offset() + num_heads * D);
  const at::Tensor v = qkv.as_strided({B, num_kv_heads, D}, {row, D, 1},
                                      qkv.storage_offset() + (num_heads + num_kv_heads) * D);
  at::Tensor out = decode_attention(q, k, v, cos, signed_sin, k_cache, v_cache, out_cache_loc,
                                    req_to_token, req_pool_indices, seq_lens, scale, softcap,
                                    window);
  return out.view({B, num_heads * D});
}

}  // namespace
}  // namespace sf

TORCH_LIBRARY_FRAGMENT(stallfree, m) {
  m.def(
      "decode_attention(Tensor q, Tensor k_new, Tensor v_new, Tensor? cos, Tensor? signed_sin, "
      "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor out_cache_loc, Tensor req_to_token, "
      "Tensor req_pool_indices, Tensor seq_lens, float? scale=None, float? softcap=None, "
      "int? window=None) -> Tensor");
}

TORCH_LIBRARY_FRAGMENT(stallfree, m) {
  m.def(
      "decode_attention_qkv(Tensor qkv, int num_heads, int num_kv_heads, Tensor? cos, "
      "Tensor? signed_sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor out_cache_loc, "
      "Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, float? scale=None, "
      "float? softcap=None, int? window=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(stallfree, CPU, m) {
  m.impl("decode_attention", &sf::decode_attention);
  m.impl("decode_attention_qkv", &sf::decode_attention_qkv);
}
