// stallfree's CPU kernels: the raw-pointer interface every instruction-set variant implements.
//
// Nothing here includes torch: the variants (isa_avx512.cpp, isa_avx2.cpp) are compiled with
// their own target attributes and chosen at run time by ops.cpp, the one file that binds them
// to torch operators. Each function works on a slice of output rows [n0, n1) so that ops.cpp
// can split the rows over torch's threads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

// GCC 11 and Clang 12 were the first to know the AMX intrinsics; with an older compiler the
// AMX units (isa_amx.cpp, amx_gemm.cpp, amx_prefill_attention.cpp) build as stubs and the
// tiles are reported missing (amx::request_tiles) rather than the library failing to build.
#if (defined(__clang__) && __clang_major__ >= 12) || \
    (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define SF_HAVE_AMX 1
#else
#define SF_HAVE_AMX 0
#endif

namespace sf {

// A thread's scratch buffer `v` holding at least `n` values, grown and never shrunk: a resize
// to each call's size would zero-fill again whatever a call of another shape had shrunk away
// (the prompt products' packed activations alternate between widths layer by layer)
template <class T>
T* scratch(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

// Activations quantised once per call, llama.cpp's Q8_0 way: blocks of 32 values, one float
// scale each, codes in [-127, 127]. Rows are padded with zeros to `kp` (a multiple of 64).
struct Q8Act {
  int64_t m = 0;          // rows
  int64_t k = 0;          // values per row (a multiple of 32)
  int64_t kp = 0;         // padded row length (a multiple of 128)
  int8_t* q = nullptr;    // [m, kp] signed codes
  int32_t* offset = nullptr;  // [m, kp / 4] -128 times each 4 codes' sum (the AVX-512 dot's)
  float* d = nullptr;     // [m, kp / 32] block scales
  float* dvec = nullptr;  // [m, kp / 64, 16] the two block scales of each 64 values, 8 lanes each
  float* bsum = nullptr;  // [m, kp / 32] d * sum(codes) per block (the int4 offsets' term)
};

// Output rows are float32 or bfloat16 (round to nearest even); `ldo` is the row stride.
struct Out {
  void* ptr = nullptr;
  int64_t ldo = 0;
  bool bf16 = false;
  // > 0: the output is the next prompt product's packed activations (pack_x_gemm's order, the
  // values rounded to bfloat16) for this many chunks of 16 rows, not rows of `ldo` values
  int64_t packed_chunks = 0;
  // float32 rows holding each value rounded to bfloat16 (a bfloat16 model's dense weight,
  // widened; the dequantising kernels only)
  bool bf16_values = false;
};

using QuantizeFn = void (*)(const void* x, bool x_bf16, int64_t row, Q8Act& a);
// y[m, n] = scale[n] * sum_k x[m, k] * w[n, k] (+ bias[n]) for n in [n0, n1); with `bscale`
// (float16 [n, k / 32], one scale per block of 32 weights: GGUF's Q8_0) instead
// y[m, n] = sum_k x[m, k] * w[n, k] * bscale[n, k / 32] (+ bias[n]) and `scale` is unused
using GemvQ8Fn = void (*)(const Q8Act& a, const int8_t* w, const float* scale,
                          const uint16_t* bscale, const float* bias, int64_t n0, int64_t n1,
                          Out out);
// int4 codes, groups of 32: byte j of a group holds value j (low nibble) and j + 16 (high);
// w = code * gscale[n, g] + goffset[n, g], the scales and offsets in float16
using GemvQ4Fn = void (*)(const Q8Act& a, const uint8_t* codes, const uint16_t* gscale,
                          const uint16_t* goffset, const float* bias, int64_t n0, int64_t n1,
                          Out out);
// rows [n0, n1) of an int8 weight [n, k] written dense to `out` (row stride out.ldo):
// w * scale[n], or with `bscale` (float16 [n, k / 32]) w * bscale[n, c / 32]; k % 32 == 0
using DequantQ8Fn = void (*)(const int8_t* w, const float* scale, const uint16_t* bscale,
                             int64_t k, int64_t n0, int64_t n1, Out out);
// rows [n0, n1) of int4 groups (gemv_q4's layout) written dense: code * gscale + goffset
using DequantQ4Fn = void (*)(const uint8_t* codes, const uint16_t* gscale,
                             const uint16_t* goffset, int64_t k, int64_t n0, int64_t n1,
                             Out out);
// dense weights: w bf16 (x bf16) or float32 (x float32), [n, k] row-major, `ldw` values from
// one weight row to the next (k, or more where the loader padded the rows: padded_rows.py)
using GemvDenseFn = void (*)(const void* x, int64_t m, int64_t k, const void* w, int64_t ldw,
                             const float* bias, int64_t n0, int64_t n1, Out out);
// rows [r0, r1) of x [rows, dim]: out = norm(x) * w; with `delta`, x + delta is written to
// `sum` first and normalised (transformers' order: the sum rounded to the dtype first)
using RmsNormFn = void (*)(const void* x, const void* delta, void* sum, const void* w,
                           void* out, int64_t r0, int64_t r1, int64_t dim, float eps,
                           bool bf16);
// rows [r0, r1) of gu [rows, 2 * inter]: out = silu(gate) * up, each rounded to the dtype
using SiluMulFn = void (*)(const void* gu, void* out, int64_t r0, int64_t r1, int64_t inter,
                           bool bf16);
// gemv_bf16's product with its bits, for x [m, k] bfloat16 and a weight in the compact form
// (namespace compact below): codes uint8 [n, 1.5 k] and tables [n, 16]; a row that does not
// fit is read from `dense` (the weight as it is, `ldw` values a row); k % 64 == 0
using GemvCompactFn = void (*)(const uint16_t* x, int64_t m, int64_t k, const uint8_t* codes,
                               const uint8_t* tables, const uint16_t* dense, int64_t ldw,
                               const float* bias, int64_t n0, int64_t n1, Out out);

struct Kernels {
  const char* name;
  QuantizeFn quantize;
  GemvQ8Fn gemv_q8;
  GemvQ4Fn gemv_q4;
  GemvDenseFn gemv_bf16;
  GemvDenseFn gemv_f32;
  RmsNormFn rms_norm;
  SiluMulFn silu_mul;
  DequantQ8Fn dequant_q8;
  DequantQ4Fn dequant_q4;
  GemvCompactFn gemv_compact;
};

namespace avx512 {
const Kernels& kernels();
}
namespace avx2 {
const Kernels& kernels();
// rows [r0, r1) of a bfloat16 weight in the compact form (namespace compact below) decoded
// into `out`, k values a row from row r0 on: bfloat16, or float32 where `f32`; a row that does
// not fit is read from `dense` (`ldw` values a row). Built for AVX2 whichever variant is
// selected (every CPU with a compact form has it): the prompts of `--compact-decode-weights
// only` decode their weight a block of rows at a time with it.
void decompact(const uint8_t* codes, const uint8_t* tables, const uint16_t* dense, int64_t ldw,
               int64_t k, int64_t r0, int64_t r1, void* out, bool f32);
}
// int8 weights with 16 output rows in the vector lanes (q8_lanes.cpp): uint8 [n / 16, k / 4,
// 16, 4], each value w + 128; block scales (GGUF's Q8_0) float16 [n / 16, k / 32, 16]. Built
// for AVX-512 with VNNI whichever variant is selected; callers check the CPU has it.
namespace lanes {
// corr [m, k / 32]: -128 times the sum of each block's 32 codes (gemv_q8's starting sums)
void block_corrections(const Q8Act& a, int32_t* corr);
// gemv_q8's product for the groups of 16 output rows [g0, g1)
void gemv_q8(const Q8Act& a, const int32_t* corr, const uint8_t* w, const float* scale,
             const uint16_t* bscale, const float* bias, int64_t g0, int64_t g1, Out out);
// dequant_q8's for the groups [g0, g1): rows written dense, `out.ldo` values apart
void dequant_q8(const uint8_t* w, const float* scale, const uint16_t* bscale, int64_t k,
                int64_t g0, int64_t g1, Out out);
// int4 codes likewise (uint8 [n / 16, k / 32, 4, 64]: byte t of lane r in vector q holds row
// r's codes q * 4 + t low and 16 + q * 4 + t high), scales and offsets float16 [n / 16, k / 32,
// 16]: gemv_q4's product and dequant_q4's values for the groups [g0, g1)
void gemv_q4(const Q8Act& a, const uint8_t* codes, const uint16_t* gscale,
             const uint16_t* goffset, const float* bias, int64_t g0, int64_t g1, Out out);
void dequant_q4(const uint8_t* codes, const uint16_t* gscale, const uint16_t* goffset,
                int64_t k, int64_t g0, int64_t g1, Out out);
}  // namespace lanes
// bfloat16 weights in 12 bits a value, losslessly (compact_bf16.cpp): per row k low bytes and
// k / 2 bytes of 4-bit codes into the row's table of 16 high bytes (uint8 [n, 1.5 k] and
// [n, 16]); k % 64 == 0. A row that does not fit has 0xFF at its table's code 0.
namespace compact {
constexpr int kCodes = 16;           // a row's table of high bytes
constexpr int64_t kBlockBytes = 96;  // a block of 64 values: 64 low bytes, then 32 code bytes
// rows [r0, r1) of w (`ldw` values a row) into codes and tables
void pack(const uint16_t* w, int64_t ldw, int64_t k, int64_t r0, int64_t r1, uint8_t* codes,
          uint8_t* tables);
// rows [r0, r1) back to bfloat16, k values a row (a row that does not fit: undefined values)
void unpack(const uint8_t* codes, const uint8_t* tables, int64_t k, int64_t r0, int64_t r1,
            uint16_t* out);
bool fits(const uint8_t* tables, int64_t r);
// the AVX-512 variant's gemv_compact (its Kernels entry; the AVX2 variant's is its own)
void gemv(const uint16_t* x, int64_t m, int64_t k, const uint8_t* codes, const uint8_t* tables,
          const uint16_t* dense, int64_t ldw, const float* bias, int64_t n0, int64_t n1,
          Out out);
}  // namespace compact
// The prompt products' packed activations and the bfloat16 prompt product without the AMX
// tiles (bf16_gemm.cpp; AVX-512 with BF16, which the AVX-512 variant requires)
namespace avx512 {
// uint32 values pack_x_gemm writes for m rows of k values (k % 32 == 0), 64-byte aligned by
// the caller: chunks of 16 rows, value pairs interleaved, every chunk's first 32 values, then
// every chunk's next 32, ... (the order the AMX tiles' prompt products read too)
int64_t packed_gemm_size(int64_t m, int64_t k);
// (blocks of 32 values [b0, b1) of every chunk: threads share the packing by blocks)
void pack_x_gemm(const uint16_t* x, int64_t m, int64_t k, uint32_t* xp, int64_t b0, int64_t b1);
// amx::gemm_bf16's product and epilogues (below) with `vdpbf16ps`: for blocks of 16 output rows
// in [n0, n1), a bfloat16 weight as it is, `ldw` values a row
void gemm_bf16(const uint32_t* xp, int64_t m, int64_t k, const uint16_t* w, int64_t ldw,
               const float* bias, int64_t n0, int64_t n1, int64_t pair, Out out);
// An integer weight's rows for gemm_dequant: fill(ctx, row, dst) writes the 16 rows from `row`
// (a multiple of 16) dequantised to bfloat16 into dst, k values a row (the dense path's values)
struct RowSource {
  void (*fill)(const void* ctx, int64_t row, uint16_t* dst) = nullptr;
  const void* ctx = nullptr;
};
// gemm_bf16's product on an integer weight, its rows dequantised 16 at a time into cache as
// the product walks them (amx::gemm_q8 and gemm_q4's way), not whole into a workspace
void gemm_dequant(const uint32_t* xp, int64_t m, int64_t k, RowSource src, const float* bias,
                  int64_t n0, int64_t n1, int64_t pair, Out out);
}  // namespace avx512
// AMX tiles for dense bfloat16 at a few rows (isa_amx.cpp), beside the AVX-512 variant
namespace amx {
// whether the CPU reports AMX-TILE and AMX-BF16 and the kernel granted this process the tile
// state (Linux asks for it per process); nothing else in this namespace runs unless it did
bool request_tiles();
// uint32 values `pack_x` writes for m rows of k values (k % 32 == 0)
int64_t packed_size(int64_t m, int64_t k);
// x [m, k] bfloat16 into the tile order: chunks of up to 16 rows, value pairs interleaved
void pack_x(const uint16_t* x, int64_t m, int64_t k, uint32_t* xp);
// gemv_bf16's product for the whole blocks of 16 output rows in [n0, n1) (the caller runs the
// rest on the AVX-512 variant); `xp` from pack_x
void gemv_bf16(const uint32_t* xp, int64_t m, int64_t k, const uint16_t* w, int64_t ldw,
               const float* bias, int64_t n0, int64_t n1, Out out);
// the prompt product of int8 weights (amx_gemm.cpp): y = x @ (w * scale).T (+ bias), the weight
// dequantised to bfloat16 block by block into cache (bfloat16 and int4 weights below), for blocks of 16 output rows in [n0, n1)
// (n1 - n0 a multiple of 16); `xp` from avx512::pack_x_gemm.
// With `pair` > 0 the weight is a gate and up projection's stacked rows (up row j at pair +
// j), [n0, n1) are gate rows, and the output [m, pair] is silu(gate) * up (a bfloat16 one with
// silu_mul's roundings).
void gemm_q8(const uint32_t* xp, int64_t m, int64_t k, const int8_t* w, const float* scale,
             const uint16_t* bscale, const float* bias, int64_t n0, int64_t n1, int64_t pair,
             Out out);
// the same for a bfloat16 weight as it is, `ldw` values a row
void gemm_bf16(const uint32_t* xp, int64_t m, int64_t k, const uint16_t* w, int64_t ldw,
               const float* bias, int64_t n0, int64_t n1, int64_t pair, Out out);
// the same for int4 codes (16 bytes per group of 32, float16 scale and offset per group)
void gemm_q4(const uint32_t* xp, int64_t m, int64_t k, const uint8_t* codes,
             const uint16_t* gscale, const uint16_t* goffset, const float* bias, int64_t n0,
             int64_t n1, int64_t pair, Out out);
// the quantised activations' codes in the int8 tiles' order (`packed_q8_size` uint32 values)
// and their block scales, 16 lanes per block and chunk (`packed_q8_scales` floats)
int64_t packed_q8_size(int64_t m, int64_t k);
int64_t packed_q8_scales(int64_t m, int64_t k);
void pack_q8(const Q8Act& a, uint32_t* xp, float* ad);
// gemv_q8's product (row `scale` or float16 `bscale` per block of 32) for the whole blocks of
// 16 output rows in [n0, n1)
void gemv_q8(const uint32_t* xp, const float* ad, int64_t m, int64_t k, const int8_t* w,
             const float* scale, const uint16_t* bscale, const float* bias, int64_t n0,
             int64_t n1, Out out);
// gemv_q4's product (int4 groups of 32 with float16 scale and offset) for the whole blocks of
// 16 output rows in [n0, n1), the activations read from `a` as they are (past 16 rows, whole
// chunks of 16: its rows up to the next multiple of 16 must be readable, as quantize_act
// allocates them)
void gemv_q4(const Q8Act& a, const uint8_t* codes, const uint16_t* gscale,
             const uint16_t* goffset, const float* bias, int64_t n0, int64_t n1, Out out);
}  // namespace amx

// How far ahead (bytes) the AVX-512 matrix-vector kernels prefetch a weight, into L2
// (prefetcht1): the same column of the tile four tiles on, `tile_bytes` being one tile's
// rows, or fewer tiles where a tile passes 64 KB, so at most 256 KB of L2 is ahead. On Zen 4,
// where these kernels run without AMX, prefetcht0 two tiles ahead read SmolLM2's bf16 shapes
// at 22-29 GB/s against a 35 GB/s read probe, and prefetcht1 four tiles ahead at 32-34 (one
// program, 256 MB of weights, 2 threads; the hint mattered, the distance little). Intel's
// AMX tiles read the same with either hint (docs/performance.md), and keep their own.
// (The AVX2 variant fetches the weight as one stream in address order instead: isa_avx2.cpp's
// Ahead, measured on a Zen 3.)
inline int64_t prefetch_ahead(int64_t tile_bytes) {
  constexpr int64_t kTiles = 4, kMost = 256 << 10;
  const int64_t tiles = tile_bytes * kTiles <= kMost ? kTiles : std::max<int64_t>(1, kMost / tile_bytes);
  return tiles * tile_bytes;
}

// the variant set_isa selected ("avx512", "avx2"), or nullptr when none is (ops.cpp)
const char* selected_isa();

// bfloat16 <-> float32, round to nearest even (NaN kept quiet)
inline float bf16_to_f32(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace sf
