// What the two C++ layer loops (layers.cpp: a decode step's, prompt_layers.cpp: a prompt's)
// share: looking an operator up in the dispatcher once, reading the projections' tensors off
// their plan, the checks on the per-layer lists, the residual stream through the layers, and
// transformers' RMSNorm arithmetic on a view of heads through torch.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/rms_norm.h>

#include <optional>
#include <tuple>
#include <vector>

namespace sf {

// The typed handle of the operator `name` (the overload ""), for calls through the
// dispatcher, as Python's calls go: the profiler and dispatch modes see each one
template <class Sig>
c10::TypedOperatorHandle<Sig> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// `RMSNorm.forward` (llama.py) on heads [T, heads, D] that the native kernel does not take (a
// strided view of the projection): float32 statistics, the weight applied in the dtype
// (native_layers.rms_norm_reference), torch's own float32 norm for float32
inline at::Tensor head_norm_reference(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (x.scalar_type() == at::kFloat) return at::rms_norm(x, weight.sizes(), weight, eps);
  const at::Tensor h = at::rms_norm(x.to(at::kFloat), {x.size(-1)}, std::nullopt, eps);
  return at::mul(weight, h.to(x.scalar_type()));
}

// A loop's projections' tensors read off `params` in order, and their kinds off `spec` (the
// plan runtime/model/native_loop.py or native_prompt_loop.py builds); `op` names the loop in
// errors
struct PlanCursor {
  const char* op;
  const c10::List<std::optional<at::Tensor>>& params;
  const std::vector<int64_t>& spec;
  size_t p = 0, s = 0;

  std::optional<at::Tensor> maybe(const char* what = "a bias") {
    TORCH_CHECK(p < params.size(), op, ": params ran out at ", what);
    return params.get(p++);
  }
  at::Tensor need(const char* what) {
    std::optional<at::Tensor> t = maybe(what);
    TORCH_CHECK(t.has_value(), op, ": ", what, " is missing");
    return *t;
  }
  // the next projection's kind, taken off the spec
  int64_t kind() {
    TORCH_CHECK(s < spec.size(), op, ": spec ran out");
    return spec[s++];
  }
  void check_done() const {
    TORCH_CHECK(p == params.size() && s == spec.size(), op,
                ": params or spec left over after the last layer");
  }
};

// The per-layer lists both loops take: a K and V cache and two norms a layer, and none or one
// window, none or two q/k norms a layer
inline void check_layer_lists(const char* op, size_t layers, size_t v_caches, size_t norms,
                              size_t windows, size_t qk_norms) {
  TORCH_CHECK(v_caches == layers && norms == 2 * layers, op,
              ": expected a K and V cache and two norms per layer");
  TORCH_CHECK(windows == 0 || windows == layers, op, ": expected no windows or one per layer");
  TORCH_CHECK(qk_norms == 0 || qk_norms == 2 * layers, op,
              ": expected no q/k norms or two per layer");
}

// `fused_forward`'s residual stream through `layers` layers (llama.py): the first layer's
// RMSNorm, or add + RMSNorm of the last layer's output; `attend(x, l)` to the output
// projection's result; add + RMSNorm; `mlp(x)`. Returns (the last layer's output, the residual
// stream before it), as the Python loop does.
template <class Attend, class Mlp>
std::tuple<at::Tensor, at::Tensor> residual_layers(const at::Tensor& h,
                                                   const std::vector<at::Tensor>& norms,
                                                   double eps, size_t layers, Attend attend,
                                                   Mlp mlp) {
  using Norm = at::Tensor(const at::Tensor&, const at::Tensor&, double);
  using AddNorm = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                     const at::Tensor&, double);
  static const auto rms_norm = find_op<Norm>("stallfree::rms_norm");
  static const auto add_rms_norm = find_op<AddNorm>("stallfree::add_rms_norm");
  at::Tensor x, residual, out = h;
  for (size_t l = 0; l < layers; ++l) {
    if (l == 0) {
      residual = out;
      x = rms_norm.call(out, norms[0], eps);
    } else {
      std::tie(residual, x) = add_rms_norm.call(residual, out, norms[2 * l], eps);
    }
    const at::Tensor attn = attend(x, l);
    std::tie(residual, x) = add_rms_norm.call(residual, attn, norms[2 * l + 1], eps);
    out = mlp(x);
  }
  return {out, residual};
}

}  // namespace sf
