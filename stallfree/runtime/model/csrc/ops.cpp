// torch operators over the kernels (torch.ops.stallfree.*), one instruction-set variant chosen
// at run time.
//
// The only file that includes torch: it checks shapes and dtypes, allocates outputs, quantises
// activations once per call and splits output rows over torch's own OpenMP threads
// (at::parallel_for), so the kernels honour torch.set_num_threads and add no thread pool.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/silu.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <tuple>
#include <vector>

#include "kernels.h"

namespace sf {
namespace {

const Kernels* g_kernels = nullptr;

bool cpu_has(const char* level) {
  __builtin_cpu_init();
  if (std::string(level) == "avx512") {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bf16") &&
           __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }
  if (std::string(level) == "avx2") {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }
  return false;
}

// The variant to use: `want` ("auto", "avx512", "avx2"); returns the name chosen, or "" when
// this CPU has none of them (or not the one asked for).
std::string select_isa(const std::string& want) {
  g_kernels = nullptr;
  if ((want == "auto" || want == "avx512") && cpu_has("avx512")) {
    g_kernels = &avx512::kernels();
  } else if ((want == "auto" || want == "avx2") && cpu_has("avx2")) {
    g_kernels = &avx2::kernels();
  }
  return g_kernels ? g_kernels->name : "";
}

const Kernels& K() {
  TORCH_CHECK(g_kernels != nullptr, "stallfree kernels: no instruction set selected");
  return *g_kernels;
}

// rows of `x` as [rows, k] (x contiguous), and the output shape with the last dim `n`
std::vector<int64_t> out_shape(const at::Tensor& x, int64_t n) {
  auto shape = x.sizes().vec();
  shape.back() = n;
  return shape;
}

void check_act(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.device().is_cpu(), what, ": expected a CPU tensor");
  TORCH_CHECK(x.is_contiguous(), what, ": expected a contiguous tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, what,
              ": expected float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1, what, ": expected at least one dimension");
}

const float* opt_bias(const std::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
              "bias: expected a contiguous float32 tensor of ", n, " values");
  return bias->data_ptr<float>();
}

// `out` for an input with no elements: nothing when it has no rows either; with rows but no
// features (in_features 0) every row is the bias, or zeros, as F.linear gives it, and with
// `silu` silu(gate) * up of the bias's two halves. The kernels are never entered with k = 0
// (the prompt's divided the input's size by it; the others returned `out` unwritten).
at::Tensor without_inputs(at::Tensor out, const std::optional<at::Tensor>& bias, bool silu) {
  if (out.numel() == 0) return out;
  if (!bias.has_value()) return out.zero_();
  const at::Tensor full = bias->to(out.scalar_type());
  if (!silu) return out.copy_(full.expand_as(out));
  const int64_t width = out.size(-1);
  return out.copy_(at::silu(full.narrow(0, 0, width)).mul(full.narrow(0, width, width)).expand_as(out));
}

// rows of work per thread chunk: enough to stream (and a multiple of the 4-row tile)
constexpr int64_t kGrain = 64;
// chunks of 16 rows x 32 values a thread packs at least (each a 16 x 16 transpose)
constexpr int64_t kPackGrain = 64;
// activations (bfloat16 bytes) below which each thread packs them for itself (prompt_on_tiles)
constexpr int64_t kOwnPackBytes = int64_t{1} << 20;

// `buf` grown to hold m x k packed activations, at its first 64-byte boundary
uint32_t* aligned_pack_buffer(std::vector<uint32_t>& buf, int64_t m, int64_t k) {
  return reinterpret_cast<uint32_t*>(
      (reinterpret_cast<uintptr_t>(scratch(buf, avx512::packed_gemm_size(m, k) + 16)) + 63) &
      ~uintptr_t{63});
}

// Dense bfloat16 products of kAmxMinRows to kAmxMaxRows rows go to the AMX tiles where
// `set_amx` turned them on (isa_amx.cpp); above, oneDNN's blocked product (F.linear). At one
// and two rows `vdpbf16ps` streams the weights faster than the tiles load them: SmolLM2's five
// projection shapes, 30 copies, two threads on a quiet machine, 2 rows 1981 / 2044 us a step
// on AVX-512 against 2220 / 2268 on the tiles, 3 rows even (2268 / 2296 against 2254 / 2287),
// 4 rows 2449 / 2382 against 2267 / 2344. (One thread had put the tiles ahead from 2 rows.)
constexpr int64_t kAmxMinRows = 3;
// the most rows a call takes on the tiles (chunks of 16 activation rows over each block of 16
// weight rows while it is in L1); native_layers.py sends up to AMX_DECODE_MAX_ROWS of a decode
// step's rows here (the tiles beat F.linear up to about 48 rows)
constexpr int64_t kAmxMaxRows = 64;
bool g_amx = false;
// products the tiles have taken since the library loaded (`amx_calls`: tests count them)
std::atomic<int64_t> g_amx_calls{0};

bool amx_applies(const at::Tensor& x, int64_t m, int64_t k) {
  return g_amx && x.scalar_type() == at::kBFloat16 && k % 32 == 0 && m >= kAmxMinRows &&
         m <= kAmxMaxRows;
}

// x [m, k] in the tiles' order, in a buffer of the calling thread's
const uint32_t* packed_x(const at::Tensor& x, int64_t m, int64_t k) {
  thread_local std::vector<uint32_t> buf;
  uint32_t* xp = scratch(buf, amx::packed_size(m, k));
  amx::pack_x(static_cast<const uint16_t*>(x.data_ptr()), m, k, xp);
  return xp;
}

// One weight's rows [0, n) (`ldw` values apart) on the tiles, 16 at a time over the threads;
// the last n % 16 rows on the AVX-512 kernel.
void dense_bf16_amx(const at::Tensor& x, int64_t m, int64_t k, const void* w, int64_t ldw,
                    int64_t n, const float* b, Out o) {
  g_amx_calls.fetch_add(1, std::memory_order_relaxed);
  const uint32_t* xp = packed_x(x, m, k);
  const auto* wp = static_cast<const uint16_t*>(w);
  const int64_t whole = n / 16 * 16;
  at::parallel_for(0, whole / 16, kGrain / 16, [&](int64_t b0, int64_t b1) {
    amx::gemv_bf16(xp, m, k, wp, ldw, b, b0 * 16, b1 * 16, o);
  });
  if (whole < n) K().gemv_bf16(x.data_ptr(), m, k, w, ldw, b, whole, n, o);
}

// A dense weight [out, in] of `dtype` whose rows are contiguous: the values from one row to
// the next (its `in`, or more where the loader padded the rows, padded_rows.py)
int64_t row_stride(const at::Tensor& w, at::ScalarType dtype, const char* op) {
  TORCH_CHECK(w.scalar_type() == dtype && w.dim() == 2 && (w.stride(1) == 1 || w.size(1) <= 1) &&
                  w.stride(0) >= w.size(1),
              op, ": weight must be a ", dtype, " [out, in] tensor with contiguous rows");
  return w.size(0) <= 1 ? w.size(1) : w.stride(0);
}

struct Q8Buffers {
  std::vector<int8_t> q;
  std::vector<int32_t> offset;
  std::vector<float> d, dvec, bsum;
};

Q8Act quantize_act(const at::Tensor& x, int64_t k) {
  thread_local Q8Buffers buf;
  Q8Act a;
  a.m = x.numel() / k;
  a.k = k;
  a.kp = (k + 127) / 128 * 128;
  // the int4 tiles read whole chunks of 16 rows past 16 (amx::gemv_q4): rows up to the next
  // multiple of 16 are allocated, their contents never reach an output
  const int64_t rows = a.m > 16 ? (a.m + 15) / 16 * 16 : a.m;
  a.q = scratch(buf.q, rows * a.kp);
  a.offset = scratch(buf.offset, a.m * a.kp / 4);
  a.d = scratch(buf.d, a.m * a.kp / 32);
  a.bsum = scratch(buf.bsum, a.m * a.kp / 32);
  a.dvec = scratch(buf.dvec, a.m * a.kp / 64 * 16);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const void* xp = x.data_ptr();
  const Kernels& kern = K();
  for (int64_t r = 0; r < a.m; ++r) kern.quantize(xp, bf16, r, a);
  return a;
}

// int8 weights on the tiles from this many rows: each block's scales are applied in AVX-512
// lanes after its tile product, which costs as much as the AVX-512 kernel's own work at a few
// rows (SmolLM2's four shapes, one thread: 4 rows 255 us on the tiles against 214 on AVX-512,
// 6 rows 263 against 338, 8 rows 276 against 402, 12 rows 346 against 642). With two pairs
// of blocks in flight and the outputs written from registers (isa_amx.cpp), five shapes, 30
// copies, two threads, two alternating rounds, us a step on the tiles against AVX-512: 5 rows
// 1303 / 1298 against 1752 / 1472, 4 rows 1340 / 1301 against 1296 / 1226.
constexpr int64_t kAmxQ8MinRows = 5;

// int8 and int4 products take the tiles up to this many rows (the kernels run chunks of 16
// activation rows over each block of weight rows while it is in L1); quant.py sends a layer
// here up to AMX_NATIVE_MAX_ROWS. SmolLM2's four projection shapes, 30 copies, two threads,
// the tiles against dequantising into the dense bf16 product: Q8_0 at 32 rows 15.0 against
// 24.2 ms, 64 rows 28.2 against 30.9; int4 at 32 rows 16.5 against 22.7, 48 rows 24.3 against
// 26.1, 64 rows 32.0 against 29.3.
constexpr int64_t kAmxIntMaxRows = 64;
bool amx_q8_applies(int64_t m) { return g_amx && m >= kAmxQ8MinRows && m <= kAmxIntMaxRows; }

// One int8 weight's rows [0, n) on the tiles, 16 at a time over the threads, the last n % 16 on
// the AVX-512 kernel; `scale` per row or `bscale` per block of 32, as gemv_q8 takes them.
void q8_amx(const Q8Act& a, const int8_t* w, const float* scale, const uint16_t* bscale,
            const float* bias, int64_t n, Out o) {
  g_amx_calls.fetch_add(1, std::memory_order_relaxed);
  thread_local std::vector<uint32_t> xbuf;
  thread_local std::vector<float> sbuf;
  uint32_t* xp = scratch(xbuf, amx::packed_q8_size(a.m, a.k));
  float* ad = scratch(sbuf, amx::packed_q8_scales(a.m, a.k));
  amx::pack_q8(a, xp, ad);
  const int64_t whole = n / 16 * 16;
  at::parallel_for(0, whole / 16, kGrain / 16, [&](int64_t b0, int64_t b1) {
    amx::gemv_q8(xp, ad, a.m, a.k, w, scale, bscale, bias, b0 * 16, b1 * 16, o);
  });
  if (whole < n) K().gemv_q8(a, w, scale, bscale, bias, whole, n, o);
}

// int4 codes on the tiles from this many rows, whole blocks of 16 output rows (the rest on the
// AVX-512 kernel). The tiles' unpacking of the codes and gathering of the scales cost the same
// at any row count and their epilogue grows with the rows, so they win where the AVX-512
// kernel's work per row has grown past that. 3072 x 576 int4 weights, 300 copies (from
// memory), two threads, the tiles against AVX-512, the median of 100-170 alternating rounds:
// 2 rows 1.19x the time, 3 rows 1.00x, 4 rows 0.78x.
constexpr int64_t kAmxQ4MinRows = 4;

bool amx_q4_applies(int64_t m) { return g_amx && m >= kAmxQ4MinRows && m <= kAmxIntMaxRows; }

void q4_amx(const Q8Act& a, const uint8_t* codes, const uint16_t* gs, const uint16_t* go,
            const float* bias, int64_t n, Out o) {
  g_amx_calls.fetch_add(1, std::memory_order_relaxed);
  const int64_t whole = n / 16 * 16;
  at::parallel_for(0, whole / 16, kGrain / 16, [&](int64_t b0, int64_t b1) {
    amx::gemv_q4(a, codes, gs, go, bias, b0 * 16, b1 * 16, o);
  });
  if (whole < n) K().gemv_q4(a, codes, gs, go, bias, whole, n, o);
}

Out out_of(at::Tensor& out, int64_t n) {
  return Out{out.data_ptr(), n, out.scalar_type() == at::kBFloat16};
}

// An integer weight's shape [n, k] and whether its codes hold 16 output rows in the lanes
// (q8_lanes.cpp), which only the AVX-512 variant's kernels read, whichever variant is selected
// (quant.py lays a weight out so only where it was)
struct IntWeight {
  int64_t n = 0, k = 0;
  bool lanes = false;
};

// int8 codes: row-major int8 [out, in], or uint8 [out / 16, in / 4, 64] in the lanes
IntWeight q8_weight(const at::Tensor& qweight, const char* op) {
  IntWeight w;
  w.lanes = qweight.scalar_type() == at::kByte && qweight.dim() == 3 && qweight.size(2) == 64;
  TORCH_CHECK((w.lanes || (qweight.scalar_type() == at::kChar && qweight.dim() == 2)) &&
                  qweight.is_contiguous(),
              op, ": qweight must be a contiguous int8 [out, in] tensor, or uint8 [out / 16, in "
              "/ 4, 64] (16 rows in the lanes)");
  TORCH_CHECK(!w.lanes || cpu_has("avx512"), op,
              ": a weight with its rows in the lanes needs AVX-512 with VNNI");
  w.n = w.lanes ? qweight.size(0) * 16 : qweight.size(0);
  w.k = w.lanes ? qweight.size(1) * 4 : qweight.size(1);
  TORCH_CHECK(w.k % 32 == 0, op, ": in_features must be a multiple of 32, got ", w.k);
  return w;
}

// The product on a weight with its rows in the lanes, the groups of 16 rows over the threads
void q8_lanes(const Q8Act& a, const at::Tensor& qweight, const float* s, const uint16_t* bs,
              const float* b, int64_t n, Out o) {
  thread_local std::vector<int32_t> cbuf;
  int32_t* corr = scratch(cbuf, a.m * (a.k / 32));
  lanes::block_corrections(a, corr);
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  at::parallel_for(0, n / 16, kGrain / 16, [&](int64_t g0, int64_t g1) {
    lanes::gemv_q8(a, corr, w, s, bs, b, g0, g1, o);
  });
}

// int4 codes: nibble pairs [out, in / 32, 16] (byte j of a group: value j low, j + 16 high),
// or [out / 16, in / 32, 4, 64] in the lanes
IntWeight q4_codes(const at::Tensor& codes, const char* op) {
  IntWeight c;
  c.lanes = codes.dim() == 4 && codes.size(2) == 4 && codes.size(3) == 64;
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  (c.lanes || (codes.dim() == 3 && codes.size(2) == 16)),
              op, ": codes must be a contiguous uint8 [out, in / 32, 16] tensor, or [out / 16, "
              "in / 32, 4, 64] (16 rows in the lanes)");
  TORCH_CHECK(!c.lanes || cpu_has("avx512"), op,
              ": codes with their rows in the lanes need AVX-512 with VNNI");
  c.n = codes.size(0) * (c.lanes ? 16 : 1);
  c.k = codes.size(1) * 32;
  return c;
}

at::Tensor linear_q8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                     const std::optional<at::Tensor>& bias) {
  check_act(x, "linear_q8");
  const IntWeight qw = q8_weight(qweight, "linear_q8");
  const int64_t n = qw.n, k = qw.k;
  TORCH_CHECK(x.size(-1) == k, "linear_q8: input has ", x.size(-1), " features, weight ", k);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == n && scale.is_contiguous(),
              "linear_q8: scale must be float32 [out]");
  at::Tensor out = at::empty(out_shape(x, n), x.options());
  const float* b = opt_bias(bias, n);
  if (x.numel() == 0) return without_inputs(out, bias, false);
  const Q8Act a = quantize_act(x, k);
  const float* s = scale.data_ptr<float>();
  const Out o = out_of(out, n);
  if (qw.lanes) {
    q8_lanes(a, qweight, s, nullptr, b, n, o);
    return out;
  }
  const int8_t* w = qweight.data_ptr<int8_t>();
  if (amx_q8_applies(a.m)) {
    q8_amx(a, w, s, nullptr, b, n, o);
    return out;
  }
  const auto fn = K().gemv_q8;
  at::parallel_for(0, n, kGrain,
                   [&](int64_t n0, int64_t n1) { fn(a, w, s, nullptr, b, n0, n1, o); });
  return out;
}

// int8 weights with a float16 scale per block of 32 (GGUF's Q8_0 as the file stores it; with
// the rows in the lanes, the scales too: [out / 16, in / 32, 16])
at::Tensor linear_q8_blocks(const at::Tensor& x, const at::Tensor& qweight,
                            const at::Tensor& bscale, const std::optional<at::Tensor>& bias) {
  check_act(x, "linear_q8_blocks");
  const IntWeight qw = q8_weight(qweight, "linear_q8_blocks");
  const int64_t n = qw.n, k = qw.k;
  TORCH_CHECK(x.size(-1) == k, "linear_q8_blocks: input has ", x.size(-1), " features, weight ", k);
  TORCH_CHECK(bscale.scalar_type() == at::kHalf && bscale.numel() == n * (k / 32) &&
                  bscale.is_contiguous(),
              "linear_q8_blocks: block scales must be float16 [out, in / 32]");
  at::Tensor out = at::empty(out_shape(x, n), x.options());
  const float* b = opt_bias(bias, n);
  if (x.numel() == 0) return without_inputs(out, bias, false);
  const Q8Act a = quantize_act(x, k);
  const auto* bs = static_cast<const uint16_t*>(bscale.data_ptr());
  const Out o = out_of(out, n);
  if (qw.lanes) {
    q8_lanes(a, qweight, nullptr, bs, b, n, o);
    return out;
  }
  const int8_t* w = qweight.data_ptr<int8_t>();
  if (amx_q8_applies(a.m)) {
    q8_amx(a, w, nullptr, bs, b, n, o);
    return out;
  }
  const auto fn = K().gemv_q8;
  at::parallel_for(0, n, kGrain,
                   [&](int64_t n0, int64_t n1) { fn(a, w, nullptr, bs, b, n0, n1, o); });
  return out;
}

// A prompt's product on the AMX tiles (amx_gemm.cpp): bfloat16 activations as they are (not
// quantised: the dense path's numerics), the weight read in place (bfloat16) or dequantised
// block by block into L1 (int8, int4) instead of whole into a workspace, and never re-laid out
// as oneDNN does on every F.linear call.
// `gemm(xp, m, n0, n1, pair, out)` runs the blocks of output rows [n0, n1). With `silu` the
// weight's n rows are a gate and up projection's stacked, and the output is silu(gate) * up
// [.., n / 2] (the gate's rows [n0, n1), its up rows n / 2 further: `pair`), in the epilogue,
// where silu_mul would make another pass over the product. With `pack` the output is the next
// product's packed activations (int32 [width / 32, ceil(m / 16), 16, 16], pack_x_gemm's order,
// bfloat16 values), written without the transpose a row-major output takes; that product
// takes them as its `x` with their row count (`rows`), and packs nothing (an MLP's gate/up
// product feeding its down product: native_layers.mlp_on_tiles).
// A bfloat16 weight's product runs without the tiles too, on the AVX-512 variant
// (bf16_gemm.cpp: `vdpbf16ps`, with the same packed activations and epilogues; `vector`).
template <typename Gemm>
at::Tensor prompt_on_tiles(const char* name, const at::Tensor& x, int64_t n, int64_t k, bool silu,
                           const std::optional<at::Tensor>& bias, bool pack, int64_t rows,
                           Gemm gemm, bool vector = false) {
  TORCH_CHECK(g_amx || (vector && g_kernels == &avx512::kernels()), name,
              vector ? ": neither the AMX tiles nor the AVX-512 variant is in use in this process"
                     : ": the AMX tiles are not in use in this process");
  TORCH_CHECK(k % 32 == 0 && n % 16 == 0, name,
              ": in_features must be a multiple of 32 and out_features of 16, got ", k, " and ",
              n);
  TORCH_CHECK(!silu || n % 32 == 0, name, ": silu needs gate and up of a multiple of 16 rows each, got ",
              n, " rows");
  const int64_t width = silu ? n / 2 : n;
  TORCH_CHECK(!pack || width % 32 == 0, name, ": pack needs outputs in whole blocks of 32, got ",
              width);
  // x: bfloat16 rows, or (`rows` > 0) a product's packed output (`pack`) of that many rows
  const bool packed_in = x.scalar_type() == at::kInt;
  int64_t m;
  if (packed_in) {
    TORCH_CHECK(rows > 0 && x.device().is_cpu() && x.is_contiguous() && x.dim() == 4 &&
                    x.size(0) == k / 32 && x.size(1) == (rows + 15) / 16 && x.size(2) == 16 &&
                    x.size(3) == 16,
                name, ": packed activations must be the int32 [in / 32, ceil(rows / 16), 16, 16] "
                "tensor a product with pack=True made, with their row count");
    m = rows;
  } else {
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.is_contiguous() &&
                    x.dim() >= 1,
                name, ": x must be a contiguous CPU bfloat16 tensor");
    TORCH_CHECK(x.size(-1) == k, name, ": input has ", x.size(-1), " features, weight ", k);
    TORCH_CHECK(k > 0 || !pack, name, ": pack needs inputs of at least one feature");
    if (x.numel() == 0) {
      if (pack) return at::empty({width / 32, 0, 16, 16}, x.options().dtype(at::kInt));
      return without_inputs(at::empty(out_shape(x, width), x.options()), bias, silu);
    }
    m = x.numel() / k;
  }
  const int64_t chunks = (m + 15) / 16;
  at::Tensor out;
  if (pack) {
    out = at::empty({width / 32, chunks, 16, 16}, x.options().dtype(at::kInt));
  } else if (packed_in) {
    out = at::empty({m, width}, x.options().dtype(at::kBFloat16));
  } else {
    out = at::empty(out_shape(x, width), x.options());
  }
  if (g_amx) g_amx_calls.fetch_add(1, std::memory_order_relaxed);
  Out o = out_of(out, width);
  o.bf16 = true;
  if (pack) o.packed_chunks = chunks;
  // Small activations are packed by every thread for itself, inside the product's parallel
  // region: each thread reads all of them anyway, and packing them once, shared, took a
  // parallel region of its own and left each thread's half to be fetched from the other
  // core (the next call's stores then invalidating it there again). SmolLM2's shapes at
  // 16-256 rows took 0.93 of the time this way; the 1B Llama's at 32-128 rows the same time,
  // at 256 rows (1 MB packed) 1.045, so larger ones are still packed once (one process,
  // alternating). 64-byte aligned: the packing stores whole vectors.
  const bool own = !packed_in && m * k * 2 < kOwnPackBytes;
  const auto* xd = static_cast<const uint16_t*>(x.data_ptr());
  const uint32_t* shared = nullptr;
  if (packed_in) {
    shared = reinterpret_cast<const uint32_t*>(x.data_ptr());
  } else if (!own) {
    thread_local std::vector<uint32_t> buf;
    auto* mine = aligned_pack_buffer(buf, m, k);
    // shared by the threads, by blocks of 32 values: done by the calling thread alone, it
    // left the others waiting (5% of a 256-token prompt's time on the calling thread,
    // SmolLM2 bf16); shared, the products took 0.95-0.97 of the time at 128-256 rows (one
    // process alternating)
    at::parallel_for(0, k / 32, std::max<int64_t>(1, kPackGrain / chunks),
                     [&](int64_t b0, int64_t b1) { avx512::pack_x_gemm(xd, m, k, mine, b0, b1); });
    shared = mine;
  }
  auto operand = [&]() -> const uint32_t* {
    if (!own) return shared;
    thread_local std::vector<uint32_t> buf;
    auto* mine = aligned_pack_buffer(buf, m, k);
    avx512::pack_x_gemm(xd, m, k, mine, 0, k / 32);
    return mine;
  };
  // blocks of 32 weight rows (16 gate rows and their up rows), a thread's share contiguous
  if (silu) {
    at::parallel_for(0, width / 16, 1, [&](int64_t b0, int64_t b1) {
      gemm(operand(), m, b0 * 16, b1 * 16, width, o);
    });
  } else {
    at::parallel_for(0, (n + 31) / 32, 1, [&](int64_t b0, int64_t b1) {
      gemm(operand(), m, b0 * 32, std::min(n, b1 * 32), 0, o);
    });
  }
  return out;
}

// 16 dense bfloat16 rows of k values at `dst`: where a RowSource writes a block
Out block_rows(uint16_t* dst, int64_t k) {
  Out o;
  o.ptr = dst;
  o.ldo = k;
  o.bf16 = true;
  return o;
}

// Without the tiles (the AVX-512 variant) an integer weight's prompt product dequantises its
// rows 16 at a time into cache as it walks them (avx512::gemm_dequant), in either layout: the
// rows in the lanes (lanes::dequant_q8 / dequant_q4, a group at a time) or row-major (the
// variant's dequant_q8 / dequant_q4).
struct Q8Rows {
  const void* w;
  const float* scale;
  const uint16_t* bscale;
  int64_t k;
  bool lanes;
  static void fill(const void* ctx, int64_t row, uint16_t* dst) {
    const auto& q = *static_cast<const Q8Rows*>(ctx);
    const Out o = block_rows(dst, q.k);
    // every pointer moved to the block's first row, so it is row 0 of `dst`
    const uint16_t* bs = q.bscale ? q.bscale + row * (q.k / 32) : nullptr;
    const float* s = q.scale ? q.scale + row : nullptr;
    if (q.lanes)  // the group's bytes, and its block scales [k / 32, 16], are contiguous
      lanes::dequant_q8(static_cast<const uint8_t*>(q.w) + row * q.k, s, bs, q.k, 0, 1, o);
    else
      K().dequant_q8(static_cast<const int8_t*>(q.w) + row * q.k, s, bs, q.k, 0, 16, o);
  }
};

struct Q4Rows {
  const uint8_t* codes;
  const uint16_t* gscale;
  const uint16_t* goffset;
  int64_t k;
  bool lanes;
  static void fill(const void* ctx, int64_t row, uint16_t* dst) {
    const auto& q = *static_cast<const Q4Rows*>(ctx);
    const Out o = block_rows(dst, q.k);
    // every pointer moved to the block's first row, so it is row 0 of `dst` (a group of 16
    // rows in the lanes: its codes and its scales [k / 32, 16] are contiguous too)
    const int64_t groups = q.k / 32;
    const uint8_t* c = q.codes + row * groups * 16;
    const uint16_t* gs = q.gscale + row * groups;
    const uint16_t* go = q.goffset + row * groups;
    if (q.lanes)
      lanes::dequant_q4(c, gs, go, q.k, 0, 1, o);
    else
      K().dequant_q4(c, gs, go, q.k, 0, 16, o);
  }
};

// int8 weights with one of `scale` (float32 [out]) or `bscale` (float16 [out, in / 32])
at::Tensor linear_q8_prompt(const at::Tensor& x, const at::Tensor& qweight,
                            const std::optional<at::Tensor>& scale,
                            const std::optional<at::Tensor>& bscale,
                            const std::optional<at::Tensor>& bias, bool silu, bool pack,
                            int64_t rows) {
  const IntWeight qw = q8_weight(qweight, "linear_q8_prompt");
  TORCH_CHECK(!(g_amx && qw.lanes), "linear_q8_prompt: the AMX tiles read a row-major weight");
  const int64_t n = qw.n, k = qw.k;
  TORCH_CHECK(scale.has_value() != bscale.has_value(),
              "linear_q8_prompt: one of scale and bscale");
  const float* s = nullptr;
  const uint16_t* bs = nullptr;
  if (scale.has_value()) {
    TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->numel() == n && scale->is_contiguous(),
                "linear_q8_prompt: scale must be float32 [out]");
    s = scale->data_ptr<float>();
  } else {
    TORCH_CHECK(k % 32 == 0 && bscale->scalar_type() == at::kHalf &&
                    bscale->numel() == n * (k / 32) && bscale->is_contiguous(),
                "linear_q8_prompt: block scales must be float16 [out, in / 32]");
    bs = static_cast<const uint16_t*>(bscale->data_ptr());
  }
  const void* w = qweight.data_ptr();
  const float* b = opt_bias(bias, n);
  const bool tiles = g_amx;
  const Q8Rows src{w, s, bs, k, qw.lanes};
  return prompt_on_tiles(
      "linear_q8_prompt", x, n, k, silu, bias, pack, rows,
      [&](const uint32_t* xp, int64_t m, int64_t n0, int64_t n1, int64_t pair, Out o) {
        if (tiles)
          amx::gemm_q8(xp, m, k, static_cast<const int8_t*>(w), s, bs, b, n0, n1, pair, o);
        else
          avx512::gemm_dequant(xp, m, k, avx512::RowSource{&Q8Rows::fill, &src}, b, n0, n1,
                               pair, o);
      },
      true);
}

// int4 codes ([out, in / 32, 16]: 16 bytes per group of 32, or [out / 16, in / 32, 4, 64] in
// the lanes) with float16 scale and offset per group
at::Tensor linear_q4_prompt(const at::Tensor& x, const at::Tensor& codes,
                            const at::Tensor& gscale, const at::Tensor& goffset,
                            const std::optional<at::Tensor>& bias, bool silu, bool pack,
                            int64_t rows) {
  const IntWeight qc = q4_codes(codes, "linear_q4_prompt");
  TORCH_CHECK(!(g_amx && qc.lanes), "linear_q4_prompt: the AMX tiles read row-major codes");
  const int64_t n = qc.n, k = qc.k;
  const int64_t groups = n * (k / 32);
  TORCH_CHECK(gscale.scalar_type() == at::kHalf && gscale.numel() == groups &&
                  gscale.is_contiguous() && goffset.scalar_type() == at::kHalf &&
                  goffset.numel() == groups && goffset.is_contiguous(),
              "linear_q4_prompt: scales and offsets must be float16 [out, in / 32]");
  const auto* c = codes.data_ptr<uint8_t>();
  const auto* gs = static_cast<const uint16_t*>(gscale.data_ptr());
  const auto* go = static_cast<const uint16_t*>(goffset.data_ptr());
  const float* b = opt_bias(bias, n);
  const bool tiles = g_amx;
  const Q4Rows src{c, gs, go, k, qc.lanes};
  return prompt_on_tiles(
      "linear_q4_prompt", x, n, k, silu, bias, pack, rows,
      [&](const uint32_t* xp, int64_t m, int64_t n0, int64_t n1, int64_t pair, Out o) {
        if (tiles)
          amx::gemm_q4(xp, m, k, c, gs, go, b, n0, n1, pair, o);
        else
          avx512::gemm_dequant(xp, m, k, avx512::RowSource{&Q4Rows::fill, &src}, b, n0, n1,
                               pair, o);
      },
      true);
}

// a bfloat16 weight [out, in] as it is
at::Tensor linear_bf16_prompt(const at::Tensor& x, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias, bool silu, bool pack,
                              int64_t rows) {
  const int64_t ldw = row_stride(weight, at::kBFloat16, "linear_bf16_prompt");
  const int64_t n = weight.size(0), k = weight.size(1);
  const auto* w = static_cast<const uint16_t*>(weight.data_ptr());
  const float* b = opt_bias(bias, n);
  const bool tiles = g_amx;
  return prompt_on_tiles(
      "linear_bf16_prompt", x, n, k, silu, bias, pack, rows,
      [&](const uint32_t* xp, int64_t m, int64_t n0, int64_t n1, int64_t pair, Out o) {
        if (tiles)
          amx::gemm_bf16(xp, m, k, w, ldw, b, n0, n1, pair, o);
        else
          avx512::gemm_bf16(xp, m, k, w, ldw, b, n0, n1, pair, o);
      },
      true);
}

// A quantized weight written dense into `out` [n, k] (float32 or bfloat16, contiguous): the
// prompt path of the integer layers, one pass instead of torch's convert, scale and add. With
// `bf16_values` a float32 `out` holds each value rounded to bfloat16: a bfloat16 model's dense
// weight widened, as the AVX2 variant's float32 prompt product reads it.
void dequantize_q8(const at::Tensor& qweight, const std::optional<at::Tensor>& scale,
                   const std::optional<at::Tensor>& bscale, at::Tensor& out, bool bf16_values) {
  const IntWeight qw = q8_weight(qweight, "dequantize_q8");
  const int64_t n = qw.n, k = qw.k;
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == n && out.size(1) == k &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "dequantize_q8: out must be a contiguous float32 or bfloat16 [out, in] tensor");
  const float* s = nullptr;
  const uint16_t* bs = nullptr;
  if (bscale.has_value()) {
    TORCH_CHECK(bscale->scalar_type() == at::kHalf && bscale->numel() == n * (k / 32) &&
                    bscale->is_contiguous(),
                "dequantize_q8: block scales must be float16 [out, in / 32]");
    bs = static_cast<const uint16_t*>(bscale->data_ptr());
  } else {
    TORCH_CHECK(scale.has_value() && scale->scalar_type() == at::kFloat && scale->numel() == n &&
                    scale->is_contiguous(),
                "dequantize_q8: scale must be float32 [out] where no block scales are given");
    s = scale->data_ptr<float>();
  }
  Out o = out_of(out, k);
  o.bf16_values = bf16_values;
  if (qw.lanes) {
    const uint8_t* w = qweight.data_ptr<uint8_t>();
    at::parallel_for(0, n / 16, 1, [&](int64_t g0, int64_t g1) {
      lanes::dequant_q8(w, s, bs, k, g0, g1, o);
    });
    return;
  }
  const int8_t* w = qweight.data_ptr<int8_t>();
  const auto fn = K().dequant_q8;
  at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) { fn(w, s, bs, k, n0, n1, o); });
}

void dequantize_q4(const at::Tensor& codes, const at::Tensor& gscale, const at::Tensor& goffset,
                   at::Tensor& out, bool bf16_values) {
  const IntWeight qc = q4_codes(codes, "dequantize_q4");
  const int64_t n = qc.n, groups = qc.k / 32, k = qc.k;
  for (const at::Tensor* t : {&gscale, &goffset})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->numel() == n * groups && t->is_contiguous(),
                "dequantize_q4: group scales and offsets must be float16 [out, in / 32]");
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == n && out.size(1) == k &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "dequantize_q4: out must be a contiguous float32 or bfloat16 [out, in] tensor");
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const auto* gs = static_cast<const uint16_t*>(gscale.data_ptr());
  const auto* go = static_cast<const uint16_t*>(goffset.data_ptr());
  Out o = out_of(out, k);
  o.bf16_values = bf16_values;
  if (qc.lanes) {
    at::parallel_for(0, n / 16, 1, [&](int64_t g0, int64_t g1) {
      lanes::dequant_q4(c, gs, go, k, g0, g1, o);
    });
    return;
  }
  const auto fn = K().dequant_q4;
  at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) { fn(c, gs, go, k, n0, n1, o); });
}

at::Tensor linear_q4(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& gscale,
                     const at::Tensor& goffset, const std::optional<at::Tensor>& bias) {
  check_act(x, "linear_q4");
  const IntWeight qc = q4_codes(codes, "linear_q4");
  const int64_t n = qc.n, groups = qc.k / 32, k = qc.k;
  TORCH_CHECK(x.size(-1) == k, "linear_q4: input has ", x.size(-1), " features, weight ", k);
  for (const at::Tensor* t : {&gscale, &goffset})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->numel() == n * groups && t->is_contiguous(),
                "linear_q4: group scales and offsets must be float16 [out, in / 32]");
  at::Tensor out = at::empty(out_shape(x, n), x.options());
  const float* b = opt_bias(bias, n);
  if (x.numel() == 0) return without_inputs(out, bias, false);
  const Q8Act a = quantize_act(x, k);
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const auto* gs = static_cast<const uint16_t*>(gscale.data_ptr());
  const auto* go = static_cast<const uint16_t*>(goffset.data_ptr());
  const Out o = out_of(out, n);
  if (qc.lanes) {
    at::parallel_for(0, n / 16, kGrain / 16, [&](int64_t g0, int64_t g1) {
      lanes::gemv_q4(a, c, gs, go, b, g0, g1, o);
    });
    return out;
  }
  if (amx_q4_applies(a.m)) {
    q4_amx(a, c, gs, go, b, n, o);
    return out;
  }
  const auto fn = K().gemv_q4;
  at::parallel_for(0, n, kGrain, [&](int64_t n0, int64_t n1) { fn(a, c, gs, go, b, n0, n1, o); });
  return out;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias) {
  check_act(x, "linear");
  const int64_t ldw = row_stride(weight, x.scalar_type(), "linear");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(x.size(-1) == k, "linear: input has ", x.size(-1), " features, weight ", k);
  at::Tensor out = at::empty(out_shape(x, n), x.options());
  const float* b = opt_bias(bias, n);
  if (x.numel() == 0) return without_inputs(out, bias, false);
  const int64_t m = x.numel() / k;
  const void* xp = x.data_ptr();
  const void* w = weight.data_ptr();
  const Out o = out_of(out, n);
  if (amx_applies(x, m, k)) {
    dense_bf16_amx(x, m, k, w, ldw, n, b, o);
    return out;
  }
  const auto fn = x.scalar_type() == at::kBFloat16 ? K().gemv_bf16 : K().gemv_f32;
  at::parallel_for(0, n, kGrain,
                   [&](int64_t n0, int64_t n1) { fn(xp, m, k, w, ldw, b, n0, n1, o); });
  return out;
}

// A bfloat16 weight [n, k] (rows contiguous, k % 64 == 0) in the compact form
// (compact_bf16.cpp): codes uint8 [n, 1.5 k] and tables uint8 [n, 16]
std::tuple<at::Tensor, at::Tensor> compact_bf16(const at::Tensor& weight) {
  const int64_t ldw = row_stride(weight, at::kBFloat16, "compact_bf16");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(k % 64 == 0 && k > 0, "compact_bf16: in_features must be a positive multiple of 64, got ", k);
  at::Tensor codes = at::empty({n, k + k / 2}, weight.options().dtype(at::kByte));
  at::Tensor tables = at::empty({n, 16}, weight.options().dtype(at::kByte));
  const auto* w = static_cast<const uint16_t*>(weight.data_ptr());
  uint8_t* c = codes.data_ptr<uint8_t>();
  uint8_t* t = tables.data_ptr<uint8_t>();
  at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) { compact::pack(w, ldw, k, r0, r1, c, t); });
  return {codes, tables};
}

void check_compact(const at::Tensor& codes, const at::Tensor& tables, int64_t n, int64_t k,
                   const char* op) {
  TORCH_CHECK(k % 64 == 0 && k > 0, op, ": in_features must be a positive multiple of 64, got ", k);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 2 &&
                  codes.size(0) == n && codes.size(1) == k + k / 2,
              op, ": codes must be a contiguous uint8 [", n, ", ", k + k / 2, "] tensor");
  TORCH_CHECK(tables.scalar_type() == at::kByte && tables.is_contiguous() && tables.dim() == 2 &&
                  tables.size(0) == n && tables.size(1) == 16,
              op, ": tables must be a contiguous uint8 [", n, ", 16] tensor");
}

// The compact form back to bfloat16 [n, k]; a row that does not fit comes back as zeros
// (its values are the dense weight's, which the compact form does not hold)
at::Tensor uncompact_bf16(const at::Tensor& codes, const at::Tensor& tables) {
  TORCH_CHECK(codes.dim() == 2 && codes.size(1) % 96 == 0, "uncompact_bf16: codes must be [n, 1.5 k], k % 64 == 0");
  const int64_t n = codes.size(0), k = codes.size(1) / 3 * 2;
  check_compact(codes, tables, n, k, "uncompact_bf16");
  at::Tensor out = at::empty({n, k}, codes.options().dtype(at::kBFloat16));
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const uint8_t* t = tables.data_ptr<uint8_t>();
  auto* o = static_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
    compact::unpack(c, t, k, r0, r1, o);
    for (int64_t r = r0; r < r1; ++r)
      if (!compact::fits(t, r)) std::fill(o + r * k, o + (r + 1) * k, uint16_t{0});
  });
  return out;
}

// Rows start .. start + out.size(0) of a weight kept only in the compact form (`--compact-
// decode-weights only`) written into `out` [rows, k] (bfloat16, or float32 for the AVX2
// variant's widened prompt product), the rows that do not fit read from `weight`: a prompt's
// product decodes its weight a block of rows at a time into a buffer it reuses.
void decompact_bf16(const at::Tensor& codes, const at::Tensor& tables, const at::Tensor& weight,
                    int64_t start, const at::Tensor& out) {
  const int64_t ldw = row_stride(weight, at::kBFloat16, "decompact_bf16");
  const int64_t n = weight.size(0), k = weight.size(1);
  check_compact(codes, tables, n, k, "decompact_bf16");
  TORCH_CHECK(cpu_has("avx2"), "decompact_bf16: needs a CPU with AVX2");
  TORCH_CHECK(out.device().is_cpu() && out.dim() == 2 && out.is_contiguous() && out.size(1) == k &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "decompact_bf16: out must be a contiguous float32 or bfloat16 [rows, ", k,
              "] tensor");
  TORCH_CHECK(start >= 0 && start + out.size(0) <= n, "decompact_bf16: rows ", start, " .. ",
              start + out.size(0), " are not within the weight's ", n);
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const uint8_t* t = tables.data_ptr<uint8_t>();
  const auto* w = static_cast<const uint16_t*>(weight.data_ptr());
  void* o = out.data_ptr();
  const bool f32 = out.scalar_type() == at::kFloat;
  const int64_t elem = f32 ? 4 : 2;
  at::parallel_for(start, start + out.size(0), 16, [&](int64_t r0, int64_t r1) {
    avx2::decompact(c, t, w, ldw, k, r0, r1, static_cast<char*>(o) + (r0 - start) * k * elem,
                    f32);
  });
}

// `linear` on bfloat16 rows from a weight's compact form (`weight` itself for the rows that do
// not fit): the selected variant's dense kernel's bits, from 0.75 of its bytes.
at::Tensor linear_compact(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& codes,
                          const at::Tensor& tables, const std::optional<at::Tensor>& bias) {
  check_act(x, "linear_compact");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "linear_compact: expected bfloat16 input, got ",
              x.scalar_type());
  const int64_t ldw = row_stride(weight, at::kBFloat16, "linear_compact");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(x.size(-1) == k, "linear_compact: input has ", x.size(-1), " features, weight ", k);
  check_compact(codes, tables, n, k, "linear_compact");
  at::Tensor out = at::empty(out_shape(x, n), x.options());
  const float* b = opt_bias(bias, n);
  if (x.numel() == 0) return without_inputs(out, bias, false);
  const int64_t m = x.numel() / k;
  const auto* xp = static_cast<const uint16_t*>(x.data_ptr());
  const auto* w = static_cast<const uint16_t*>(weight.data_ptr());
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const uint8_t* t = tables.data_ptr<uint8_t>();
  const Out o = out_of(out, n);
  at::parallel_for(0, n, kGrain, [&](int64_t n0, int64_t n1) {
    K().gemv_compact(xp, m, k, c, t, w, ldw, b, n0, n1, o);
  });
  return out;
}

// Several weights of one input width, their outputs side by side in one [rows, sum N] tensor:
// the q/k/v (or gate/up) projections of a model whose weights are not stacked, in one call.
at::Tensor linear_group(const at::Tensor& x, const std::vector<at::Tensor>& weights) {
  check_act(x, "linear_group");
  TORCH_CHECK(!weights.empty(), "linear_group: expected at least one weight");
  const int64_t k = x.size(-1);
  int64_t total = 0;
  std::vector<int64_t> ldw;
  for (const at::Tensor& w : weights) {
    ldw.push_back(row_stride(w, x.scalar_type(), "linear_group"));
    TORCH_CHECK(w.size(1) == k, "linear_group: each weight must be an [out, ", k,
                "] tensor, got one of ", w.size(1), " inputs");
    total += w.size(0);
  }
  at::Tensor out = at::empty(out_shape(x, total), x.options());
  if (x.numel() == 0) return without_inputs(out, std::nullopt, false);
  const int64_t m = x.numel() / k;
  const void* xp = x.data_ptr();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const auto fn = bf16 ? K().gemv_bf16 : K().gemv_f32;
  const int64_t esize = bf16 ? 2 : 4;
  // the output columns [start, start + rows) of each weight
  std::vector<int64_t> starts;
  for (const at::Tensor& w : weights) starts.push_back(starts.empty() ? 0 : starts.back());
  for (size_t i = 1; i < weights.size(); ++i) starts[i] = starts[i - 1] + weights[i - 1].size(0);
  if (amx_applies(x, m, k)) {
    for (size_t i = 0; i < weights.size(); ++i) {
      const Out o{static_cast<char*>(out.data_ptr()) + starts[i] * esize, total, bf16};
      dense_bf16_amx(x, m, k, weights[i].data_ptr(), ldw[i], weights[i].size(0), nullptr, o);
    }
    return out;
  }
  at::parallel_for(0, total, kGrain, [&](int64_t c0, int64_t c1) {
    for (size_t i = 0; i < weights.size(); ++i) {
      const int64_t lo = std::max(c0, starts[i]);
      const int64_t hi = std::min(c1, starts[i] + weights[i].size(0));
      if (lo >= hi) continue;
      const Out o{static_cast<char*>(out.data_ptr()) + starts[i] * esize, total, bf16};
      fn(xp, m, k, weights[i].data_ptr(), ldw[i], nullptr, lo - starts[i], hi - starts[i], o);
    }
  });
  return out;
}

void check_norm(const at::Tensor& x, const at::Tensor& w) {
  check_act(x, "rms_norm");
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.is_contiguous() && w.dim() == 1 &&
                  w.size(0) == x.size(-1),
              "rms_norm: weight must be [", x.size(-1), "] in the input's dtype");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_norm(x, w);
  at::Tensor out = at::empty_like(x);
  const int64_t dim = x.size(-1), rows = dim ? x.numel() / dim : 0;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const auto fn = K().rms_norm;
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    fn(x.data_ptr(), nullptr, nullptr, w.data_ptr(), out.data_ptr(), r0, r1, dim,
       static_cast<float>(eps), bf16);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta,
                                                const at::Tensor& w, double eps) {
  check_norm(x, w);
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.scalar_type() == x.scalar_type() &&
                  delta.is_contiguous(),
              "add_rms_norm: delta must match the input's shape and dtype");
  at::Tensor sum = at::empty_like(x);
  at::Tensor out = at::empty_like(x);
  const int64_t dim = x.size(-1), rows = dim ? x.numel() / dim : 0;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const auto fn = K().rms_norm;
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    fn(x.data_ptr(), delta.data_ptr(), sum.data_ptr(), w.data_ptr(), out.data_ptr(), r0, r1,
       dim, static_cast<float>(eps), bf16);
  });
  return {sum, out};
}

at::Tensor silu_mul(const at::Tensor& gu) {
  check_act(gu, "silu_mul");
  TORCH_CHECK(gu.size(-1) % 2 == 0, "silu_mul: the last dimension must be even");
  const int64_t inter = gu.size(-1) / 2;
  at::Tensor out = at::empty(out_shape(gu, inter), gu.options());
  const int64_t rows = inter ? gu.numel() / (2 * inter) : 0;
  const bool bf16 = gu.scalar_type() == at::kBFloat16;
  const auto fn = K().silu_mul;
  at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
    fn(gu.data_ptr(), out.data_ptr(), r0, r1, inter, bf16);
  });
  return out;
}

int64_t amx_calls() { return g_amx_calls.load(std::memory_order_relaxed); }

std::string set_isa(std::string want) {
  g_amx = false;  // a new variant starts without the tiles; set_amx turns them on
  return select_isa(want);
}

// AMX tiles for dense bfloat16 at a few rows: on where `want`, the AVX-512 variant is in use
// and the CPU and the kernel grant the tiles (asked once per process); returns whether on.
bool set_amx(bool want) {
  static const bool granted = amx::request_tiles();
  g_amx = want && granted && g_kernels == &avx512::kernels();
  return g_amx;
}

}  // namespace

const char* selected_isa() { return g_kernels ? g_kernels->name : nullptr; }
bool tiles_in_use() { return g_amx; }
}  // namespace sf

TORCH_LIBRARY(stallfree, m) {
  m.def("set_isa(str want) -> str");
  m.def("set_amx(bool want) -> bool");
  m.def("amx_calls() -> int");
  m.def("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("linear_group(Tensor x, Tensor[] weights) -> Tensor");
  m.def("compact_bf16(Tensor weight) -> (Tensor, Tensor)");
  m.def("uncompact_bf16(Tensor codes, Tensor tables) -> Tensor");
  m.def("decompact_bf16(Tensor codes, Tensor tables, Tensor weight, int start, Tensor(a!) out) -> ()");
  m.def("linear_compact(Tensor x, Tensor weight, Tensor codes, Tensor tables, Tensor? bias) -> Tensor");
  m.def("linear_q8(Tensor x, Tensor qweight, Tensor scale, Tensor? bias) -> Tensor");
  m.def("linear_q8_blocks(Tensor x, Tensor qweight, Tensor bscale, Tensor? bias) -> Tensor");
  m.def("linear_q4(Tensor x, Tensor codes, Tensor gscale, Tensor goffset, Tensor? bias) -> Tensor");
  m.def(
      "linear_q8_prompt(Tensor x, Tensor qweight, Tensor? scale, Tensor? bscale, Tensor? bias, "
      "bool silu=False, bool pack=False, int rows=0) -> Tensor");
  m.def(
      "linear_q4_prompt(Tensor x, Tensor codes, Tensor gscale, Tensor goffset, Tensor? bias, "
      "bool silu=False, bool pack=False, int rows=0) -> Tensor");
  m.def(
      "linear_bf16_prompt(Tensor x, Tensor weight, Tensor? bias, bool silu=False, "
      "bool pack=False, int rows=0) -> Tensor");
  m.def(
      "dequantize_q8(Tensor qweight, Tensor? scale, Tensor? bscale, Tensor(a!) out, "
      "bool bf16_values=False) -> ()");
  m.def(
      "dequantize_q4(Tensor codes, Tensor gscale, Tensor goffset, Tensor(a!) out, "
      "bool bf16_values=False) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.impl("set_isa", &sf::set_isa);
  m.impl("set_amx", &sf::set_amx);
  m.impl("amx_calls", &sf::amx_calls);
}

TORCH_LIBRARY_IMPL(stallfree, CPU, m) {
  m.impl("linear", &sf::linear);
  m.impl("linear_group", &sf::linear_group);
  m.impl("compact_bf16", &sf::compact_bf16);
  m.impl("uncompact_bf16", &sf::uncompact_bf16);
  m.impl("decompact_bf16", &sf::decompact_bf16);
  m.impl("linear_compact", &sf::linear_compact);
  m.impl("linear_q8", &sf::linear_q8);
  m.impl("linear_q8_blocks", &sf::linear_q8_blocks);
  m.impl("linear_q8_prompt", &sf::linear_q8_prompt);
  m.impl("linear_q4_prompt", &sf::linear_q4_prompt);
  m.impl("linear_bf16_prompt", &sf::linear_bf16_prompt);
  m.impl("linear_q4", &sf::linear_q4);
  m.impl("dequantize_q8", &sf::dequantize_q8);
  m.impl("dequantize_q4", &sf::dequantize_q4);
  m.impl("rms_norm", &sf::rms_norm);
  m.impl("add_rms_norm", &sf::add_rms_norm);
  m.impl("silu_mul", &sf::silu_mul);
}
