// Multi-tensor apply: one kernel launch updates many tensors.
//
// multi_tensor_plan.h decides which chunks of which tensors go into each launch (and is tested on
// machines without CUDA); this header launches one thread block per chunk with the plan's metadata
// as a kernel argument. Torch-free and compiled standalone by nvcc; the torch binding hands in raw
// pointers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "multi_tensor_plan.h"

namespace zero_engine {
namespace mta {

// __grid_constant__ lets the kernel read the metadata straight from the argument buffer instead of
// copying it to local memory when the functor takes its address.
template <int Depth, typename Functor, typename Args>
__global__ void multi_tensor_kernel(int64_t chunk_size, const __grid_constant__ TensorListMetadata<Depth> meta,
                                    Functor functor, const Args args) {
  functor(chunk_size, meta, args);
}

// Returns the first launch error, or cudaSuccess. See for_each_launch for the arguments.
template <int Depth, typename Functor, typename Args>
cudaError_t multi_tensor_apply(int64_t chunk_size, int block_size, int64_t num_tensors,
                               void* const* const* lists, const int64_t* numels, cudaStream_t stream,
                               Functor functor, const Args& args) {
  if (block_size <= 0) {
    return cudaErrorInvalidValue;
  }
  const int status = for_each_launch<Depth>(
      chunk_size, num_tensors, lists, numels, [&](const TensorListMetadata<Depth>& meta, int blocks) -> int {
        // The kernel arguments (meta included) are copied at launch, so the planner may reuse meta.
        multi_tensor_kernel<Depth><<<blocks, block_size, 0, stream>>>(chunk_size, meta, functor, args);
        return static_cast<int>(cudaGetLastError());
      });
  return status == kPlanInvalidArgument ? cudaErrorInvalidValue : static_cast<cudaError_t>(status);
}

}  // namespace mta
}  // namespace zero_engine
