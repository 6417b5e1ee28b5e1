// bfloat16 matrix products at a few rows on AMX tiles (Sapphire Rapids and newer), for CPUs
// that report AMX-TILE and AMX-BF16 and whose kernel grants this process the tile state.
//
// `vdpbf16ps` issues half a vector per cycle here, so the AVX-512 kernel is compute-bound
// from about 4 rows; one `tdpbf16ps` multiplies a 16 x 32 weight tile into up to 16 rows at
// once, so the same pass stays bound by reading the weights up to 16 rows (more rows take
// chunks of 16, each block of weight rows re-read from L2). No software prefetch: 16 rows
// stream side by side, which the hardware prefetchers follow, and issuing one prefetch per row
// and tile measured slower.
//
// The product is computed transposed, C[n, m] = sum_k W[n, k] X[m, k]: the weight tile (the
// A operand: 16 rows of 32 values, 64 bytes each) loads straight from the row-major weight
// with its row stride, and the activations are the B operand, packed once per call in the
// pair-interleaved order the instruction reads (`pack_x`). Two accumulator tiles take the
// even and the odd blocks of 32 so consecutive multiplies do not wait on each other.

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cpuid.h>

#include <algorithm>
#include <cstring>

#include "kernels.h"

// GCC 11 and Clang 12 were the first to know the AMX intrinsics; an older compiler builds the
// rest of the library with the tiles reported missing (request_tiles below) rather than fail.
#if (defined(__clang__) && __clang_major__ >= 12) || \
    (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define SF_HAVE_AMX 1
#else
#define SF_HAVE_AMX 0
#endif

#if SF_HAVE_AMX
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,amx-tile,amx-bf16")

namespace sf {
namespace amx {
namespace {

// the tile configuration `ldtilecfg` reads: palette 1, then bytes per row and rows per tile
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles: 0, 1 the accumulators (even and odd blocks), 2, 3 the activations, 4, 5 the weights
void configure(int mc) {
  TileConfig cfg;
  for (int t = 0; t < 6; ++t) cfg.rows[t] = 16;
  for (int t = 0; t < 4; ++t) cfg.colsb[t] = static_cast<uint16_t>(4 * mc);
  cfg.colsb[4] = cfg.colsb[5] = 64;
  _tile_loadconfig(&cfg);
}



// One block of 16 weight rows against one chunk of `mc` activation rows.
// `rows` of the chunk's `mc` (packed) rows are written out
void block(const uint32_t* xp, int rows, int mc, int64_t k, const uint16_t* w, const float* bias,
           int64_t n, int64_t m0, Out out) {
  const int64_t stride = k * 2;  // bytes per weight row
  const int64_t bstride = 4 * mc;
  const int64_t blocks = k / 32;
  const char* wb = reinterpret_cast<const char*>(w + n * k);
  _tile_zero(0);
  _tile_zero(1);
  int64_t b = 0;
  for (; b + 2 <= blocks; b += 2) {
    _tile_loadd(4, wb + b * 64, stride);
    _tile_loadd(2, xp + b * 16 * mc, bstride);
    _tile_loadd(5, wb + (b + 1) * 64, stride);
    _tile_loadd(3, xp + (b + 1) * 16 * mc, bstride);
    _tile_dpbf16ps(0, 4, 2);
    _tile_dpbf16ps(1, 5, 3);
  }
  if (b < blocks) {
    _tile_loadd(4, wb + b * 64, stride);
    _tile_loadd(2, xp + b * 16 * mc, bstride);
    _tile_dpbf16ps(0, 4, 2);
  }
  alignas(64) float c0[16][16];
  alignas(64) float c1[16][16];
  _tile_stored(0, c0, 64);
  _tile_stored(1, c1, 64);
  for (int i = 0; i < rows; ++i) {
    float v[16];
    for (int r = 0; r < 16; ++r) v[r] = c0[r][i] + c1[r][i] + (bias ? bias[n + r] : 0.0f);
    const int64_t at = (m0 + i) * out.ldo + n;
    if (out.bf16) {
      uint16_t* o = static_cast<uint16_t*>(out.ptr) + at;
      for (int r = 0; r < 16; ++r) o[r] = f32_to_bf16(v[r]);
    } else {
      std::memcpy(static_cast<float*>(out.ptr) + at, v, sizeof v);
    }
  }
}

}  // namespace

bool request_tiles() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool tile = (d >> 24) & 1u, bf16 = (d >> 22) & 1u;
  if (!tile || !bf16) return false;
  // Linux hands out the tile data state per process, on request (ARCH_REQ_XCOMP_PERM)
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

int64_t chunk_rows(int64_t m) { return m <= 16 ? m : 16; }

int64_t packed_size(int64_t m, int64_t k) {
  const int64_t mc = chunk_rows(m);
  return (m + mc - 1) / mc * mc * (k / 2);
}

void pack_x(const uint16_t* x, int64_t m, int64_t k, uint32_t* xp) {
  const int64_t mc = chunk_rows(m);
  for (int64_t m0 = 0; m0 < m; m0 += mc) {
    uint32_t* dst = xp + m0 * (k / 2);
    for (int64_t p = 0; p < k / 2; ++p)
      for (int64_t i = 0; i < mc; ++i) {
        uint32_t pair = 0;  // rows past m (a last chunk of fewer than 16) multiply as zeros
        if (m0 + i < m) std::memcpy(&pair, x + (m0 + i) * k + 2 * p, 4);
        dst[p * mc + i] = pair;
      }
  }
}

void gemv_bf16(const uint32_t* xp, int64_t m, int64_t k, const uint16_t* w, const float* bias,
               int64_t n0, int64_t n1, Out out) {
  const int mc = static_cast<int>(chunk_rows(m));
  configure(mc);
  for (int64_t n = n0; n + 16 <= n1; n += 16)
    for (int64_t m0 = 0; m0 < m; m0 += mc)
      block(xp + m0 * (k / 2), static_cast<int>(std::min<int64_t>(mc, m - m0)), mc, k, w, bias,
            n, m0, out);
  _tile_release();
}

}  // namespace amx
}  // namespace sf

#pragma GCC pop_options

#else  // no AMX intrinsics in this compiler: the tiles are never granted

namespace sf {
namespace amx {
bool request_tiles() { return false; }
int64_t packed_size(int64_t, int64_t) { return 0; }
void pack_x(const uint16_t*, int64_t, int64_t, uint32_t*) {}
void gemv_bf16(const uint32_t*, int64_t, int64_t, const uint16_t*, const float*, int64_t,
               int64_t, Out) {}
}  // namespace amx
}  // namespace sf

#endif  // SF_HAVE_AMX
