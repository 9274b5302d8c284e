// CUDA multi-tensor Adam / AdamW: one launch per ~36 tensors or 320 chunks, whichever fills first.
//
// Params and both moments share one dtype (fp32, fp16 or bf16, as torch.optim.AdamW keeps them);
// grads may be any of the three, each multiplied by grad_scale in fp32 as it is read; the arithmetic is fp32 and
// follows torch's operation order exactly
// (the CPU kernel trades one division for a multiply, see includes/cpu_adam_kernel.h; a GPU is bound
// by memory, not by its dividers). Torch-free, so `nvcc -c` compiles it on a machine with neither a GPU
// nor a CUDA build of torch; adam/fused_adam_binding.cpp connects it to torch.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "fused_adam.h"
#include "multi_tensor_apply.cuh"

namespace zero_engine {
namespace {

// Elements per thread per iteration: four loads in flight per stream hide memory latency.
constexpr int kILP = 4;
constexpr int kBlockSize = 512;
// One block per 64 Ki elements: ~32 iterations of the block, and a 10M-element tensor spreads over
// ~150 blocks. Element offsets are int64 (chunk * kChunkSize), so tensors may exceed 2^31 elements.
constexpr int64_t kChunkSize = 1 << 16;

__device__ __forceinline__ float to_float(float value) { return value; }
__device__ __forceinline__ float to_float(__half value) { return __half2float(value); }
__device__ __forceinline__ float to_float(__nv_bfloat16 value) { return __bfloat162float(value); }

template <typename T>
__device__ __forceinline__ T from_float(float value);
template <>
__device__ __forceinline__ float from_float<float>(float value) {
  return value;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float value) {
  return __float2half_rn(value);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float value) {
  return __float2bfloat16_rn(value);
}

// kILP consecutive elements, loaded and stored as one vector access when aligned.
template <typename T>
struct alignas(sizeof(T) * kILP) Pack {
  T values[kILP];
};

template <typename T>
__device__ __forceinline__ bool is_pack_aligned(const void* pointer) {
  return reinterpret_cast<uintptr_t>(pointer) % sizeof(Pack<T>) == 0;
}

// IEEE division and square root (nvcc's defaults without --use_fast_math), as on the CPU. The gradient is
// scaled first and rounded alone (__fmul_rn: never contracted into an FMA with what follows), so the update is
// bitwise what an fp32 copy of it multiplied by grad_scale gives: a 16-bit gradient needs no such copy.
__device__ __forceinline__ void adam_update(float& param, float grad, float& exp_avg, float& exp_avg_sq,
                                            const FusedAdamArgs& args) {
  grad = __fmul_rn(grad, args.grad_scale);
  if (args.adamw_mode) {
    param *= args.decay_factor;
  } else {
    grad = fmaf(args.weight_decay, param, grad);
  }
  exp_avg = fmaf(1.0f - args.beta1, grad - exp_avg, exp_avg);
  exp_avg_sq = fmaf(1.0f - args.beta2, grad * grad, exp_avg_sq * args.beta2);
  const float denom = sqrtf(exp_avg_sq) / args.bias_correction2_sqrt + args.eps;
  param = fmaf(-args.step_size, exp_avg / denom, param);
}

template <typename ParamT, typename GradT>
struct AdamFunctor {
  __device__ __forceinline__ void operator()(int64_t chunk_size, const mta::TensorListMetadata<4>& meta,
                                             const FusedAdamArgs& args) const {
    const int tensor = meta.block_to_tensor[blockIdx.x];
    const int64_t offset = static_cast<int64_t>(meta.block_to_chunk[blockIdx.x]) * chunk_size;
    const int64_t remaining = meta.sizes[tensor] - offset;
    const int64_t n = remaining < chunk_size ? remaining : chunk_size;
    ParamT* param = static_cast<ParamT*>(meta.addresses[0][tensor]) + offset;
    const GradT* grad = static_cast<const GradT*>(meta.addresses[1][tensor]) + offset;
    ParamT* exp_avg = static_cast<ParamT*>(meta.addresses[2][tensor]) + offset;
    ParamT* exp_avg_sq = static_cast<ParamT*>(meta.addresses[3][tensor]) + offset;

    const bool vectorizable = n % kILP == 0 && is_pack_aligned<ParamT>(param) && is_pack_aligned<GradT>(grad) &&
                              is_pack_aligned<ParamT>(exp_avg) && is_pack_aligned<ParamT>(exp_avg_sq);
    if (vectorizable) {
      for (int64_t pack = threadIdx.x; pack * kILP < n; pack += blockDim.x) {
        Pack<ParamT> p = reinterpret_cast<const Pack<ParamT>*>(param)[pack];
        const Pack<GradT> g = reinterpret_cast<const Pack<GradT>*>(grad)[pack];
        Pack<ParamT> m = reinterpret_cast<const Pack<ParamT>*>(exp_avg)[pack];
        Pack<ParamT> v = reinterpret_cast<const Pack<ParamT>*>(exp_avg_sq)[pack];
#pragma unroll
        for (int k = 0; k < kILP; ++k) {
          float pf = to_float(p.values[k]);
          float mf = to_float(m.values[k]);
          float vf = to_float(v.values[k]);
          adam_update(pf, to_float(g.values[k]), mf, vf, args);
          p.values[k] = from_float<ParamT>(pf);
          m.values[k] = from_float<ParamT>(mf);
          v.values[k] = from_float<ParamT>(vf);
        }
        reinterpret_cast<Pack<ParamT>*>(param)[pack] = p;
        reinterpret_cast<Pack<ParamT>*>(exp_avg)[pack] = m;
        reinterpret_cast<Pack<ParamT>*>(exp_avg_sq)[pack] = v;
      }
      return;
    }
    // Unaligned or ragged chunk: strided element accesses, still kILP loads in flight per thread.
    for (int64_t base = 0; base < n; base += static_cast<int64_t>(blockDim.x) * kILP) {
      float pf[kILP], gf[kILP], mf[kILP], vf[kILP];
#pragma unroll
      for (int k = 0; k < kILP; ++k) {
        const int64_t i = base + threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
        if (i < n) {
          pf[k] = to_float(param[i]);
          gf[k] = to_float(grad[i]);
          mf[k] = to_float(exp_avg[i]);
          vf[k] = to_float(exp_avg_sq[i]);
        }
      }
#pragma unroll
      for (int k = 0; k < kILP; ++k) {
        const int64_t i = base + threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
        if (i < n) {
          adam_update(pf[k], gf[k], mf[k], vf[k], args);
          param[i] = from_float<ParamT>(pf[k]);
          exp_avg[i] = from_float<ParamT>(mf[k]);
          exp_avg_sq[i] = from_float<ParamT>(vf[k]);
        }
      }
    }
  }
};

template <typename ParamT, typename GradT>
int launch(int64_t num_tensors, void* const* params, void* const* grads, void* const* exp_avgs,
           void* const* exp_avg_sqs, const int64_t* numels, const FusedAdamArgs& args, cudaStream_t stream) {
  void* const* lists[4] = {params, grads, exp_avgs, exp_avg_sqs};
  return static_cast<int>(mta::multi_tensor_apply<4>(kChunkSize, kBlockSize, num_tensors, lists, numels, stream,
                                                       AdamFunctor<ParamT, GradT>{}, args));
}

template <typename ParamT>
int launch_for_grad(DType grad_dtype, int64_t num_tensors, void* const* params, void* const* grads,
                    void* const* exp_avgs, void* const* exp_avg_sqs, const int64_t* numels, const FusedAdamArgs& args,
                    cudaStream_t stream) {
  switch (grad_dtype) {
    case DType::kFloat32:
      return launch<ParamT, float>(num_tensors, params, grads, exp_avgs, exp_avg_sqs, numels, args, stream);
    case DType::kFloat16:
      return launch<ParamT, __half>(num_tensors, params, grads, exp_avgs, exp_avg_sqs, numels, args, stream);
    case DType::kBFloat16:
      return launch<ParamT, __nv_bfloat16>(num_tensors, params, grads, exp_avgs, exp_avg_sqs, numels, args, stream);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace

int fused_adam_launch(DType param_dtype, DType grad_dtype, int64_t num_tensors, void* const* params,
                      void* const* grads, void* const* exp_avgs, void* const* exp_avg_sqs, const int64_t* numels,
                      const FusedAdamArgs& args, void* stream) {
  const cudaStream_t cuda_stream = static_cast<cudaStream_t>(stream);
  switch (param_dtype) {
    case DType::kFloat32:
      return launch_for_grad<float>(grad_dtype, num_tensors, params, grads, exp_avgs, exp_avg_sqs, numels, args,
                                    cuda_stream);
    case DType::kFloat16:
      return launch_for_grad<__half>(grad_dtype, num_tensors, params, grads, exp_avgs, exp_avg_sqs, numels, args,
                                     cuda_stream);
    case DType::kBFloat16:
      return launch_for_grad<__nv_bfloat16>(grad_dtype, num_tensors, params, grads, exp_avgs, exp_avg_sqs, numels,
                                            args, cuda_stream);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

const char* fused_adam_error_string(int error) { return cudaGetErrorString(static_cast<cudaError_t>(error)); }

}  // namespace zero_engine
