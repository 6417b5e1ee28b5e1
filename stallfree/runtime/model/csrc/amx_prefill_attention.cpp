// A bfloat16 prompt's attention on AMX tiles (torch.ops.stallfree.prefill_attention where the
// tiles are in use): the same semantics as prefill_attention_impl.h (n queries at positions
// prefix .. prefix + n - 1 over keys at positions first .. prefix + n - 1, causal, optionally
// windowed and soft-capped), with the two products on `tdpbf16ps`.
//
// SDPA's CPU kernel computes a prompt shorter than its 512-key split against every key, the
// half above the diagonal included, and the float32 kernel's multiply-adds run at about half
// SDPA's bfloat16 speed. Here a work item is one KV head's block of 16 query rows with the
// head's whole query group, walked over its visible keys in chunks of kChunk:
//   1. scores S[q, key] = Q K^T: Q's rows are the A operand; the keys are packed once per call
//      into the pair-interleaved B order (a 16 x 16 transpose of value pairs per 16 keys and
//      32 dimensions), and each key tile loaded serves the group's heads (one accumulator
//      each);
//   2. per query row, the chunk's scores are scaled, soft-capped, masked to the row's visible
//      run of keys and turned into probabilities against the row's running max (an online
//      softmax across chunks; the accumulated output is rescaled when the max grows), then
//      split into two bfloat16 parts as the A operands of the next product;
//   3. O[q, d] += P V: the values are packed once per call with consecutive keys' values
//      interleaved (the B order); the output accumulators start from the rescaled running
//      output and are stored back to it.
// Key tiles stop at the item's last query position, so a causal prompt multiplies about half
// of what SDPA does. The probabilities enter the second product as two bfloat16 parts (the
// rounded value and what its rounding left out, two multiplies each), so they keep about 16
// bits where one rounding keeps 8; the sums are float32.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "attention.h"
#include "kernels.h"
#include "vec_exp.h"

#if SF_HAVE_AMX
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c,amx-tile,amx-bf16")

namespace sf {
namespace amx {
namespace {

#include "amx_tiles.h"

// keys per chunk of the walk: a chunk's scores (16 rows x kChunk float32 per head) and
// probabilities stay in L2 while its products run
constexpr int64_t kChunk = 512;
// row strides of the scores (float32) and probabilities (bfloat16) buffers: a chunk's width
// plus a line, so a tile's 16 rows do not fall in the same few L1 sets
constexpr int64_t kRowS = kChunk + 16;
constexpr int64_t kRowP = kChunk + 32;

// every tile 16 rows of 64 bytes: 0-3 accumulators, 4-7 operands
void configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  load_config(cfg);
}

// The packed keys and values of one call
struct Packed {
  int64_t keys_pad = 0;  // keys rounded up to 32, zeros past the keys
  int64_t dchunks = 0;   // head dim / 32
  // [kv_heads][dchunks][keys_pad / 16] B tiles of 16 rows x 16 uint32: row p of the tile for
  // keys j0 .. j0 + 15 and chunk c holds, for each key, dimensions 32 c + 2 p and + 1
  uint32_t* kb = nullptr;
  // [kv_heads][keys_pad / 2][dim] uint32: pair p, dimension d holds keys 2 p and 2 p + 1's
  // values at d (the B order of the values' product, rows of 16 pairs)
  uint32_t* vb = nullptr;
};

// 16 bfloat16 values from each of rows a and b (either may be null: zeros), interleaved
inline __m512i interleave16(const uint16_t* a, const uint16_t* b) {
  const __m512i lo = a ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)))
                       : _mm512_setzero_si512();
  const __m512i hi = b ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)))
                       : _mm512_setzero_si512();
  return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}

// key rows [t0, t1) (t0 a multiple of 32) of every KV head, packed
void prefill_pack_bf16(const PrefillAttn& a, const Packed& pk, int64_t t0, int64_t t1) {
  const int64_t D = a.dim, keys = a.prefix + a.n - a.first;
  const uint16_t* k = static_cast<const uint16_t*>(a.k);
  const uint16_t* v = static_cast<const uint16_t*>(a.v);
  const int64_t ktiles = pk.keys_pad / 16;
  for (int64_t h = 0; h < a.kv_heads; ++h) {
    for (int64_t j0 = t0; j0 < t1; j0 += 16) {
      for (int64_t c = 0; c < pk.dchunks; ++c) {
        __m512 r[16];
        for (int i = 0; i < 16; ++i)
          r[i] = j0 + i < keys ? _mm512_loadu_ps(reinterpret_cast<const float*>(
                                     k + (j0 + i) * a.k_stride + h * D + 32 * c))
                               : _mm512_setzero_ps();
        transpose16(r);  // r[p]: dimension pair p of each of the 16 keys
        uint32_t* dst = pk.kb + ((h * pk.dchunks + c) * ktiles + j0 / 16) * 256;
        for (int p = 0; p < 16; ++p) _mm512_store_ps(reinterpret_cast<float*>(dst + 16 * p), r[p]);
      }
    }
    for (int64_t j = t0; j < t1; j += 2) {
      const uint16_t* ra = j < keys ? v + j * a.v_stride + h * D : nullptr;
      const uint16_t* rb = j + 1 < keys ? v + (j + 1) * a.v_stride + h * D : nullptr;
      uint32_t* dst = pk.vb + (h * (pk.keys_pad / 2) + j / 2) * D;
      for (int64_t d = 0; d < D; d += 16)
        _mm512_storeu_si512(dst + d, interleave16(ra ? ra + d : nullptr, rb ? rb + d : nullptr));
    }
  }
}

// One work item's buffers (per thread)
struct ItemBuffers {
  std::vector<char> raw;
  uint16_t* q = nullptr;  // [G][16 rows][D] bfloat16: the A tiles of the scores
  float* s = nullptr;     // [G][16][kRowS] scores
  // [2][G][16][kRowP] probabilities as the A tiles of the values' product: each rounded to
  // bfloat16, then what that rounding left out (also bfloat16), so the product sees them to
  // about 16 bits
  uint16_t* p = nullptr;
  float* o = nullptr;     // [G][16][D] running output
  float* m = nullptr;     // [G][16] running max
  float* l = nullptr;     // [G][16] running sum

  void ensure(int64_t G, int64_t D) {
    const int64_t qb = G * 16 * D * 2, sb = G * 16 * kRowS * 4, pb = 2 * G * 16 * kRowP * 2;
    const int64_t ob = G * 16 * D * 4, mb = G * 16 * 4;
    scratch(raw, static_cast<size_t>(qb + sb + pb + ob + 2 * mb + 6 * 64));
    char* at = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(raw.data()) + 63) & ~uintptr_t{63});
    const auto take = [&](int64_t bytes) {
      char* r = at;
      at += (bytes + 63) / 64 * 64;
      return r;
    };
    q = reinterpret_cast<uint16_t*>(take(qb));
    s = reinterpret_cast<float*>(take(sb));
    p = reinterpret_cast<uint16_t*>(take(pb));
    o = reinterpret_cast<float*>(take(ob));
    m = reinterpret_cast<float*>(take(mb));
    l = reinterpret_cast<float*>(take(mb));
  }
};

// tanh(x / cap) * cap in lanes: tanh(y) = sign(y) (1 - e) / (1 + e), e = exp(-2 |y|)
inline __m512 softcap16(__m512 x, float cap) {
  const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.0f / cap));
  const __m512 ay = _mm512_abs_ps(y);
  const __m512 e = exp_avx512(_mm512_mul_ps(ay, _mm512_set1_ps(-2.0f)));
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(INT32_MIN));
  return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign)),
                       _mm512_set1_ps(cap));
}

// scores of key tiles [0, tiles) of the chunk starting at key c0, for heads [g0, g0 + ng)
// (ng <= 4) of the item's group: S[g][r][16 t ..] in `s`
void chunk_scores(const Packed& pk, int64_t kvh, int64_t c0, int64_t tiles, const uint16_t* q,
                  int64_t D, int64_t g0, int ng, float* s) {
  const int64_t ktiles = pk.keys_pad / 16;
  for (int64_t t = 0; t < tiles; ++t) {
    _tile_zero(0);
    if (ng > 1) _tile_zero(1);
    if (ng > 2) _tile_zero(2);
    if (ng > 3) _tile_zero(3);
    for (int64_t c = 0; c < pk.dchunks; ++c) {
      SF_TILE_LOADD(4, pk.kb + ((kvh * pk.dchunks + c) * ktiles + c0 / 16 + t) * 256, 64);
      const uint16_t* qc = q + g0 * 16 * D + 32 * c;
      SF_TILE_LOADD(5, qc, D * 2);
      _tile_dpbf16ps(0, 5, 4);
      if (ng > 1) {
        SF_TILE_LOADD(6, qc + 16 * D, D * 2);
        _tile_dpbf16ps(1, 6, 4);
      }
      if (ng > 2) {
        SF_TILE_LOADD(7, qc + 32 * D, D * 2);
        _tile_dpbf16ps(2, 7, 4);
      }
      if (ng > 3) {
        SF_TILE_LOADD(5, qc + 48 * D, D * 2);
        _tile_dpbf16ps(3, 5, 4);
      }
    }
    float* st = s + g0 * 16 * kRowS + 16 * t;
    SF_TILE_STORED(0, st, kRowS * 4);
    if (ng > 1) SF_TILE_STORED(1, st + 16 * kRowS, kRowS * 4);
    if (ng > 2) SF_TILE_STORED(2, st + 32 * kRowS, kRowS * 4);
    if (ng > 3) SF_TILE_STORED(3, st + 48 * kRowS, kRowS * 4);
  }
}

// O[g][r][16 u ..] += P[g] V for the chunk's pair blocks [0, blocks) (32 keys each), value
// columns 16 u for u in [u0, u0 + nu) (nu <= 4); `p` the head's rounded probabilities,
// `p + lo` what their rounding left out
void chunk_values(const Packed& pk, int64_t kvh, int64_t c0, int64_t blocks, const uint16_t* p,
                  int64_t lo, int64_t D, int64_t u0, int nu, float* o) {
  const uint32_t* vb = pk.vb + (kvh * (pk.keys_pad / 2) + c0 / 2) * D + 16 * u0;
  float* ou = o + 16 * u0;
  SF_TILE_LOADD(0, ou, D * 4);
  if (nu > 1) SF_TILE_LOADD(1, ou + 16, D * 4);
  if (nu > 2) SF_TILE_LOADD(2, ou + 32, D * 4);
  if (nu > 3) SF_TILE_LOADD(3, ou + 48, D * 4);
  for (int64_t b = 0; b < blocks; ++b) {
    SF_TILE_LOADD(4, p + 32 * b, kRowP * 2);
    SF_TILE_LOADD(5, p + lo + 32 * b, kRowP * 2);
    const uint32_t* vt = vb + 16 * b * D;
    SF_TILE_LOADD(6, vt, D * 4);
    _tile_dpbf16ps(0, 4, 6);
    if (nu > 1) {
      SF_TILE_LOADD(7, vt + 16, D * 4);
      _tile_dpbf16ps(1, 4, 7);
    }
    _tile_dpbf16ps(0, 5, 6);
    if (nu > 1) _tile_dpbf16ps(1, 5, 7);
    if (nu > 2) {
      SF_TILE_LOADD(6, vt + 32, D * 4);
      _tile_dpbf16ps(2, 4, 6);
    }
    if (nu > 3) {
      SF_TILE_LOADD(7, vt + 48, D * 4);
      _tile_dpbf16ps(3, 4, 7);
    }
    if (nu > 2) _tile_dpbf16ps(2, 5, 6);
    if (nu > 3) _tile_dpbf16ps(3, 5, 7);
  }
  SF_TILE_STORED(0, ou, D * 4);
  if (nu > 1) SF_TILE_STORED(1, ou + 16, D * 4);
  if (nu > 2) SF_TILE_STORED(2, ou + 32, D * 4);
  if (nu > 3) SF_TILE_STORED(3, ou + 48, D * 4);
}

void item(const PrefillAttn& a, const Packed& pk, int64_t it, ItemBuffers& buf) {
  const int64_t D = a.dim, H = a.heads, KVH = a.kv_heads, G = H / KVH;
  const int64_t qblocks = (a.n + 15) / 16;
  const int64_t kvh = it / qblocks, r0 = (it % qblocks) * 16;
  const int64_t nr = std::min<int64_t>(16, a.n - r0);
  const uint16_t* q = static_cast<const uint16_t*>(a.q);
  // the group's query rows, zeros past the prompt
  for (int64_t g = 0; g < G; ++g)
    for (int64_t r = 0; r < 16; ++r) {
      uint16_t* dst = buf.q + (g * 16 + r) * D;
      const uint16_t* src = r < nr ? q + (r0 + r) * a.q_stride + (kvh * G + g) * D : nullptr;
      for (int64_t d = 0; d < D; d += 32)
        _mm512_storeu_si512(dst + d, src ? _mm512_loadu_si512(src + d) : _mm512_setzero_si512());
    }
  for (int64_t i = 0; i < G * 16; ++i) {
    buf.m[i] = -INFINITY;
    buf.l[i] = 0;
  }
  std::fill(buf.o, buf.o + G * 16 * D, 0.0f);

  // row r sees keys [lo(r), hi(r)] (indices into the keys, whose first is position `first`);
  // rows past the prompt take the last row's, so none is empty
  const auto pos = [&](int64_t r) { return a.prefix + r0 + std::min(r, nr - 1); };
  const auto hi = [&](int64_t r) { return pos(r) - a.first; };
  const auto lo = [&](int64_t r) {
    return a.window > 0 ? std::max<int64_t>(0, pos(r) - a.window + 1 - a.first) : 0;
  };
  const int64_t j_lo = lo(0) / 32 * 32, j_end = hi(nr - 1) + 1;
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t c0 = j_lo; c0 < j_end; c0 += kChunk) {
    const int64_t c1 = std::min(c0 + kChunk, j_end);
    const int64_t width = (c1 - c0 + 31) / 32 * 32;  // whole pair blocks (the keys are padded)
    for (int64_t g0 = 0; g0 < G; g0 += 4)
      chunk_scores(pk, kvh, c0, width / 16, buf.q, D, g0, static_cast<int>(std::min<int64_t>(4, G - g0)),
                   buf.s);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t r = 0; r < 16; ++r) {
        const int64_t i = g * 16 + r;
        float* sr = buf.s + i * kRowS;
        uint16_t* pr = buf.p + i * kRowP;
        uint16_t* plo = pr + G * 16 * kRowP;
        const int64_t from = std::max<int64_t>(lo(r), c0) - c0, to = std::min<int64_t>(hi(r) + 1, c1) - c0;
        if (to <= from) {  // nothing visible in this chunk: no probabilities, no rescale
          for (int64_t j = 0; j < width; j += 32) {
            _mm512_storeu_si512(pr + j, _mm512_setzero_si512());
            _mm512_storeu_si512(plo + j, _mm512_setzero_si512());
          }
          continue;
        }
        // the 16-key runs that hold visible keys, [jf, jt); a run only partly visible is
        // masked to -inf outside [from, to)
        const int64_t jf = from / 16 * 16, jt = (to + 15) / 16 * 16;
        const __m512 scale = _mm512_set1_ps(a.scale);
        const __m512i vfrom = _mm512_set1_epi32(static_cast<int32_t>(from));
        const __m512i vto = _mm512_set1_epi32(static_cast<int32_t>(to));
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int64_t j = jf; j < jt; j += 16) {
          __m512 x = _mm512_mul_ps(_mm512_load_ps(sr + j), scale);
          if (a.softcap > 0) x = softcap16(x, a.softcap);
          if (j < from || j + 16 > to) {
            const __m512i idx = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(j)));
            const __mmask16 vis = _mm512_cmpge_epi32_mask(idx, vfrom) & _mm512_cmplt_epi32_mask(idx, vto);
            x = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), vis, x);
          }
          _mm512_store_ps(sr + j, x);
          mx = _mm512_max_ps(mx, x);
        }
        const float mnew = std::max(buf.m[i], _mm512_reduce_max_ps(mx));
        const float alpha = buf.m[i] == -INFINITY ? 0.0f : std::exp(buf.m[i] - mnew);
        buf.m[i] = mnew;
        const __m512 mv = _mm512_set1_ps(mnew);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < width; j += 32) {
          __m512 pj[2];
          for (int h = 0; h < 2; ++h) {
            const int64_t jj = j + 16 * h;
            if (jj >= jf && jj < jt) {
              const __m512 x = _mm512_load_ps(sr + jj);
              // a masked score (-inf) gives 0 by definition, not by the exponential
              const __mmask16 seen = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
              pj[h] = _mm512_maskz_mov_ps(seen, exp_avx512_unclamped(_mm512_sub_ps(x, mv)));
            } else {
              pj[h] = _mm512_setzero_ps();
            }
            sum = _mm512_add_ps(sum, pj[h]);
          }
          const __m512i hi = (__m512i)_mm512_cvtne2ps_pbh(pj[1], pj[0]);
          _mm512_storeu_si512(pr + j, hi);
          // what the rounding left out: p - hi, exact in float32
          const __m512 h0 = widen_bf16(_mm512_castsi512_si256(hi));
          const __m512 h1 = widen_bf16(_mm512_extracti64x4_epi64(hi, 1));
          _mm512_storeu_si512(plo + j, (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(pj[1], h1), _mm512_sub_ps(pj[0], h0)));
        }
        buf.l[i] = buf.l[i] * alpha + _mm512_reduce_add_ps(sum);
        if (alpha != 1.0f) {
          float* orow = buf.o + i * D;
          const __m512 av = _mm512_set1_ps(alpha);
          for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(orow + d, _mm512_mul_ps(_mm512_loadu_ps(orow + d), av));
        }
      }
    for (int64_t g = 0; g < G; ++g)
      for (int64_t u0 = 0; u0 < D / 16; u0 += 4)
        chunk_values(pk, kvh, c0, width / 32, buf.p + g * 16 * kRowP, G * 16 * kRowP, D, u0,
                     static_cast<int>(std::min<int64_t>(4, D / 16 - u0)), buf.o + g * 16 * D);
  }
  uint16_t* out = static_cast<uint16_t*>(a.out);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t r = 0; r < nr; ++r) {
      const int64_t i = g * 16 + r;
      const __m512 inv = _mm512_set1_ps(buf.l[i] > 0 ? 1.0f / buf.l[i] : 0.0f);
      uint16_t* dst = out + ((r0 + r) * H + kvh * G + g) * D;
      for (int64_t d = 0; d < D; d += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(buf.o + i * D + d), inv)));
    }
}

}  // namespace

int64_t prefill_packed_keys(int64_t keys) { return (keys + 31) / 32 * 32; }

namespace {
Packed packed(const PrefillAttn& a, const uint32_t* kb, const uint32_t* vb) {
  Packed pk;
  pk.keys_pad = prefill_packed_keys(a.prefix + a.n - a.first);
  pk.dchunks = a.dim / 32;
  pk.kb = const_cast<uint32_t*>(kb);
  pk.vb = const_cast<uint32_t*>(vb);
  return pk;
}
}  // namespace

// work items i0, i0 + step, ... below i1 of kv_heads * ceil(n / 16)
void prefill_items_bf16(const PrefillAttn& a, const uint32_t* kb, const uint32_t* vb,
                        int64_t i0, int64_t i1, int64_t step) {
  configure();
  const Packed pk = packed(a, kb, vb);
  thread_local ItemBuffers buf;
  buf.ensure(a.heads / a.kv_heads, a.dim);
  for (int64_t i = i0; i < i1; i += step) item(a, pk, i, buf);
  _tile_release();
}

void prefill_pack_keys_bf16(const PrefillAttn& a, uint32_t* kb, uint32_t* vb, int64_t t0,
                            int64_t t1) {
  prefill_pack_bf16(a, packed(a, kb, vb), t0, t1);
}

}  // namespace amx
}  // namespace sf

#pragma GCC pop_options

#else  // no AMX intrinsics in this compiler: the tiles are never granted (isa_amx.cpp)

namespace sf {
namespace amx {
int64_t prefill_packed_keys(int64_t keys) { return (keys + 31) / 32 * 32; }
void prefill_items_bf16(const PrefillAttn&, const uint32_t*, const uint32_t*, int64_t, int64_t,
                        int64_t) {}
void prefill_pack_keys_bf16(const PrefillAttn&, uint32_t*, uint32_t*, int64_t, int64_t) {}
}  // namespace amx
}  // namespace sf

#endif  // SF_HAVE_AMX
