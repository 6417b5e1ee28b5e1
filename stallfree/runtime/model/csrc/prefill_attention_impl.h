// The prompt-attention kernel over a vector type `V` (V::W float lanes): included by each
// variant's translation unit after its decode kernel (attention_impl.h), inside the same
// namespace, so it shares that file's vector struct, and after its `kScorePairs` and
// `prompt_scores_pairs`. Includes nothing itself.
//
// One request's n queries at positions prefix .. prefix + n - 1 attend causally over its keys
// (optionally the last `window` of them), in two phases:
//   1. each KV head's keys are transposed once into float32 [D][keys] (padded with zeros to a
//      whole block), so a block of keys is KB contiguous lanes per head dimension;
//   2. work items (KV head, block of kRows query rows) take the head's whole query group at
//      once (kRows * G query vectors), so every key and value vector loaded serves all of
//      them; key blocks stop at the item's last query position, the diagonal block masked.
// The scores are plain multiply-adds of broadcast query elements with the transposed keys (no
// horizontal sums), the softmax is online per query vector, and the values are read where
// they lie (bfloat16 widened in registers). Where the variant has bfloat16 dot products
// (`kScorePairs`: AVX-512 BF16) a bfloat16 prompt's keys are transposed as value pairs
// instead (dims 2e and 2e + 1 of a key in one 32-bit lane: [D / 2][keys]), its queries kept
// as bfloat16 pairs, and each step of `vdpbf16ps` adds two dims' exact products in float32:
// half the steps of the widened path, the scale applied to the sums (not folded into the
// query, which would round it to bfloat16).

constexpr int64_t kKeys = kPromptKeys;
constexpr int64_t kRows = kPromptRows;
// query vectors per register tile: the scores of a key block take kKeys / W accumulators per
// query, the values a chunk of 4 vectors of the head dimension per query
constexpr int kQTile = V::W == 16 ? 6 : 2;

// f(std::integral_constant<int, count>) for a count in [1, N]: the tiles' query counts are
// template constants, so their accumulators stay in registers
template <int N, typename F>
void with_count(int64_t count, F&& f) {
  if constexpr (N > 1) {
    if (count < N) return with_count<N - 1>(count, f);
  }
  f(std::integral_constant<int, N>{});
}

// scores[i, 0 .. kKeys) = q_i . k_(tb + j) for the kQTile (or fewer) query vectors of qs
template <int NQ>
void prompt_scores(const float* qs, int64_t D, const float* kt, int64_t kt_stride, float* s) {
  constexpr int NV = kKeys / V::W;
  typename V::T acc[NQ][NV];
  for (int i = 0; i < NQ; ++i)
    for (int c = 0; c < NV; ++c) acc[i][c] = V::zero();
  for (int64_t d = 0; d < D; ++d) {
    typename V::T k[NV];
    for (int c = 0; c < NV; ++c) k[c] = V::load(kt + d * kt_stride + c * V::W);
    for (int i = 0; i < NQ; ++i) {
      const typename V::T q = V::set1(qs[i * D + d]);
      for (int c = 0; c < NV; ++c) acc[i][c] = V::fma(q, k[c], acc[i][c]);
    }
  }
  for (int i = 0; i < NQ; ++i)
    for (int c = 0; c < NV; ++c) V::store(s + i * kKeys + c * V::W, acc[i][c]);
}

// acc_i[c0 .. c0 + NC * W) += sum_j p[i, j] * v_j[c0 ..] for NQ query vectors; v_j = vp +
// j * v_stride, `T` float or bfloat16. NQ and NC are constants, so the accumulators stay in
// registers.
template <int NQ, int NC, typename T>
void prompt_values_chunk(const float* p, int64_t nb, const T* vp, int64_t v_stride, int64_t D,
                         int64_t c0, float* acc) {
  typename V::T a[NQ][NC];
  for (int i = 0; i < NQ; ++i)
    for (int c = 0; c < NC; ++c) a[i][c] = V::load(acc + i * D + c0 + c * V::W);
  for (int64_t j = 0; j < nb; ++j) {
    typename V::T v[NC];
    const T* row = vp + j * v_stride + c0;
    for (int c = 0; c < NC; ++c) {
      if constexpr (std::is_same_v<T, float>) {
        v[c] = V::load(row + c * V::W);
      } else {
        v[c] = V::load_bf16(row + c * V::W);
      }
    }
    for (int i = 0; i < NQ; ++i) {
      const typename V::T pj = V::set1(p[i * kKeys + j]);
      for (int c = 0; c < NC; ++c) a[i][c] = V::fma(pj, v[c], a[i][c]);
    }
  }
  for (int i = 0; i < NQ; ++i)
    for (int c = 0; c < NC; ++c) V::store(acc + i * D + c0 + c * V::W, a[i][c]);
}

// the head dimension in chunks of up to 4 vectors
template <int NQ, typename T>
void prompt_values(const float* p, int64_t nb, const T* vp, int64_t v_stride, int64_t D,
                   float* acc) {
  for (int64_t c0 = 0; c0 < D; c0 += 4 * V::W) {
    switch (std::min<int64_t>(4, (D - c0) / V::W)) {
      case 1: prompt_values_chunk<NQ, 1>(p, nb, vp, v_stride, D, c0, acc); break;
      case 2: prompt_values_chunk<NQ, 2>(p, nb, vp, v_stride, D, c0, acc); break;
      case 3: prompt_values_chunk<NQ, 3>(p, nb, vp, v_stride, D, c0, acc); break;
      default: prompt_values_chunk<NQ, 4>(p, nb, vp, v_stride, D, c0, acc); break;
    }
  }
}

// whether a prompt's scores take the pairs path (both phases ask)
inline bool score_pairs(const PrefillAttn& a) { return kScorePairs && a.bf16 && a.dim % 2 == 0; }

template <typename T>
void prompt_item(const PrefillAttn& a, int64_t item, float* qs, float* acc, float* s, float* m,
                 float* l) {
  // l: each query vector's running sum of probabilities, kept in V::W lanes (summed at the end)
  const int64_t D = a.dim, H = a.heads, KVH = a.kv_heads, G = H / KVH;
  const int64_t blocks = (a.n + kRows - 1) / kRows;
  const int64_t kvh = item / blocks;
  const int64_t r0 = (item % blocks) * kRows;
  const int64_t nr = std::min(kRows, a.n - r0);
  const int64_t nq = nr * G;  // query vectors: row-major over (row, head of the group)
  const T* q = static_cast<const T*>(a.q);
  const bool pairs = std::is_same_v<T, uint16_t> && score_pairs(a);
  uint32_t* qp = reinterpret_cast<uint32_t*>(qs);  // the pairs path's queries: D / 2 pairs each
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t g = 0; g < G; ++g) {
      const T* src = q + (r0 + r) * a.q_stride + (kvh * G + g) * D;
      if (pairs) {
        std::memcpy(qp + (r * G + g) * (D / 2), src, D * sizeof(T));
        continue;
      }
      float* dst = qs + (r * G + g) * D;
      for (int64_t c = 0; c < D; ++c) {
        if constexpr (std::is_same_v<T, float>) {
          dst[c] = src[c] * a.scale;
        } else {
          dst[c] = bf16_to_f32(src[c]) * a.scale;
        }
      }
    }
  for (int64_t i = 0; i < nq; ++i) {
    m[i] = -INFINITY;
    V::store(l + i * V::W, V::zero());
  }
  for (int64_t i = 0; i < nq * D; i += V::W) V::store(acc + i, V::zero());

  // key indices (into the keys tensor, whose first row is position a.first): query row r at
  // position p = prefix + r sees [lo(p), p - first], lo(p) = max(0, p - window + 1 - first)
  const int64_t p_first = a.prefix + r0, p_last = a.prefix + r0 + nr - 1;
  auto lowest = [&](int64_t p) {
    return a.window > 0 ? std::max<int64_t>(0, p - a.window + 1 - a.first) : 0;
  };
  const int64_t j_end = p_last - a.first + 1;
  const float* kt = a.kt + kvh * D * a.kt_stride;
  const T* v = static_cast<const T*>(a.v) + kvh * D;
  for (int64_t tb = lowest(p_first) / kKeys * kKeys; tb < j_end; tb += kKeys) {
    const int64_t nb = std::min(kKeys, j_end - tb);
    for (int64_t i = 0; i < nq; i += kQTile) {
      float* si = s + i * kKeys;
      if (pairs) {
        const uint32_t* kp = reinterpret_cast<const uint32_t*>(kt) + tb;
        with_count<kQTile>(nq - i, [&](auto tile) {
          if constexpr (kScorePairs)
            prompt_scores_pairs<decltype(tile)::value>(qp + i * (D / 2), D / 2, kp, a.kt_stride,
                                                       a.scale, si);
        });
        continue;
      }
      const float* qi = qs + i * D;
      with_count<kQTile>(nq - i, [&](auto tile) {
        prompt_scores<decltype(tile)::value>(qi, D, kt + tb, a.kt_stride, si);
      });
    }
    // each query vector's visible keys in the block are one run of lanes [from, to): the
    // block's padding, keys past the query's position and keys before its window are masked;
    // the scores become probabilities against the query's running max (online softmax)
    constexpr int NV = kKeys / V::W;
    for (int64_t r = 0; r < nr; ++r) {
      const int64_t p = a.prefix + r0 + r;
      const int64_t from = std::max<int64_t>(lowest(p) - tb, 0);
      const int64_t to = std::min<int64_t>(p - a.first + 1 - tb, nb);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t i = r * G + g;
        float* si = s + i * kKeys;
        if (to <= from) {  // nothing visible to this query in the block
          for (int64_t j = 0; j < kKeys; ++j) si[j] = 0;
          continue;
        }
        if (a.softcap > 0)
          for (int64_t j = from; j < to; ++j) si[j] = std::tanh(si[j] / a.softcap) * a.softcap;
        typename V::T x[NV];
        typename V::T bmv = V::set1(-INFINITY);
        for (int c = 0; c < NV; ++c) {
          x[c] = V::load(si + c * V::W);
          if (from > 0 || to < kKeys) x[c] = V::lanes_or_minus_inf(x[c], from - c * V::W, to - c * V::W);
          bmv = V::max(bmv, x[c]);
        }
        const float mnew = std::max(m[i], V::reduce_max(bmv));
        typename V::T sum = V::load(l + i * V::W);
        if (mnew > m[i] && m[i] > -INFINITY) {
          const typename V::T av = V::set1(std::exp(m[i] - mnew));
          float* ai = acc + i * D;
          for (int64_t c = 0; c < D; c += V::W) V::store(ai + c, V::mul(V::load(ai + c), av));
          sum = V::mul(sum, av);
        }
        m[i] = mnew;
        const typename V::T mv = V::set1(mnew);
        for (int c = 0; c < NV; ++c) {
          // a masked score (-inf) gives 0 by definition; the vector exp is not relied on for it
          const typename V::T pc = V::keep_finite(x[c], V::exp(V::sub(x[c], mv)));
          V::store(si + c * V::W, pc);
          sum = V::add(sum, pc);
        }
        V::store(l + i * V::W, sum);
      }
    }
    const T* vb = v + tb * a.v_stride;
    for (int64_t i = 0; i < nq; i += kQTile) {
      const float* pi = s + i * kKeys;
      float* ai = acc + i * D;
      with_count<kQTile>(nq - i, [&](auto tile) {
        prompt_values<decltype(tile)::value>(pi, nb, vb, a.v_stride, D, ai);
      });
    }
  }

  for (int64_t r = 0; r < nr; ++r)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t i = r * G + g;
      const float li = V::sum(V::load(l + i * V::W));
      const typename V::T inv = V::set1(li > 0 ? 1.0f / li : 0.0f);
      const int64_t o = ((r0 + r) * H + kvh * G + g) * D;
      for (int64_t c = 0; c < D; c += V::W) {
        const typename V::T y = V::mul(V::load(acc + i * D + c), inv);
        if constexpr (std::is_same_v<T, float>) {
          V::store(static_cast<float*>(a.out) + o + c, y);
        } else {
          V::store_bf16(static_cast<uint16_t*>(a.out) + o + c, y);
        }
      }
    }
}

// phase 1: rows [t0, t1) of every KV head's keys, transposed into float32: 16 keys at a time
// are read row by row (contiguous) into a small float32 tile, whose columns are then written
// as contiguous runs of the transposed rows
template <typename T>
void transpose_keys(const PrefillAttn& a, int64_t t0, int64_t t1) {
  constexpr int64_t kTile = 16;
  const int64_t D = a.dim;
  const T* k = static_cast<const T*>(a.k);
  if (std::is_same_v<T, uint16_t> && score_pairs(a)) {
    // value pairs: row e of a head's [D / 2][kt_stride] holds dims 2e and 2e + 1 of each key
    // (the head's first half of its float32 rows; the buffer is zeroed, so the padding is)
    uint32_t tile[kTile * 128];
    for (int64_t h = 0; h < a.kv_heads; ++h)
      for (int64_t tb = t0; tb < t1; tb += kTile) {
        const int64_t nt = std::min(kTile, t1 - tb);
        for (int64_t i = 0; i < nt; ++i) {
          const T* src = k + (tb + i) * a.k_stride + h * D;
          for (int64_t e = 0; e < D / 2; ++e) {
            uint32_t v;
            std::memcpy(&v, src + 2 * e, sizeof v);
            tile[e * kTile + i] = v;
          }
        }
        uint32_t* dst = reinterpret_cast<uint32_t*>(a.kt + h * D * a.kt_stride) + tb;
        for (int64_t e = 0; e < D / 2; ++e)
          for (int64_t i = 0; i < nt; ++i) dst[e * a.kt_stride + i] = tile[e * kTile + i];
      }
    return;
  }
  float tile[kTile * 256];  // D <= 256 (checked by the binding)
  for (int64_t h = 0; h < a.kv_heads; ++h)
    for (int64_t tb = t0; tb < t1; tb += kTile) {
      const int64_t nt = std::min(kTile, t1 - tb);
      for (int64_t i = 0; i < nt; ++i) {
        const T* src = k + (tb + i) * a.k_stride + h * D;
        for (int64_t d = 0; d < D; ++d) {
          if constexpr (std::is_same_v<T, float>) {
            tile[d * kTile + i] = src[d];
          } else {
            tile[d * kTile + i] = bf16_to_f32(src[d]);
          }
        }
      }
      float* dst = a.kt + h * D * a.kt_stride + tb;
      for (int64_t d = 0; d < D; ++d)
        for (int64_t i = 0; i < nt; ++i) dst[d * a.kt_stride + i] = tile[d * kTile + i];
    }
}

// phase 2: items [i0, i1) of kv_heads * ceil(n / kRows)
template <typename T>
void prompt_items(const PrefillAttn& a, int64_t i0, int64_t i1, int64_t step) {
  const int64_t G = a.heads / a.kv_heads, nq = kRows * G;
  thread_local std::vector<float> qs, acc, s, m, l;
  float* qp = scratch(qs, nq * a.dim);
  float* ap = scratch(acc, nq * a.dim);
  float* sp = scratch(s, nq * kKeys);
  float* mp = scratch(m, nq);
  float* lp = scratch(l, nq * V::W);
  for (int64_t i = i0; i < i1; i += step) prompt_item<T>(a, i, qp, ap, sp, mp, lp);
}

void prefill_transpose_impl(const PrefillAttn& a, int64_t t0, int64_t t1) {
  if (a.bf16) return transpose_keys<uint16_t>(a, t0, t1);
  return transpose_keys<float>(a, t0, t1);
}

void prefill_attention_impl(const PrefillAttn& a, int64_t i0, int64_t i1, int64_t step) {
  if (a.bf16) return prompt_items<uint16_t>(a, i0, i1, step);
  return prompt_items<float>(a, i0, i1, step);
}
