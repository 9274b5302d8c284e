// Torch binding of the CUDA multi-tensor Adam: checks the tensor lists, turns them into pointer
// arrays and launches on torch's current stream. The kernels live in fused_adam.cu, which includes
// no torch header (see includes/fused_adam.h).
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "fused_adam.h"

#ifndef ZE_OP_NAMESPACE
#define ZE_OP_NAMESPACE zero_engine_fused_adam
#endif
#define ZE_TORCH_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)

namespace zero_engine {
namespace {

DType dtype_of(const at::Tensor& tensor, const char* what, size_t index) {
  switch (tensor.scalar_type()) {
    case at::ScalarType::Float:
      return DType::kFloat32;
    case at::ScalarType::Half:
      return DType::kFloat16;
    case at::ScalarType::BFloat16:
      return DType::kBFloat16;
    default:
      TORCH_CHECK(false, "fused_adam: ", what, "[", index, "] must be fp32, fp16 or bf16, got ",
                  tensor.scalar_type());
  }
  return DType::kFloat32;  // unreachable
}

void check_like(const at::Tensor& tensor, const at::Tensor& param, const char* what, size_t index) {
  TORCH_CHECK(tensor.device() == param.device(), "fused_adam: ", what, "[", index, "] is on ", tensor.device(),
              " but its parameter is on ", param.device());
  TORCH_CHECK(tensor.is_contiguous(), "fused_adam: ", what, "[", index, "] must be contiguous");
  TORCH_CHECK(tensor.numel() == param.numel(), "fused_adam: ", what, "[", index, "] has ", tensor.numel(),
              " elements but its parameter has ", param.numel());
}

// One Adam step over tensors that share a device, a param dtype, a grad dtype and a step count
// (the Python side groups them so).
void adam_step(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
               int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw_mode,
               bool bias_correction, double grad_scale) {
  const size_t count = params.size();
  TORCH_CHECK(grads.size() == count && exp_avgs.size() == count && exp_avg_sqs.size() == count,
              "fused_adam: tensor lists differ in length (params ", count, ", grads ", grads.size(), ", exp_avgs ",
              exp_avgs.size(), ", exp_avg_sqs ", exp_avg_sqs.size(), ")");
  TORCH_CHECK(step >= 1, "fused_adam: step must be >= 1 (the count including this update), got ", step);
  if (count == 0) {
    return;
  }
  const at::Device device = params[0].device();
  TORCH_CHECK(device.is_cuda(), "fused_adam: params[0] must be on a CUDA device, got ", device);
  const DType param_dtype = dtype_of(params[0], "params", 0);
  const DType grad_dtype = dtype_of(grads[0], "grads", 0);

  std::vector<void*> param_ptrs(count), grad_ptrs(count), exp_avg_ptrs(count), exp_avg_sq_ptrs(count);
  std::vector<int64_t> numels(count);
  for (size_t i = 0; i < count; ++i) {
    const at::Tensor& param = params[i];
    TORCH_CHECK(param.device() == device, "fused_adam: params[", i, "] is on ", param.device(), ", params[0] on ",
                device, "; one call takes one device");
    TORCH_CHECK(param.is_contiguous(), "fused_adam: params[", i, "] must be contiguous");
    TORCH_CHECK(dtype_of(param, "params", i) == param_dtype && dtype_of(exp_avgs[i], "exp_avgs", i) == param_dtype &&
                    dtype_of(exp_avg_sqs[i], "exp_avg_sqs", i) == param_dtype,
                "fused_adam: params[", i, "] and its moments must have params[0]'s dtype ", params[0].scalar_type());
    TORCH_CHECK(dtype_of(grads[i], "grads", i) == grad_dtype, "fused_adam: grads[", i, "] is ",
                grads[i].scalar_type(), " but grads[0] is ", grads[0].scalar_type(), "; one call takes one grad dtype");
    check_like(grads[i], param, "grads", i);
    check_like(exp_avgs[i], param, "exp_avgs", i);
    check_like(exp_avg_sqs[i], param, "exp_avg_sqs", i);
    param_ptrs[i] = param.data_ptr();
    grad_ptrs[i] = const_cast<void*>(grads[i].const_data_ptr());
    exp_avg_ptrs[i] = exp_avgs[i].data_ptr();
    exp_avg_sq_ptrs[i] = exp_avg_sqs[i].data_ptr();
    numels[i] = param.numel();
  }

  // Computed in double and rounded once, as torch computes them in Python floats.
  const double bias_correction1 = bias_correction ? 1.0 - std::pow(beta1, static_cast<double>(step)) : 1.0;
  const double bias_correction2 = bias_correction ? 1.0 - std::pow(beta2, static_cast<double>(step)) : 1.0;
  FusedAdamArgs args{};
  args.beta1 = static_cast<float>(beta1);
  args.beta2 = static_cast<float>(beta2);
  args.eps = static_cast<float>(eps);
  args.weight_decay = static_cast<float>(weight_decay);
  args.decay_factor = static_cast<float>(1.0 - lr * weight_decay);
  args.step_size = static_cast<float>(lr / bias_correction1);
  args.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  args.adamw_mode = adamw_mode ? 1 : 0;
  args.grad_scale = static_cast<float>(grad_scale);  // as torch's mul_ by a Python float on an fp32 tensor

  const c10::cuda::CUDAGuard device_guard(device);
  const int error = fused_adam_launch(param_dtype, grad_dtype, static_cast<int64_t>(count), param_ptrs.data(),
                                      grad_ptrs.data(), exp_avg_ptrs.data(), exp_avg_sq_ptrs.data(), numels.data(),
                                      args, c10::cuda::getCurrentCUDAStream(device.index()).stream());
  TORCH_CHECK(error == 0, "fused_adam: kernel launch failed: ", fused_adam_error_string(error));
}

}  // namespace
}  // namespace zero_engine

ZE_TORCH_LIBRARY(ZE_OP_NAMESPACE, m) {
  m.def(
      "adam_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, int step, "
      "float lr, float beta1, float beta2, float eps, float weight_decay, bool adamw_mode, bool bias_correction, "
      "float grad_scale) -> ()",
      &zero_engine::adam_step);
}
