// What the two C++ layer loops (layers.cpp: a decode step's, prompt_layers.cpp: a prompt's)
// share: looking an operator up in the dispatcher once, and transformers' RMSNorm arithmetic
// on a view of heads through torch.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/rms_norm.h>

#include <optional>

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

}  // namespace sf
