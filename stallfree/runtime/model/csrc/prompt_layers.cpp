// A prompt's decoder layers in one call (`prefill_layers`): the loop that
// `LlamaDecoderLayer.fused_forward` runs in Python for a bfloat16 or float32 extend step, driven
// from C++ over the same operators in the same order on the same inputs, so its result is bit for bit the
// Python loop's. What it removes is the Python between the calls (module calls, the checks each
// op's wrapper makes, views and frames), during which the other compute thread waits.
//
// Each layer is: RMSNorm (the first layer's) or add + RMSNorm; the joint q/k/v projection (its
// q and k heads normed with per-head q/k norms, Qwen3's); RoPE on q and k with the K/V write
// (`rope_write`); each request's attention over its own new keys, or over its keys gathered
// from the cache where it has a prefix or outgrows its window (`prefill_attention`), and a
// mixed step's trailing one-token rows (its decode rows, two or more) through the decode
// attention op together (`decode_attention`: their RoPE, K/V write and attention read through
// `req_to_token`), as `PagedAttention._extend_with_tail` takes them; the output projection; add + RMSNorm; then the MLP. On the AMX tiles' prompt product (up to 256 rows)
// gate/up writes SiLU * up packed for the down projection, which reads it as it is
// (`native_layers.mlp_on_tiles`); past them each product is oneDNN's (`at::linear`, as F.linear,
// or on `--prepack-prompt-weights`' blocked copy past its threshold) and gate/up, `silu_mul` and
// down are three calls (`native_layers.gate_up_silu`'s way). A float32 layer keeps its
// projections apart, as transformers does: q, k and v are three `at::linear` calls joined for
// the attention, gate and up each a torch.mm into its columns of one output
// (`native_layers.side_by_side`), then `silu_mul` and down.
// A projection is one of the `Kind`s below, its tensors taken in order from `params` as `spec`
// says (runtime/model/native_prompt_loop.py builds both).
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include "layer_calls.h"

#include <algorithm>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace sf {
namespace {

using OptTensor = std::optional<at::Tensor>;

// how a projection runs on the tiles, and the tensors it takes off `params`
enum Kind : int64_t {
  kBf16 = 0,  // linear_bf16_prompt: weight, bias_f32
  kQ8 = 1,    // linear_q8_prompt: qweight, row scales?, block scales?, bias_f32?, bias?
  kQ4 = 2,    // linear_q4_prompt: codes, group scales, group offsets, bias_f32?, bias?
  kTorch = 3,  // at::linear: weight, bias? (bfloat16 past the tiles' rows: oneDNN; float32)
  // oneDNN on its blocked copy (`--prepack-prompt-weights`), or on a float32 weight as it is
  // (off Intel: native_layers.float32_on_onednn): weight, bias?
  kPrepacked = 4,
  // float32's gate and up (`native_layers.side_by_side`): spec's next value is the count, then
  // that many weights, each one's torch.mm written into its columns of one output
  kSide = 5,
  kApart = 6,  // not a projection: q, k and v are the next three, each its own call (float32)
};

using Prompt8 = at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&,
                           const OptTensor&, const OptTensor&, bool, bool, int64_t);
using Prompt4 = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const at::Tensor&, const OptTensor&, bool, bool, int64_t);
using PromptBf16 = at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, bool,
                              bool, int64_t);
using SiluMul = at::Tensor(const at::Tensor&);
using RopeWrite = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                             const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&);
using Attend = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                          int64_t, std::optional<double>, std::optional<double>,
                          std::optional<int64_t>);
using DecodeAttend = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const OptTensor&, const OptTensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&,
                                const at::Tensor&, std::optional<double>, std::optional<double>,
                                std::optional<int64_t>);

struct Ops {
  c10::TypedOperatorHandle<PromptBf16> bf16 = find_op<PromptBf16>("stallfree::linear_bf16_prompt");
  c10::TypedOperatorHandle<Prompt8> q8 = find_op<Prompt8>("stallfree::linear_q8_prompt");
  c10::TypedOperatorHandle<Prompt4> q4 = find_op<Prompt4>("stallfree::linear_q4_prompt");
  c10::TypedOperatorHandle<SiluMul> silu_mul = find_op<SiluMul>("stallfree::silu_mul");
  c10::TypedOperatorHandle<RopeWrite> rope_write = find_op<RopeWrite>("stallfree::rope_write");
  c10::TypedOperatorHandle<Attend> attend = find_op<Attend>("stallfree::prefill_attention");
  c10::TypedOperatorHandle<DecodeAttend> decode =
      find_op<DecodeAttend>("stallfree::decode_attention");
};

const Ops& ops() {
  static const Ops o;
  return o;
}

// oneDNN's product on its blocked copy of a weight (`native_layers.packed_linear`), looked up on
// first use: a torch built without oneDNN has no such operator and never plans one
at::Tensor prepacked_linear(const at::Tensor& x, const at::Tensor& packed, const OptTensor& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.emplace_back(x);
  stack.emplace_back(packed);
  stack.emplace_back(bias);
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(stack);
  return stack.back().toTensor();
}

// Reads projections off `params` / `spec` in order and runs them as the Python layers do:
// plain (q/k/v, o), with SiLU * up written packed (gate/up), or on such a packed input of
// `rows` rows (down). An integer layer's bias goes in the epilogue (float32) with SiLU or
// packing, else it is added to the product in the dtype (`QuantLinear.tile_product`).
struct Projections : PlanCursor {
  // whether the next projection runs on oneDNN (an MLP's two then run apart)
  bool next_on_torch() const {
    return s < spec.size() && (spec[s] == kTorch || spec[s] == kPrepacked || spec[s] == kSide);
  }
  // whether q, k and v come as three projections (`kApart` taken off the spec)
  bool apart() {
    if (s >= spec.size() || spec[s] != kApart) return false;
    ++s;
    return true;
  }

  at::Tensor apply(const at::Tensor& x, bool silu = false, bool pack = false, int64_t rows = 0) {
    const Ops& o = ops();
    const bool epilogue = silu || pack;
    switch (kind()) {
      case kBf16: {
        const at::Tensor w = need("a weight");
        return o.bf16.call(x, w, maybe("a bias"), silu, pack, rows);
      }
      case kQ8: {
        const at::Tensor q = need("int8 codes");
        const OptTensor scale = maybe("row scales"), blocks = maybe("block scales");
        const OptTensor bias_f32 = maybe("a bias"), bias = maybe("a bias");
        const at::Tensor out =
            o.q8.call(x, q, scale, blocks, epilogue ? bias_f32 : std::nullopt, silu, pack, rows);
        return epilogue || !bias ? out : at::add(out, *bias);
      }
      case kQ4: {
        const at::Tensor c = need("int4 codes"), scale = need("group scales"),
                         offset = need("group offsets");
        const OptTensor bias_f32 = maybe("a bias"), bias = maybe("a bias");
        const at::Tensor out =
            o.q4.call(x, c, scale, offset, epilogue ? bias_f32 : std::nullopt, silu, pack, rows);
        return epilogue || !bias ? out : at::add(out, *bias);
      }
      case kTorch: {
        TORCH_CHECK(!epilogue, "prefill_layers: a product on oneDNN has no SiLU or packed output");
        const at::Tensor w = need("a weight");
        return at::linear(x, w, maybe("a bias"));
      }
      case kPrepacked: {
        TORCH_CHECK(!epilogue, "prefill_layers: a product on oneDNN has no SiLU or packed output");
        const at::Tensor w = need("a packed weight");
        return prepacked_linear(x, w, maybe("a bias"));
      }
      case kSide: {
        TORCH_CHECK(!epilogue, "prefill_layers: a side-by-side product has no SiLU or packed output");
        TORCH_CHECK(s < spec.size(), "prefill_layers: a side-by-side group without its count");
        const int64_t count = spec[s++];
        TORCH_CHECK(count > 0, "prefill_layers: a side-by-side group of ", count, " weights");
        std::vector<at::Tensor> ws;
        int64_t width = 0;
        for (int64_t i = 0; i < count; ++i) {
          ws.push_back(need("a side-by-side weight"));
          width += ws.back().size(0);
        }
        at::Tensor out = at::empty({x.size(0), width}, x.options());
        int64_t col = 0;
        for (const at::Tensor& w : ws) {
          at::Tensor cols = out.narrow(1, col, w.size(0));
          at::mm_out(cols, x, w.t());
          col += w.size(0);
        }
        return out;
      }
      default:
        TORCH_CHECK(false, "prefill_layers: unknown projection kind ", spec[s - 1]);
    }
  }
};

// A layer's attention from the joint q/k/v projection [T, (H + 2 KVH) * D] to the heads'
// outputs [T, H * D], as `PagedAttention.forward` and `_extend` run an extend step: q and k
// rotated and K/V written in one call, then each request's rows attend over their own new keys
// (no prefix, no window they outgrow) or over their keys gathered from the cache. A decode
// tail (`tail` > 0: the last requests, one new token each) takes one `decode_attention` call
// on its unrotated rows instead, as `PagedAttention._extend_with_tail` does.
struct Attention {
  const at::Tensor& cos;
  const at::Tensor& signed_sin;
  const std::vector<at::Tensor>& k_caches;
  const std::vector<at::Tensor>& v_caches;
  const at::Tensor& out_cache_loc;
  const at::Tensor& req_to_token;
  const std::vector<int64_t>& extend_lens;
  const std::vector<int64_t>& prefix_lens;
  const std::vector<int64_t>& pool_rows;
  int64_t num_heads, num_kv_heads;
  std::optional<double> scale, softcap;
  const std::vector<int64_t>& windows;  // empty, or each layer's (0: none)
  const std::vector<at::Tensor>& qk_norms;  // empty, or each layer's q and k norm weights
  double qk_eps;
  int64_t tail;           // the decode tail's rows (requests), 0 for none
  at::Tensor tail_pool;   // their pool rows and sequence lengths, int64
  at::Tensor tail_lens;

  at::Tensor operator()(const at::Tensor& qkv, size_t l) const {
    const Ops& o = ops();
    const int64_t t = qkv.size(0), width = num_heads + 2 * num_kv_heads;
    TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) % width == 0,
                "prefill_layers: the q/k/v projection's width is not a whole number of heads");
    const int64_t dim = qkv.size(1) / width;
    const at::Tensor heads = qkv.view({t, width, dim});
    if (!qk_norms.empty()) {
      // per-head q and k norms (Qwen3), as `LlamaAttention.project` runs them on a prompt's
      // strided head views, written back over the projection's q and k so that the one call
      // below rotates and writes them (the same bits as rotating the normed copies apart)
      const at::Tensor q = heads.narrow(1, 0, num_heads);
      const at::Tensor k = heads.narrow(1, num_heads, num_kv_heads);
      q.copy_(head_norm_reference(q, qk_norms[2 * l], qk_eps));
      k.copy_(head_norm_reference(k, qk_norms[2 * l + 1], qk_eps));
    }
    const at::Tensor v = heads.narrow(1, num_heads + num_kv_heads, num_kv_heads);
    at::Tensor k_cache = k_caches[l], v_cache = v_caches[l];
    const int64_t layer_window = windows.empty() ? 0 : windows[l];
    const int64_t head = t - tail;  // the rows before the decode tail
    std::vector<at::Tensor> outs;
    if (head > 0) {
      const at::Tensor rotated = o.rope_write.call(
          heads.narrow(0, 0, head).narrow(1, 0, num_heads + num_kv_heads), cos.narrow(0, 0, head),
          signed_sin.narrow(0, 0, head), num_heads, v.narrow(0, 0, head), k_cache, v_cache,
          out_cache_loc.narrow(0, 0, head));
      const at::Tensor q = rotated.narrow(1, 0, num_heads);
      const at::Tensor k = rotated.narrow(1, num_heads, num_kv_heads);
      int64_t start = 0;
      for (size_t i = 0; i + tail < extend_lens.size(); ++i) {
        const int64_t n = extend_lens[i], prefix = prefix_lens[i], seq = prefix + n;
        std::optional<int64_t> window;
        if (layer_window > 0 && seq > layer_window) window = layer_window;
        const at::Tensor chunk = q.narrow(0, start, n);
        if (prefix == 0 && !window) {
          outs.push_back(o.attend.call(chunk, k.narrow(0, start, n), v.narrow(0, start, n), 0,
                                       0, scale, softcap, std::nullopt));
        } else {
          // keys before the first query's window are never seen
          const int64_t first = window ? std::max<int64_t>(0, prefix + 1 - *window) : 0;
          const at::Tensor slots =
              req_to_token.select(0, pool_rows[i]).narrow(0, first, seq - first);
          outs.push_back(o.attend.call(chunk, at::index_select(k_cache, 0, slots),
                                       at::index_select(v_cache, 0, slots), prefix, first, scale,
                                       softcap, window));
        }
        start += n;
      }
      TORCH_CHECK(start == head, "prefill_layers: the requests' lengths do not add up to the rows");
    }
    if (tail > 0) {
      const at::Tensor rows = heads.narrow(0, head, tail);
      const OptTensor c = cos.narrow(0, head, tail), s = signed_sin.narrow(0, head, tail);
      std::optional<int64_t> window;
      if (layer_window > 0) window = layer_window;
      outs.push_back(o.decode.call(rows.narrow(1, 0, num_heads),
                                   rows.narrow(1, num_heads, num_kv_heads), v.narrow(0, head, tail),
                                   c, s, k_cache, v_cache, out_cache_loc.narrow(0, head, tail),
                                   req_to_token, tail_pool, tail_lens, scale, softcap, window));
    }
    const at::Tensor out = outs.size() == 1 ? outs[0] : at::cat(outs);
    return out.reshape({t, num_heads * dim});
  }
};

// How many of the step's last requests add one token each, where two or more do (a mixed
// step's decode rows, `PagedAttention._one_token_tail`); else 0
int64_t decode_tail(const std::vector<int64_t>& extend_lens) {
  int64_t tail = 0;
  while (tail < static_cast<int64_t>(extend_lens.size()) &&
         extend_lens[extend_lens.size() - 1 - tail] == 1)
    ++tail;
  return tail >= 2 ? tail : 0;
}

std::tuple<at::Tensor, at::Tensor> prefill_layers(
    const at::Tensor& h, const at::Tensor& cos, const at::Tensor& signed_sin,
    const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
    const at::Tensor& out_cache_loc, const at::Tensor& req_to_token,
    const std::vector<int64_t>& extend_lens, const std::vector<int64_t>& prefix_lens,
    const std::vector<int64_t>& pool_rows, int64_t num_heads, int64_t num_kv_heads,
    std::optional<double> scale, const std::vector<at::Tensor>& norms, double eps,
    const c10::List<OptTensor>& params, const std::vector<int64_t>& spec,
    std::optional<double> softcap, const std::vector<int64_t>& windows,
    const std::vector<at::Tensor>& qk_norms, double qk_eps) {
  const size_t layers = k_caches.size();
  check_layer_lists("prefill_layers", layers, v_caches.size(), norms.size(), windows.size(),
                    qk_norms.size());
  TORCH_CHECK(prefix_lens.size() == extend_lens.size() && pool_rows.size() == extend_lens.size(),
              "prefill_layers: expected a prefix length and a pool row per request");
  TORCH_CHECK(h.dim() == 2, "prefill_layers: expected h as [rows, hidden]");
  for (size_t i = 0; i < extend_lens.size(); ++i) {
    TORCH_CHECK(extend_lens[i] > 0 && prefix_lens[i] >= 0, "prefill_layers: request ", i,
                " has no new tokens or a negative prefix");
    TORCH_CHECK(pool_rows[i] >= 0 && pool_rows[i] < req_to_token.size(0) &&
                    prefix_lens[i] + extend_lens[i] <= req_to_token.size(1),
                "prefill_layers: request ", i, "'s pool row or length is outside req_to_token");
  }
  const Ops& o = ops();
  const int64_t tail = decode_tail(extend_lens);
  at::Tensor tail_pool = at::empty({tail}, at::kLong), tail_lens = at::empty({tail}, at::kLong);
  for (int64_t j = 0; j < tail; ++j) {
    const size_t i = extend_lens.size() - tail + j;
    tail_pool.data_ptr<int64_t>()[j] = pool_rows[i];
    tail_lens.data_ptr<int64_t>()[j] = prefix_lens[i] + 1;
  }
  const Attention attend{cos,          signed_sin,  k_caches,    v_caches,  out_cache_loc,
                         req_to_token, extend_lens, prefix_lens, pool_rows, num_heads,
                         num_kv_heads, scale,       softcap,     windows,   qk_norms,
                         qk_eps,       tail,        tail_pool,   tail_lens};
  Projections proj{{"prefill_layers", params, spec}};
  const int64_t rows = h.size(0);
  auto result = residual_layers(
      h, norms, eps, layers,
      [&](const at::Tensor& x, size_t l) {
        at::Tensor qkv;
        if (proj.apart()) {
          // three products joined for the attention, which reads them as one [T, heads, D]
          const at::Tensor q = proj.apply(x);
          const at::Tensor k = proj.apply(x);
          const at::Tensor v = proj.apply(x);
          qkv = at::cat({q, k, v}, 1);
        } else {
          qkv = proj.apply(x);
        }
        return proj.apply(attend(qkv, l));
      },
      [&](const at::Tensor& x) {
        if (proj.next_on_torch()) {
          // oneDNN's products: gate/up, silu_mul, down (native_layers.gate_up_silu's way)
          return proj.apply(o.silu_mul.call(proj.apply(x)));
        }
        const at::Tensor packed = proj.apply(x, /*silu=*/true, /*pack=*/true);
        return proj.apply(packed, false, false, rows);
      });
  proj.check_done();
  return result;
}

}  // namespace
}  // namespace sf

TORCH_LIBRARY_FRAGMENT(stallfree, m) {
  m.def(
      "prefill_layers(Tensor h, Tensor cos, Tensor signed_sin, Tensor(a!)[] k_caches, "
      "Tensor(b!)[] v_caches, Tensor out_cache_loc, Tensor req_to_token, int[] extend_lens, "
      "int[] prefix_lens, int[] pool_rows, int num_heads, int num_kv_heads, float? scale, "
      "Tensor[] norms, float eps, Tensor?[] params, int[] spec, float? softcap, int[] windows, "
      "Tensor[] qk_norms, float qk_eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(stallfree, CPU, m) { m.impl("prefill_layers", &sf::prefill_layers); }
// `--prepack-prompt-weights`' blocked copies are oneDNN tensors among `params`, which send the
// call to this backend's key
TORCH_LIBRARY_IMPL(stallfree, MkldnnCPU, m) { m.impl("prefill_layers", &sf::prefill_layers); }
