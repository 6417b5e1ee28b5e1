// Paged decode attention: the raw-pointer interface of its instruction-set variants
// (attention_avx512.cpp, attention_avx2.cpp); attention.cpp binds them to torch.
//
// One query per request attends over keys read straight from the cache through its
// `req_to_token` row (no gather). The work items are (request, KV head, split): a KV head's
// query group shares every K/V read, and a long context is cut into splits whose partial
// softmax states (max, sum, unnormalised output) are merged afterwards (flash-decoding).
#pragma once

#include <cstdint>

namespace sf {

// How the cache stores a row (runtime/memory/kv_format.py): float32, bfloat16, or one int8 or
// fp8 code per element with the row's float32 scale in its last 4 bytes.
enum class CacheKind : int { kF32, kBF16, kI8, kE4M3, kE5M2 };

struct DecodeAttn {
  int64_t batch = 0, heads = 0, kv_heads = 0, dim = 0;
  int64_t splits = 1;  // per request and KV head
  // rotated, scaled queries in float32, [batch, heads, dim]
  const float* q = nullptr;
  // the cache [slots, kv_heads, row] of `kind` rows (the new step's K/V already written); `row`
  // elements per stored row: dim, or dim + 4 for int8 and fp8 (the scale's bytes)
  const void* k_cache = nullptr;
  const void* v_cache = nullptr;
  CacheKind cache_kind = CacheKind::kF32;
  int64_t row = 0;
  // request r's slots: req_to_token[req_pool_indices[r] * rtt_stride + t], int32 or int64
  const void* req_to_token = nullptr;
  int64_t rtt_stride = 0;
  bool rtt_i32 = false;
  const int64_t* req_pool_indices = nullptr;
  const int64_t* seq_lens = nullptr;  // keys per request, the new one included
  float softcap = 0;                  // 0: none
  int64_t window = 0;                 // 0: every key; else the last `window` keys
  // splits > 1: partial states [batch, heads, splits, dim + 2] (output, max, sum)
  float* partial = nullptr;
  // splits == 1: the output [batch, heads, dim], float32 or bfloat16
  void* out = nullptr;
  bool out_bf16 = false;
};

// items [i0, i1) of batch * kv_heads * splits
using DecodeAttnFn = void (*)(const DecodeAttn& a, int64_t i0, int64_t i1);

namespace avx512 {
extern const DecodeAttnFn decode_attention;
}
namespace avx2 {
extern const DecodeAttnFn decode_attention;
}

}  // namespace sf
