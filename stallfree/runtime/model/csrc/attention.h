// Paged decode attention and prompt attention: the raw-pointer interface of their
// instruction-set variants (attention_avx512.cpp, attention_avx2.cpp); attention.cpp and
// prefill_attention.cpp bind them to torch.
//
// One query per request attends over keys read straight from the cache through its
// `req_to_token` row (no gather). The work items are (request, split), every KV head of a
// block of keys in turn: a slot's rows are read as one run, a KV head's query group shares
// every K/V read, and a long context is cut into splits whose partial softmax states (max,
// sum, unnormalised output) are merged afterwards (flash-decoding).
#pragma once

#include <cstdint>

namespace sf {

// How the cache stores a row (runtime/memory/kv_format.py): float32, bfloat16, or one int8 or
// fp8 code per element with the row's float32 scale in its last 4 bytes.
enum class CacheKind : int { kF32, kBF16, kI8, kE4M3, kE5M2 };

struct DecodeAttn {
  int64_t batch = 0, heads = 0, kv_heads = 0, dim = 0;
  int64_t splits = 1;  // per request
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

// items [i0, i1) of batch * splits
using DecodeAttnFn = void (*)(const DecodeAttn& a, int64_t i0, int64_t i1);

// One request's prompt: n queries at positions prefix .. prefix + n - 1 over its keys at
// positions first .. prefix + n - 1, causal, optionally only the last `window` keys of each
// query (prefill_attention_impl.h).
constexpr int64_t kPromptKeys = 32;  // keys per block
constexpr int64_t kPromptRows = 16;  // query rows per work item

struct PrefillAttn {
  int64_t n = 0, heads = 0, kv_heads = 0, dim = 0;
  int64_t prefix = 0, first = 0;
  int64_t window = 0;  // 0: every earlier key
  float scale = 1, softcap = 0;  // softcap 0: none
  bool bf16 = false;             // q, k, v and the output: bfloat16, else float32
  // q [n, heads, dim], k and v [keys, kv_heads, dim]: rows `*_stride` elements apart, heads
  // `dim` apart within a row
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t q_stride = 0, k_stride = 0, v_stride = 0;
  // workspace [kv_heads, dim, kt_stride] float32: the keys transposed (kt_stride >= keys, a
  // whole number of key blocks, zeros past the keys)
  float* kt = nullptr;
  int64_t kt_stride = 0;
  void* out = nullptr;  // [n, heads, dim], contiguous
};

// key rows [t0, t1) into the transposed workspace
using PrefillTransposeFn = void (*)(const PrefillAttn& a, int64_t t0, int64_t t1);
// work items i0, i0 + step, ... below i1 of kv_heads * ceil(n / kPromptRows)
using PrefillAttnFn = void (*)(const PrefillAttn& a, int64_t i0, int64_t i1, int64_t step);

// A bfloat16 prompt on the AMX tiles (amx_prefill_attention.cpp; head dims a multiple of 32,
// only where tiles_in_use()): the keys and values packed once into the tiles' order (`kb`
// and `vb`, each kv_heads * dim * prefill_packed_keys(keys) bfloat16 values, 64-byte
// aligned) from key rows [t0, t1) (t0 a multiple of 32, t1 up to the padded count), then the
// work items i0, i0 + step, ... below i1 of kv_heads * ceil(n / 16)
namespace amx {
int64_t prefill_packed_keys(int64_t keys);
void prefill_pack_keys_bf16(const PrefillAttn& a, uint32_t* kb, uint32_t* vb, int64_t t0,
                            int64_t t1);
void prefill_items_bf16(const PrefillAttn& a, const uint32_t* kb, const uint32_t* vb,
                        int64_t i0, int64_t i1, int64_t step);
}  // namespace amx
// whether the AMX tiles are in use in this process (ops.cpp)
bool tiles_in_use();

namespace avx512 {
extern const DecodeAttnFn decode_attention;
extern const PrefillTransposeFn prefill_transpose;
extern const PrefillAttnFn prefill_attention;
}  // namespace avx512
namespace avx2 {
extern const DecodeAttnFn decode_attention;
extern const PrefillTransposeFn prefill_transpose;
extern const PrefillAttnFn prefill_attention;
}  // namespace avx2

}  // namespace sf
