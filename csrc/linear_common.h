// Argument handling shared by the CPU linear kernels (skinny_linear.cpp, packed_linear.cpp): both
// compute y [M, N] = x [M, K] . W^T + b with x, W and b in one dtype, accumulate in fp32 and round
// once to that dtype.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace specdec::linear {

// The weight's dtype, checked to be fp32/bf16/fp16 and shared by x; `op` prefixes the messages.
inline at::ScalarType check_dtypes(const char* op, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), op, ": tensors must be on the CPU");
  TORCH_CHECK(x.dim() == 2, op, ": x must be [M, K], got shape ", x.sizes());
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              ": weight must be fp32, bf16 or fp16, got ", dtype);
  TORCH_CHECK(x.scalar_type() == dtype, op, ": x dtype ", x.scalar_type(), " differs from weight dtype ", dtype);
  return dtype;
}

// The bias as contiguous fp32 [n], or an undefined tensor when there is none.
inline at::Tensor bias_fp32(const char* op, const std::optional<at::Tensor>& bias, int64_t n, at::ScalarType dtype) {
  if (!bias.has_value() || !bias->defined()) return {};
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, op, ": bias must be [N = ", n, "], got ", bias->sizes());
  TORCH_CHECK(bias->scalar_type() == dtype, op, ": bias dtype ", bias->scalar_type(), " differs from weight dtype ",
              dtype);
  return bias->to(at::kFloat).contiguous();
}

// The rows of a contiguous x as fp32: in place when they already are, otherwise widened into a
// per-thread buffer (an at::Tensor here costs more than a whole one-row product). Valid until the
// calling thread's next call.
inline const float* rows_fp32(const at::Tensor& xc) {
  if (xc.scalar_type() == at::kFloat) return xc.const_data_ptr<float>();
  thread_local std::vector<float> widened;
  const int64_t n = xc.numel();
  widened.resize(static_cast<size_t>(n));
  AT_DISPATCH_REDUCED_FLOATING_TYPES(xc.scalar_type(), "linear_widen", [&] {
    const auto* src = xc.const_data_ptr<scalar_t>();
    for (int64_t i = 0; i < n; ++i) widened[i] = static_cast<float>(src[i]);
  });
  return widened.data();
}

// Calls f(scalar_t{}) for the weight dtype, which check_dtypes has limited to fp32, bf16 and fp16
// (AT_DISPATCH would also instantiate the kernels for fp64).
template <typename F>
void dispatch_weight_dtype(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(at::BFloat16{});
    default: return f(at::Half{});
  }
}

}  // namespace specdec::linear
