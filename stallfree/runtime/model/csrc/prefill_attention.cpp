// torch.ops.stallfree.prefill_attention: one request's prompt attention (causal, optionally
// windowed and soft-capped) on the native kernel of the selected instruction set
// (prefill_attention_impl.h), instead of SDPA, whose CPU kernel computes every key block of a
// prompt shorter than its 512-key split in full, the half above the diagonal included. A
// bfloat16 prompt whose head dim is a multiple of 32 runs on the AMX tiles where they are in
// use (amx_prefill_attention.cpp).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

#include "attention.h"
#include "kernels.h"

namespace sf {
namespace {

void check_rows(const at::Tensor& t, const char* what, int64_t rows, int64_t heads, int64_t d,
                at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 3 && t.size(0) == rows && t.size(1) == heads &&
                  t.size(2) == d && t.stride(2) == 1 && t.stride(1) == d &&
                  t.scalar_type() == dtype,
              "prefill_attention: ", what, " must be a CPU [", rows, ", ", heads, ", ", d,
              "] tensor of ", dtype, " with contiguous heads, got ", t.sizes(), " ",
              t.scalar_type(), " strides ", t.strides());
}

// the work items of kv_heads * ceil(n / rows) a thread takes: every threads-th one, since an
// item's work grows with its query block (one contiguous range would give one thread the
// short blocks)
template <typename F>
void striped(int64_t items, F&& f) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) f(t, items, threads);
  });
}

// a bfloat16 prompt on the AMX tiles (amx_prefill_attention.cpp)
at::Tensor on_tiles(const at::Tensor& q, const PrefillAttn& a, at::Tensor out) {
  const int64_t keys_pad = amx::prefill_packed_keys(a.prefix + a.n - a.first);
  const auto opts = q.options().dtype(at::kInt);
  at::Tensor kb = at::empty({a.kv_heads * a.dim * keys_pad / 2}, opts);
  at::Tensor vb = at::empty({a.kv_heads * a.dim * keys_pad / 2}, opts);
  uint32_t* kp = reinterpret_cast<uint32_t*>(kb.data_ptr<int32_t>());
  uint32_t* vp = reinterpret_cast<uint32_t*>(vb.data_ptr<int32_t>());
  at::parallel_for(0, keys_pad / 32, 4, [&](int64_t b0, int64_t b1) {
    amx::prefill_pack_keys_bf16(a, kp, vp, b0 * 32, b1 * 32);
  });
  striped(a.kv_heads * ((a.n + 15) / 16), [&](int64_t t, int64_t items, int64_t threads) {
    amx::prefill_items_bf16(a, kp, vp, t, items, threads);
  });
  return out;
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             int64_t prefix, int64_t first, std::optional<double> scale,
                             std::optional<double> softcap, std::optional<int64_t> window) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3, "prefill_attention: q [n, H, D], k/v [keys, KVH, D]");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1);
  const at::ScalarType dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "prefill_attention: float32 or bfloat16, got ", dtype);
  TORCH_CHECK(prefix >= 0 && first >= 0 && first <= prefix,
              "prefill_attention: need 0 <= first <= prefix, got first ", first, ", prefix ",
              prefix);
  const int64_t keys = prefix + n - first;
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "prefill_attention: ", H, " heads over ", KVH,
              " KV heads");
  TORCH_CHECK(D % 16 == 0 && D <= 256, "prefill_attention: head dim ", D,
              " is not a multiple of 16 up to 256");
  check_rows(q, "q", n, H, D, dtype);
  check_rows(k, "k", keys, KVH, D, dtype);
  check_rows(v, "v", keys, KVH, D, dtype);
  TORCH_CHECK(!window.has_value() || *window > 0, "prefill_attention: window must be positive");
  TORCH_CHECK(!softcap.has_value() || *softcap > 0, "prefill_attention: softcap must be positive");
  const char* isa = selected_isa();
  TORCH_CHECK(isa != nullptr, "prefill_attention: no instruction set selected");
  const bool wide = std::strcmp(isa, "avx512") == 0;
  const PrefillTransposeFn transpose = wide ? avx512::prefill_transpose : avx2::prefill_transpose;
  const PrefillAttnFn attend = wide ? avx512::prefill_attention : avx2::prefill_attention;

  PrefillAttn a;
  a.n = n;
  a.heads = H;
  a.kv_heads = KVH;
  a.dim = D;
  a.prefix = prefix;
  a.first = first;
  a.window = window.value_or(0);
  a.scale = static_cast<float>(scale.value_or(1.0 / std::sqrt(static_cast<double>(D))));
  a.softcap = static_cast<float>(softcap.value_or(0.0));
  a.bf16 = dtype == at::kBFloat16;
  a.q = q.data_ptr();
  a.k = k.data_ptr();
  a.v = v.data_ptr();
  a.q_stride = q.stride(0);
  a.k_stride = k.stride(0);
  a.v_stride = v.stride(0);
  at::Tensor out = at::empty({n, H, D}, q.options());
  a.out = out.data_ptr();
  if (n == 0) return out;
  if (dtype == at::kBFloat16 && D % 32 == 0 && tiles_in_use()) return on_tiles(q, a, out);
  const int64_t kt_stride = (keys + kPromptKeys - 1) / kPromptKeys * kPromptKeys;
  // the transpose writes keys [0, keys) of each row it uses; only the last block's padding
  // past them is zeroed (a whole at::zeros was 0.6% of a 256-token SmolLM2 forward)
  at::Tensor kt = at::empty({KVH, D, kt_stride}, q.options().dtype(at::kFloat));
  if (kt_stride > keys) kt.narrow(2, keys, kt_stride - keys).zero_();
  a.kt = kt.data_ptr<float>();
  a.kt_stride = kt_stride;
  at::parallel_for(0, keys, 64, [&](int64_t t0, int64_t t1) { transpose(a, t0, t1); });
  striped(KVH * ((n + kPromptRows - 1) / kPromptRows),
          [&](int64_t t, int64_t items, int64_t threads) { attend(a, t, items, threads); });
  return out;
}

}  // namespace
}  // namespace sf

TORCH_LIBRARY_FRAGMENT(stallfree, m) {
  m.def(
      "prefill_attention(Tensor q, Tensor k, Tensor v, int prefix=0, int first=0, "
      "float? scale=None, float? softcap=None, int? window=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(stallfree, CPU, m) { m.impl("prefill_attention", &sf::prefill_attention); }
