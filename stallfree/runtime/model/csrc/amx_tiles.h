// What the AMX translation units share (isa_amx.cpp, amx_gemm.cpp, amx_prefill_attention.cpp):
// the tile configuration, tile memory operations kept in program order, bfloat16 widened and
// stored, and writing a finished 16 x 16 block of outputs. Included by each unit after its
// target pragma and inside its own namespace, so it is compiled for that unit's instruction
// set; includes nothing itself.

// the tile configuration `ldtilecfg` reads: palette 1, then bytes per row and rows per tile
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// GCC 12's tile-load intrinsics do not tell the compiler all they read: `_tile_loadd` names no
// memory at all and `_tile_loadconfig` only the configuration's first 8 bytes. The compiler
// may then move the stores that fill what a tile loads past the load, or drop them as dead
// (an int4 block unpacked into a buffer the tiles read came out wrong once the code around it
// was rearranged; a configuration filled in a loop lost its row and width stores). A
// compiler barrier on each side of every load keeps them in program order; it emits nothing.
// A tile store is fenced the same way, so the code that reads what it stored stays after it.
#define SF_TILE_MEMORY(op)          \
  do {                              \
    asm volatile("" ::: "memory");  \
    op;                             \
    asm volatile("" ::: "memory");  \
  } while (0)
#define SF_TILE_LOADD(tile, base, stride) SF_TILE_MEMORY(_tile_loadd(tile, base, stride))
#define SF_TILE_STORED(tile, base, stride) SF_TILE_MEMORY(_tile_stored(tile, base, stride))

inline void load_config(const TileConfig& cfg) {
  asm volatile("" ::: "memory");
  _tile_loadconfig(&cfg);
}

// r[i] <- column i of the 16 x 16 matrix whose rows are r[0..15]
inline void transpose16(__m512 (&r)[16]) {
  __m512 t[16];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  // in each 128-bit lane L, u[4 i + j] holds column 4 L + j of rows 4 i .. 4 i + 3
  __m512 u[16];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    u[4 * i + 0] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    const __m512 a = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x88);
    const __m512 b = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xDD);
    const __m512 c = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x88);
    const __m512 d = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xDD);
    r[j] = _mm512_shuffle_f32x4(a, c, 0x88);
    r[8 + j] = _mm512_shuffle_f32x4(a, c, 0xDD);
    r[4 + j] = _mm512_shuffle_f32x4(b, d, 0x88);
    r[12 + j] = _mm512_shuffle_f32x4(b, d, 0xDD);
  }
}

// 16 bfloat16 values widened to float32 (exactly)
inline __m512 widen_bf16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// 16 outputs at element `at` of the output, in its dtype (bfloat16: round to nearest even)
inline void store_row(Out out, int64_t at, __m512 v) {
  if (out.bf16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out.ptr) + at),
                        (__m256i)_mm512_cvtneps_pbh(v));
  else
    _mm512_storeu_ps(static_cast<float*>(out.ptr) + at, v);
}

// A block's outputs, r[w] lane i for weight row n + w and activation row m0 + i: the first
// `rows` activation rows, plus the bias, written in the output's dtype (transposed in
// registers, one vector store per activation row)
void write_block(__m512 (&r)[16], int rows, const float* bias, int64_t n, int64_t m0, Out out) {
  transpose16(r);
  const __m512 bv = bias ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();
  for (int i = 0; i < rows; ++i) store_row(out, (m0 + i) * out.ldo + n, _mm512_add_ps(r[i], bv));
}

