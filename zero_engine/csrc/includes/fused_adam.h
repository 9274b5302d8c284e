// Host-side interface of the CUDA multi-tensor Adam (adam/fused_adam.cu).
//
// Free of torch and of CUDA headers, so that the torch binding (a plain C++ file) and the kernels
// (a torch-free .cu that nvcc compiles standalone) meet only here.
#pragma once

#include <cstdint>

namespace zero_engine {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

struct FusedAdamArgs {
  float beta1;
  float beta2;
  float eps;
  float weight_decay;           // Adam mode: g += wd * p
  float decay_factor;           // AdamW mode: p *= 1 - lr * wd
  float step_size;              // lr / (1 - beta1^t), or lr without bias correction
  float bias_correction2_sqrt;  // sqrt(1 - beta2^t), or 1 without bias correction
  int adamw_mode;               // 1: decoupled weight decay (AdamW), 0: L2 added to the gradient (Adam)
  float grad_scale;             // each gradient is first multiplied by it in fp32 (ZeRO's unscale and clip)
};

// One Adam step over `num_tensors` tensors on the current device. Every list holds one device
// pointer per tensor; params, exp_avgs and exp_avg_sqs are of `param_dtype`, grads of `grad_dtype`;
// numels[t] is the element count of tensor t (64-bit: tensors may exceed 2^31 elements). `stream`
// is a cudaStream_t. Returns a cudaError_t value (0 on success); see fused_adam_error_string.
int fused_adam_launch(DType param_dtype, DType grad_dtype, int64_t num_tensors, void* const* params,
                      void* const* grads, void* const* exp_avgs, void* const* exp_avg_sqs, const int64_t* numels,
                      const FusedAdamArgs& args, void* stream);

const char* fused_adam_error_string(int error);

}  // namespace zero_engine
