// How multi-tensor apply splits tensors into launches: pure host C++, no CUDA, so that the
// scheduling (the subtle part: carrying a half-done tensor into the next launch) is tested on any
// machine by compiling this header with a plain C++ compiler (tests/test_ops.py does).
//
// Every tensor is cut into chunks of `chunk_size` elements; each chunk becomes one thread block.
// The addresses and sizes of the tensors in a launch, and the (tensor, chunk) of each block, travel
// in the kernel's argument buffer (TensorListMetadata), so a launch needs no device allocation and
// no copy before it. When the metadata is full (too many tensors or blocks for the argument buffer),
// the planner hands what it has to `launch` and carries an unfinished tensor over as slot 0 of the
// next launch.
#pragma once

#include <cstdint>

namespace zero_engine {
namespace mta {

// [Note: metadata size]
// Kernel arguments are limited to 4 KiB on every architecture and toolkit we support. For depth 4
// (param, grad, exp_avg, exp_avg_sq): 4 * 36 pointers (1152 B) + 36 sizes (288 B) + 320 block
// entries * 5 B (1600 B) = 3040 B, leaving room for the functor's own arguments.
template <int Depth>
struct Limits;
template <>
struct Limits<4> {
  static constexpr int kMaxTensors = 36;
  static constexpr int kMaxBlocks = 320;
};

template <int Depth>
struct TensorListMetadata {
  void* addresses[Depth][Limits<Depth>::kMaxTensors];
  int64_t sizes[Limits<Depth>::kMaxTensors];
  unsigned char block_to_tensor[Limits<Depth>::kMaxBlocks];
  int32_t block_to_chunk[Limits<Depth>::kMaxBlocks];
};

constexpr int kPlanInvalidArgument = -1;

// lists[d][t] is the t-th tensor's pointer in list d; numels[t] its element count (the same in every
// list). Calls `launch(meta, blocks)` once per launch, in order; a non-zero return from `launch`
// stops the plan and is returned. Returns 0 when every chunk was handed out.
template <int Depth, typename Launch>
int for_each_launch(int64_t chunk_size, int64_t num_tensors, void* const* const* lists, const int64_t* numels,
                    Launch&& launch) {
  constexpr int kMaxTensors = Limits<Depth>::kMaxTensors;
  constexpr int kMaxBlocks = Limits<Depth>::kMaxBlocks;
  if (chunk_size <= 0 || num_tensors < 0) {
    return kPlanInvalidArgument;
  }
  TensorListMetadata<Depth> meta;
  int slot = 0;
  int blocks = 0;
  for (int64_t t = 0; t < num_tensors; ++t) {
    const int64_t numel = numels[t];
    if (numel < 0) {
      return kPlanInvalidArgument;
    }
    if (numel == 0) {
      continue;
    }
    const int64_t chunks = (numel + chunk_size - 1) / chunk_size;
    if (chunks > INT32_MAX) {
      return kPlanInvalidArgument;  // over 2^31 chunks: raise chunk_size
    }
    for (int d = 0; d < Depth; ++d) {
      meta.addresses[d][slot] = lists[d][t];
    }
    meta.sizes[slot] = numel;
    for (int64_t chunk = 0; chunk < chunks; ++chunk) {
      meta.block_to_tensor[blocks] = static_cast<unsigned char>(slot);
      meta.block_to_chunk[blocks] = static_cast<int32_t>(chunk);
      ++blocks;
      const bool last_chunk = chunk == chunks - 1;
      const bool tensors_full = last_chunk && slot == kMaxTensors - 1;
      const bool blocks_full = blocks == kMaxBlocks;
      if (tensors_full || blocks_full) {
        const int status = launch(static_cast<const TensorListMetadata<Depth>&>(meta), blocks);
        if (status != 0) {
          return status;
        }
        blocks = 0;
        if (last_chunk) {
          slot = -1;  // the ++slot below starts the next launch at slot 0
        } else {
          // This tensor has chunks left: it becomes slot 0 of the next launch.
          for (int d = 0; d < Depth; ++d) {
            meta.addresses[d][0] = meta.addresses[d][slot];
          }
          meta.sizes[0] = meta.sizes[slot];
          slot = 0;
        }
      }
    }
    ++slot;
  }
  if (blocks > 0) {
    return launch(static_cast<const TensorListMetadata<Depth>&>(meta), blocks);
  }
  return 0;
}

}  // namespace mta
}  // namespace zero_engine
