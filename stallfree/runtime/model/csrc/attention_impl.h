// The decode-attention kernel over a vector type `V` (V::W float lanes): included by each
// variant's translation unit, after its target pragma and inside its own namespace, so every
// instantiation is compiled for that variant alone. Includes nothing itself.
//
// Per work item (request, split): blocks of kBlock keys; for each key its slot is read from
// req_to_token, and for each KV head in turn its K row is dotted with the head's group of
// queries, the scores are soft-capped, an online softmax rescales the group's float32
// accumulators, and its V row is added into all of them. Head dims are multiples of 16 (a
// whole number of vectors in both variants).

constexpr int64_t kBlock = 32;

// One stored row format each: `E` its element, `load` V::W elements as float32, `scaled`
// whether the row's float32 scale follows its `dim` codes (the scores and probabilities of
// its keys are multiplied by it, rather than each element).
struct RowsF32 {
  using E = float;
  static constexpr bool scaled = false;
  static V::T load(const E* p) { return V::load(p); }
};
struct RowsBF16 {
  using E = uint16_t;
  static constexpr bool scaled = false;
  static V::T load(const E* p) { return V::load_bf16(p); }
};
struct RowsI8 {
  using E = int8_t;
  static constexpr bool scaled = true;
  static V::T load(const E* p) { return V::load_i8(p); }
};
struct RowsE4M3 {
  using E = uint8_t;
  static constexpr bool scaled = true;
  static V::T load(const E* p) { return V::load_e4m3(p); }
};
struct RowsE5M2 {
  using E = uint8_t;
  static constexpr bool scaled = true;
  static V::T load(const E* p) { return V::load_e5m2(p); }
};

// the float32 scale stored after a row's `dim` codes (not 4-byte aligned in general)
template <typename E>
float row_scale(const E* row, int64_t dim) {
  float s;
  std::memcpy(&s, row + dim, sizeof s);
  return s;
}

// heads per register tile: each K or V vector loaded once serves this many query heads
constexpr int64_t kHeadTile = 4;

template <int NG, typename R>
void score_tile(const float* q, int64_t D, const typename R::E* kc, const int64_t* slots,
                int64_t nb, float* scores) {
  for (int64_t j = 0; j < nb; ++j) {
    const typename R::E* kp = kc + slots[j];
    typename V::T s[NG];
    for (int i = 0; i < NG; ++i) s[i] = V::zero();
    for (int64_t c = 0; c < D; c += V::W) {
      const typename V::T k = R::load(kp + c);
      for (int i = 0; i < NG; ++i) s[i] = V::fma(V::load(q + i * D + c), k, s[i]);
    }
    float r[4];
    const typename V::T z = V::zero();
    V::sum4(s[0], NG > 1 ? s[1 % NG] : z, NG > 2 ? s[2 % NG] : z, NG > 3 ? s[3 % NG] : z, r);
    for (int i = 0; i < NG; ++i) scores[i * kBlock + j] = r[i];
  }
}

// scores[g, j] = q_g . k_j for the heads g0 .. g0 + kHeadTile - 1 (those below G)
template <typename R>
void score_heads(const float* q, int64_t G, int64_t D, const typename R::E* kc,
                 const int64_t* slots, int64_t nb, int64_t g0, float* scores) {
  q += g0 * D;
  scores += g0 * kBlock;
  switch (std::min(kHeadTile, G - g0)) {
    case 1: return score_tile<1, R>(q, D, kc, slots, nb, scores);
    case 2: return score_tile<2, R>(q, D, kc, slots, nb, scores);
    case 3: return score_tile<3, R>(q, D, kc, slots, nb, scores);
    default: return score_tile<4, R>(q, D, kc, slots, nb, scores);
  }
}

template <int NG, typename R>
void value_tile(int64_t D, const typename R::E* vc, const int64_t* slots, int64_t nb,
                const float* p, float* acc) {
  for (int64_t c = 0; c < D; c += V::W) {
    typename V::T a[NG];
    for (int i = 0; i < NG; ++i) a[i] = V::load(acc + i * D + c);
    for (int64_t j = 0; j < nb; ++j) {
      const typename V::T v = R::load(vc + slots[j] + c);
      for (int i = 0; i < NG; ++i) a[i] = V::fma(V::set1(p[i * kBlock + j]), v, a[i]);
    }
    for (int i = 0; i < NG; ++i) V::store(acc + i * D + c, a[i]);
  }
}

// acc[g] += p[g, j] * v_j for the heads g0 .. g0 + kHeadTile - 1 (those below G)
template <typename R>
void add_values(int64_t G, int64_t D, const typename R::E* vc, const int64_t* slots, int64_t nb,
                int64_t g0, const float* p, float* acc) {
  p += g0 * kBlock;
  acc += g0 * D;
  switch (std::min(kHeadTile, G - g0)) {
    case 1: return value_tile<1, R>(D, vc, slots, nb, p, acc);
    case 2: return value_tile<2, R>(D, vc, slots, nb, p, acc);
    case 3: return value_tile<3, R>(D, vc, slots, nb, p, acc);
    default: return value_tile<4, R>(D, vc, slots, nb, p, acc);
  }
}

// scores[g, j] *= the scale of key j's row, for every head g of the group (scaled rows only)
template <typename R>
void scale_by_rows(int64_t G, int64_t D, const typename R::E* c, const int64_t* slots,
                   int64_t nb, float* scores) {
  for (int64_t j = 0; j < nb; ++j) {
    const float s = row_scale(c + slots[j], D);
    for (int64_t g = 0; g < G; ++g) scores[g * kBlock + j] *= s;
  }
}

template <typename Slot, typename R>
void attend_item(const DecodeAttn& a, int64_t item, float* acc, float* scores, float* m,
                 float* l) {
  const int64_t D = a.dim, H = a.heads, KVH = a.kv_heads, G = H / KVH;
  const int64_t split = item % a.splits;
  const int64_t b = item / a.splits;
  const int64_t len = a.seq_lens[b];
  const int64_t first = a.window > 0 && len > a.window ? len - a.window : 0;
  const int64_t chunk = (len - first + a.splits - 1) / a.splits;
  const int64_t t0 = std::min(len, first + split * chunk);
  const int64_t t1 = std::min(len, t0 + chunk);
  const Slot* row = static_cast<const Slot*>(a.req_to_token) + a.req_pool_indices[b] * a.rtt_stride;
  using E = typename R::E;
  const E* kc = static_cast<const E*>(a.k_cache);
  const E* vc = static_cast<const E*>(a.v_cache);
  const int64_t row_len = a.row;
  const int64_t token_len = KVH * row_len;  // a slot's rows, every KV head's, contiguous

  for (int64_t h = 0; h < H; ++h) {
    m[h] = -INFINITY;
    l[h] = 0;
  }
  for (int64_t i = 0; i < H * D; i += V::W) V::store(acc + i, V::zero());

  // Every KV head of a block of keys in turn: a slot's rows for all of them are one contiguous
  // run of memory, read once from start to end (one KV head per item read a run a head wide
  // out of every slot, KVH strided passes over the same lines). The next block's K and V
  // rows are prefetched into L2 a block ahead (the keys of a request sit anywhere in the
  // cache; on a Zen 4 prefetcht0's lines left one bfloat16 layer at 16 requests of 256 keys
  // at 1790 us against 525 into L2).
  int64_t slot_buf[2][kBlock];
  auto load_slots = [&](int64_t tb, int64_t* out) {
    const int64_t nb = std::min(kBlock, t1 - tb);
    for (int64_t j = 0; j < nb; ++j) out[j] = static_cast<int64_t>(row[tb + j]) * token_len;
  };
  auto prefetch_rows = [&](const E* base, const int64_t* offs, int64_t nb) {
    const int64_t bytes = token_len * static_cast<int64_t>(sizeof(E));
    for (int64_t j = 0; j < nb; ++j) {
      const char* p = reinterpret_cast<const char*>(base + offs[j]);
      for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(p + c, 0, 2);
    }
  };
  if (t0 < t1) {
    load_slots(t0, slot_buf[0]);
    prefetch_rows(kc, slot_buf[0], std::min(kBlock, t1 - t0));
    prefetch_rows(vc, slot_buf[0], std::min(kBlock, t1 - t0));
  }
  for (int64_t tb = t0, blk = 0; tb < t1; tb += kBlock, ++blk) {
    const int64_t nb = std::min(kBlock, t1 - tb);
    const int64_t* slots = slot_buf[blk & 1];
    if (tb + kBlock < t1) {
      int64_t* next = slot_buf[(blk + 1) & 1];
      load_slots(tb + kBlock, next);
      prefetch_rows(kc, next, std::min(kBlock, t1 - tb - kBlock));
      prefetch_rows(vc, next, std::min(kBlock, t1 - tb - kBlock));
    }
    for (int64_t kvh = 0; kvh < KVH; ++kvh) {
      const E* kh = kc + kvh * row_len;  // this KV head's row of each slot
      const E* vh = vc + kvh * row_len;
      const float* q = a.q + (b * H + kvh * G) * D;
      float* ah = acc + kvh * G * D;
      float* mh = m + kvh * G;
      float* lh = l + kvh * G;
      for (int64_t g = 0; g < G; g += kHeadTile) score_heads<R>(q, G, D, kh, slots, nb, g, scores);
      if constexpr (R::scaled) scale_by_rows<R>(G, D, kh, slots, nb, scores);
      if (a.softcap > 0) {
        const float inv = 1.0f / a.softcap;
        for (int64_t g = 0; g < G; ++g)
          for (int64_t j = 0; j < nb; ++j) {
            float& sc = scores[g * kBlock + j];
            sc = std::tanh(sc * inv) * a.softcap;
          }
      }
      // online softmax: scores become probabilities relative to the running max
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores + g * kBlock;
        float bm = -INFINITY;
        for (int64_t j = 0; j < nb; ++j) bm = std::max(bm, sg[j]);
        const float mnew = std::max(mh[g], bm);
        if (mnew > mh[g] && lh[g] > 0) {
          const typename V::T alpha = V::set1(std::exp(mh[g] - mnew));
          float* ag = ah + g * D;
          for (int64_t c = 0; c < D; c += V::W) V::store(ag + c, V::mul(V::load(ag + c), alpha));
          lh[g] *= std::exp(mh[g] - mnew);
        }
        mh[g] = mnew;
        const typename V::T mv = V::set1(mnew);
        typename V::T sum = V::zero();
        for (int64_t j = 0; j < kBlock; j += V::W) {
          typename V::T p = V::exp(V::sub(V::load(sg + j), mv));
          if (j + V::W > nb) p = V::keep_first(p, std::max<int64_t>(0, nb - j));
          V::store(sg + j, p);
          sum = V::add(sum, p);
        }
        lh[g] += V::sum(sum);
      }
      // NOTE: after the sums l: a value row's scale weighs its probability, not its elements
      if constexpr (R::scaled) scale_by_rows<R>(G, D, vh, slots, nb, scores);
      for (int64_t g = 0; g < G; g += kHeadTile) add_values<R>(G, D, vh, slots, nb, g, scores, ah);
    }
  }

  for (int64_t h = 0; h < H; ++h) {
    const float* ah = acc + h * D;
    if (a.splits > 1) {
      float* p = a.partial + ((b * H + h) * a.splits + split) * (D + 2);
      for (int64_t c = 0; c < D; c += V::W) V::store(p + c, V::load(ah + c));
      p[D] = m[h];
      p[D + 1] = l[h];
      continue;
    }
    const typename V::T inv = V::set1(l[h] > 0 ? 1.0f / l[h] : 0.0f);
    const int64_t o = (b * H + h) * D;
    for (int64_t c = 0; c < D; c += V::W) {
      const typename V::T y = V::mul(V::load(ah + c), inv);
      if (a.out_bf16) {
        V::store_bf16(static_cast<uint16_t*>(a.out) + o + c, y);
      } else {
        V::store(static_cast<float*>(a.out) + o + c, y);
      }
    }
  }
}

template <typename Slot, typename R>
void attend_items(const DecodeAttn& a, int64_t i0, int64_t i1) {
  const int64_t G = a.heads / a.kv_heads;
  thread_local std::vector<float> acc, scores, ml;
  float* ap = scratch(acc, a.heads * a.dim);
  float* sp = scratch(scores, G * kBlock);
  float* mp = scratch(ml, 2 * a.heads);
  for (int64_t i = i0; i < i1; ++i) attend_item<Slot, R>(a, i, ap, sp, mp, mp + a.heads);
}

template <typename Slot>
void attend_items_of(const DecodeAttn& a, int64_t i0, int64_t i1) {
  switch (a.cache_kind) {
    case CacheKind::kF32: return attend_items<Slot, RowsF32>(a, i0, i1);
    case CacheKind::kBF16: return attend_items<Slot, RowsBF16>(a, i0, i1);
    case CacheKind::kI8: return attend_items<Slot, RowsI8>(a, i0, i1);
    case CacheKind::kE4M3: return attend_items<Slot, RowsE4M3>(a, i0, i1);
    case CacheKind::kE5M2: return attend_items<Slot, RowsE5M2>(a, i0, i1);
  }
}

void decode_attention_impl(const DecodeAttn& a, int64_t i0, int64_t i1) {
  if (a.rtt_i32) return attend_items_of<int32_t>(a, i0, i1);
  return attend_items_of<int64_t>(a, i0, i1);
}
