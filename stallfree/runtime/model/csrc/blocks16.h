// 16 x 16 blocks of a transposed product's outputs (r[w] lane i: output feature n + w,
// activation row m0 + i), as the AMX tiles (amx_gemm.cpp, isa_amx.cpp) and the AVX-512 prompt
// product (bf16_gemm.cpp) both leave them: transposed in registers and stored as rows, or
// written as the next prompt product's packed activations, with a bias or a gate/up pair's
// silu(gate) * up applied first. Included by each unit after its target pragma (AVX-512 F, BW,
// VL, DQ and BF16 at least) and inside its own namespace, after kernels.h and vec_exp.h;
// includes nothing itself.

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
inline void write_block(__m512 (&r)[16], int rows, const float* bias, int64_t n, int64_t m0, Out out) {
  transpose16(r);
  const __m512 bv = bias ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();
  for (int i = 0; i < rows; ++i) store_row(out, (m0 + i) * out.ldo + n, _mm512_add_ps(r[i], bv));
}

// Outputs r[w] lane i (output feature n + w, activation row m0 + i; n a multiple of 16) as
// the next prompt product's packed activations (`out.packed_chunks`): rounded to bfloat16,
// features 2p and 2p + 1 in one 32-bit value, 16 rows to a vector, which is pack_x_gemm's
// order as it is, so no transpose; rows past the prompt's are zero there, as pack_x_gemm
// leaves them.
inline void write_packed(const __m512 (&r)[16], int rows, int64_t n, int64_t m0, Out out) {
  const __mmask16 live = rows >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << rows) - 1);
  auto* dst = static_cast<uint32_t*>(out.ptr) + (n / 32 * out.packed_chunks + m0 / 16) * 256 +
              (n % 32) / 2 * 16;
#pragma GCC unroll 8
  for (int w = 0; w < 16; w += 2) {
    const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(r[w]));
    const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(r[w + 1]));
    const __m512i v = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
    _mm512_store_si512(dst + w / 2 * 16, _mm512_maskz_mov_epi32(live, v));
  }
}

// A finished accumulator c[r][i] (weight row n + r, activation row m0 + i) into the output's
// rows m0 .. m0 + rows - 1, columns n .. n + 15, the bias added, in the output's dtype
inline void write_tile(const float* c, int rows, const float* bias, int64_t n, int64_t m0, Out out) {
  __m512 r[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_ps(c + 16 * i);
  if (out.packed_chunks) {
#pragma GCC unroll 16
    for (int w = 0; w < 16; ++w)
      if (bias) r[w] = _mm512_add_ps(r[w], _mm512_set1_ps(bias[n + w]));
    write_packed(r, rows, n, m0, out);
    return;
  }
  write_block(r, rows, bias, n, m0, out);
}

// A gate/up pair's finished accumulators (g and u: c[r][i] for weight row n + r, activation
// row m0 + i) as silu(gate) * up into the output's rows m0 .. m0 + rows - 1, columns n .. n +
// 15, each bias added first. A bfloat16 output takes the unfused path's roundings exactly
// (silu_mul on a bfloat16 gate_up): gate and up rounded, silu(gate) rounded, the product
// rounded. The arithmetic is elementwise, so it runs before the transpose (a weight row's
// bias is a broadcast there) and only the product is transposed: one transpose where gate
// and up took one each. A 256-row SmolLM2 gate/up product took 0.93 of the time, a 1B
// Llama's 0.97 (one process, alternating).
inline void write_silu(const float* g, const float* u, int rows, const float* bias, int64_t n,
                int64_t pair, int64_t m0, Out out) {
  __m512 r[16];
  const __m512 one = _mm512_set1_ps(1.f);
  const auto round = [](__m512 v) { return widen_bf16((__m256i)_mm512_cvtneps_pbh(v)); };
#pragma GCC unroll 16
  for (int w = 0; w < 16; ++w) {
    __m512 gv = _mm512_load_ps(g + 16 * w), uv = _mm512_load_ps(u + 16 * w);
    if (bias) {
      gv = _mm512_add_ps(gv, _mm512_set1_ps(bias[n + w]));
      uv = _mm512_add_ps(uv, _mm512_set1_ps(bias[pair + n + w]));
    }
    if (out.bf16) {
      gv = round(gv);
      uv = round(uv);
    }
    __m512 sv = _mm512_div_ps(gv, _mm512_add_ps(one, exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
    if (out.bf16) sv = round(sv);
    r[w] = _mm512_mul_ps(sv, uv);
  }
  if (out.packed_chunks) {
    write_packed(r, rows, n, m0, out);
    return;
  }
  transpose16(r);
  for (int i = 0; i < rows; ++i) store_row(out, (m0 + i) * out.ldo + n, r[i]);
}
