// A decode step's decoder layers in one call (`decode_layers`): the layer loop that
// `LlamaDecoderLayer.fused_forward` runs in Python, driven from C++ over the same operators
// (the native ones through the dispatcher, torch's dense product as `at::linear`), in the same
// order on the same inputs, so its result is bit for bit the Python loop's. What it removes is
// the Python between the calls: module calls, argument checks and wrapper frames, about
// 10 per layer.
//
// Each layer is: RMSNorm (the first layer's) or add + RMSNorm, the q/k/v projection, the fused
// RoPE + K/V write + attention (`decode_attention_qkv`), the output projection, add + RMSNorm,
// gate/up, SiLU * up, down. With per-head q/k norms (Qwen3) the projection's q and k are
// normed apart and attention takes the three (`decode_attention`), as the Python layer does,
// and so where q, k and v are three projections (float32 with biases); a soft-cap and each
// layer's window (0: none) go to the attention op as Python passes them. A projection is one
// of the `Kind`s below, its tensors taken in order from `params` as `spec` says
// (runtime/model/native_loop.py builds both).
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/rms_norm.h>
#include <torch/library.h>

#include "layer_calls.h"

#include <optional>
#include <tuple>
#include <vector>

namespace sf {
namespace {

using OptTensor = std::optional<at::Tensor>;

// how a projection runs, and how many of `params` it takes (its bias, possibly None, last)
enum Kind : int64_t {
  kNative = 0,      // stallfree::linear(x, weight, bias_f32)
  kQ8Rows = 1,      // stallfree::linear_q8(x, qweight, scale_f32, bias_f32)
  kQ8Blocks = 2,    // stallfree::linear_q8_blocks(x, qweight, block_scale, bias_f32)
  kQ4 = 3,          // stallfree::linear_q4(x, codes, scale, offset, bias_f32)
  kTorch = 4,       // at::linear(x, weight, bias)
  kGroup = 5,       // stallfree::linear_group(x, weights): spec's next value is the count
  kApart = 6,       // not a projection: q, k and v are the next three, each its own call
  kCompact = 7,     // stallfree::linear_compact(x, weight, codes, tables, bias_f32)
};

struct Ops {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&)>
      linear = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&)>(
          "stallfree::linear");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, const OptTensor&)>
      compact = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, const OptTensor&)>("stallfree::linear_compact");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const std::vector<at::Tensor>&)> group =
      find_op<at::Tensor(const at::Tensor&, const std::vector<at::Tensor>&)>(
          "stallfree::linear_group");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const OptTensor&)>
      q8 = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const OptTensor&)>("stallfree::linear_q8");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const OptTensor&)>
      q8_blocks = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const OptTensor&)>("stallfree::linear_q8_blocks");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, const OptTensor&)>
      q4 = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, const OptTensor&)>("stallfree::linear_q4");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double)> rms_norm =
      find_op<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("stallfree::rms_norm");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> silu_mul =
      find_op<at::Tensor(const at::Tensor&)>("stallfree::silu_mul");
  c10::TypedOperatorHandle<at::Tensor(
      const at::Tensor&, int64_t, int64_t, const OptTensor&, const OptTensor&, const at::Tensor&,
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      const at::Tensor&, std::optional<double>, std::optional<double>, std::optional<int64_t>)>
      attention = find_op<at::Tensor(const at::Tensor&, int64_t, int64_t, const OptTensor&,
                                const OptTensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, std::optional<double>, std::optional<double>,
                                std::optional<int64_t>)>("stallfree::decode_attention_qkv");
  c10::TypedOperatorHandle<at::Tensor(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&,
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      const at::Tensor&, const at::Tensor&, std::optional<double>, std::optional<double>,
      std::optional<int64_t>)>
      attention3 = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const OptTensor&, const OptTensor&, const at::Tensor&,
                                 const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, const at::Tensor&, std::optional<double>,
                                 std::optional<double>, std::optional<int64_t>)>(
          "stallfree::decode_attention");
};

const Ops& ops() {
  static const Ops o;
  return o;
}

// Reads projections off `params` / `spec` in order.
struct Projections : PlanCursor {
  // whether q, k and v come as three projections (`kApart` taken off the spec)
  bool apart() {
    if (s >= spec.size() || spec[s] != kApart) return false;
    ++s;
    return true;
  }

  at::Tensor apply(const at::Tensor& x) {
    const Ops& o = ops();
    switch (kind()) {
      case kNative: {
        const at::Tensor w = need("a weight");
        return o.linear.call(x, w, maybe());
      }
      case kQ8Rows: {
        const at::Tensor q = need("int8 codes"), scale = need("row scales");
        return o.q8.call(x, q, scale, maybe());
      }
      case kQ8Blocks: {
        const at::Tensor q = need("int8 codes"), scale = need("block scales");
        return o.q8_blocks.call(x, q, scale, maybe());
      }
      case kQ4: {
        const at::Tensor c = need("int4 codes"), scale = need("group scales"),
                         offset = need("group offsets");
        return o.q4.call(x, c, scale, offset, maybe());
      }
      case kCompact: {
        const at::Tensor w = need("a weight"), codes = need("compact codes"),
                         tables = need("compact tables");
        return o.compact.call(x, w, codes, tables, maybe());
      }
      case kTorch: {
        const at::Tensor w = need("a weight");
        return at::linear(x, w, maybe());
      }
      case kGroup: {
        TORCH_CHECK(s < spec.size(), "decode_layers: a group without its count");
        const int64_t count = spec[s++];
        std::vector<at::Tensor> ws;
        for (int64_t i = 0; i < count; ++i) ws.push_back(need("a group's weight"));
        return o.group.call(x, ws);
      }
      default:
        TORCH_CHECK(false, "decode_layers: unknown projection kind ", spec[s - 1]);
    }
  }
};

// `RMSNorm.forward` (llama.py) on q's or k's heads [T, heads, D], a view of the projection:
// the native kernel where the view is contiguous (one row), else transformers' arithmetic
// (native_layers.rms_norm_reference): float32 statistics, the weight applied in the dtype.
at::Tensor head_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (x.is_contiguous()) return ops().rms_norm.call(x, weight, eps);
  return head_norm_reference(x, weight, eps);
}

// A layer's attention, from its normed input to the heads' outputs [T, H * D], as
// `LlamaAttention.forward` runs a decode step: the joint projection straight into
// `decode_attention_qkv`; with q/k norms, or with q, k and v as three projections, the head
// views (q and k normed per head) into `decode_attention`.
struct Attention {
  const at::Tensor& cos;
  const at::Tensor& signed_sin;
  const std::vector<at::Tensor>& k_caches;
  const std::vector<at::Tensor>& v_caches;
  const at::Tensor& out_cache_loc;
  const at::Tensor& req_to_token;
  const at::Tensor& req_pool_indices;
  const at::Tensor& seq_lens;
  int64_t num_heads, num_kv_heads;
  std::optional<double> scale, softcap;
  const std::vector<int64_t>& windows;  // empty, or each layer's (0: none)
  const std::vector<at::Tensor>& qk_norms;  // empty, or each layer's q and k norm weights
  double qk_eps;

  at::Tensor operator()(Projections& proj, const at::Tensor& x, size_t l) const {
    const Ops& o = ops();
    std::optional<int64_t> window;
    if (!windows.empty() && windows[l] > 0) window = windows[l];
    at::Tensor q, k, v;
    if (proj.apart()) {
      q = proj.apply(x);
      k = proj.apply(x);
      v = proj.apply(x);
    } else {
      const at::Tensor qkv = proj.apply(x);
      if (qk_norms.empty()) {
        return o.attention.call(qkv, num_heads, num_kv_heads, cos, signed_sin, k_caches[l],
                                v_caches[l], out_cache_loc, req_to_token, req_pool_indices,
                                seq_lens, scale, softcap, window);
      }
      // LlamaAttention.project's split of the joint output
      const int64_t kw = qkv.size(1) / (num_heads + 2 * num_kv_heads) * num_kv_heads;
      const int64_t qw = qkv.size(1) - 2 * kw;
      q = qkv.narrow(1, 0, qw);
      k = qkv.narrow(1, qw, kw);
      v = qkv.narrow(1, qw + kw, kw);
    }
    const int64_t rows = x.size(0), dim = q.size(1) / num_heads;
    q = q.view({rows, num_heads, dim});
    k = k.view({rows, num_kv_heads, dim});
    v = v.view({rows, num_kv_heads, dim});
    if (!qk_norms.empty()) {
      q = head_norm(q, qk_norms[2 * l], qk_eps);
      k = head_norm(k, qk_norms[2 * l + 1], qk_eps);
    }
    return o.attention3
        .call(q, k, v, cos, signed_sin, k_caches[l], v_caches[l], out_cache_loc, req_to_token,
              req_pool_indices, seq_lens, scale, softcap, window)
        .reshape({rows, num_heads * dim});
  }
};

std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& h, const at::Tensor& cos, const at::Tensor& signed_sin,
    const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
    const at::Tensor& out_cache_loc, const at::Tensor& req_to_token,
    const at::Tensor& req_pool_indices, const at::Tensor& seq_lens, int64_t num_heads,
    int64_t num_kv_heads, std::optional<double> scale, const std::vector<at::Tensor>& norms,
    double eps, const c10::List<OptTensor>& params, const std::vector<int64_t>& spec,
    std::optional<double> softcap, const std::vector<int64_t>& windows,
    const std::vector<at::Tensor>& qk_norms, double qk_eps) {
  const size_t layers = k_caches.size();
  check_layer_lists("decode_layers", layers, v_caches.size(), norms.size(), windows.size(),
                    qk_norms.size());
  const Ops& o = ops();
  const Attention attend{cos, signed_sin, k_caches, v_caches, out_cache_loc, req_to_token,
                         req_pool_indices, seq_lens, num_heads, num_kv_heads, scale, softcap,
                         windows, qk_norms, qk_eps};
  Projections proj{{"decode_layers", params, spec}};
  auto result = residual_layers(
      h, norms, eps, layers,
      [&](const at::Tensor& x, size_t l) { return proj.apply(attend(proj, x, l)); },
      [&](const at::Tensor& x) { return proj.apply(o.silu_mul.call(proj.apply(x))); });
  proj.check_done();
  return result;
}

}  // namespace
}  // namespace sf

TORCH_LIBRARY_FRAGMENT(stallfree, m) {
  m.def(
      "decode_layers(Tensor h, Tensor cos, Tensor signed_sin, Tensor(a!)[] k_caches, "
      "Tensor(b!)[] v_caches, Tensor out_cache_loc, Tensor req_to_token, "
      "Tensor req_pool_indices, Tensor seq_lens, int num_heads, int num_kv_heads, "
      "float? scale, Tensor[] norms, float eps, Tensor?[] params, int[] spec, "
      "float? softcap, int[] windows, Tensor[] qk_norms, float qk_eps) "
      "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(stallfree, CPU, m) { m.impl("decode_layers", &sf::decode_layers); }
