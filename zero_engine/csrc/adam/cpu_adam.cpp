// Torch binding of the CPU Adam kernel: checks tensors, splits them into tiles, runs the tiles in
// parallel with OpenMP and dispatches each to the kernel instance for its grad / copy dtypes.
//
// Registered as a torch operator library (TORCH_LIBRARY) instead of a pybind11 module: it needs
// only <torch/library.h>, which compiles in seconds where <torch/extension.h> takes half a minute,
// and needs no Python headers. The namespace comes from the builder (-DZE_OP_NAMESPACE=...) so
// that the AVX-512, AVX2 and scalar builds can be loaded side by side in one process.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cpu_adam_kernel.h"

#ifndef ZE_OP_NAMESPACE
#define ZE_OP_NAMESPACE zero_engine_cpu_adam
#endif
// Indirection so that ZE_OP_NAMESPACE is expanded before TORCH_LIBRARY pastes it into names.
#define ZE_TORCH_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)

namespace zero_engine {
namespace {

enum class Elem { kNone, kFloat, kBF16, kFP16 };

// [Note: tile size]
// 32768 fp32 elements = 128 KiB per stream: large enough that the per-tile overhead vanishes and
// the hardware prefetchers run at full speed, small enough that 1M parameters still make 32 tiles
// to share between threads. Tiles never straddle tensors, and every tile but a tensor's last is a
// multiple of any vector width, so only the very end of each tensor takes the scalar tail.
constexpr int64_t kTileElements = 1 << 15;
// Below this many elements in a call, starting a parallel region costs more than it saves.
constexpr int64_t kParallelMinElements = 1 << 16;

struct TensorSlots {
  float* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  void* copy;
  Elem grad_elem;
  Elem copy_elem;
};

struct Tile {
  int64_t tensor;
  int64_t begin;
  int64_t length;
};

Elem elem_of(const at::Tensor& tensor) {
  switch (tensor.scalar_type()) {
    case at::ScalarType::Float:
      return Elem::kFloat;
    case at::ScalarType::BFloat16:
      return Elem::kBF16;
    case at::ScalarType::Half:
      return Elem::kFP16;
    default:
      return Elem::kNone;
  }
}

void check_companion(const at::Tensor& tensor, const at::Tensor& param, const char* what, size_t index) {
  TORCH_CHECK(tensor.device().is_cpu(), "cpu_adam: ", what, "[", index, "] must be on the CPU, got ",
              tensor.device());
  TORCH_CHECK(tensor.is_contiguous(), "cpu_adam: ", what, "[", index, "] must be contiguous");
  TORCH_CHECK(tensor.numel() == param.numel(), "cpu_adam: ", what, "[", index, "] has ", tensor.numel(),
              " elements but its parameter has ", param.numel());
}

std::vector<TensorSlots> check_and_collect(at::TensorList params, at::TensorList grads,
                                           at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                                           const c10::List<std::optional<at::Tensor>>& copies) {
  const size_t count = params.size();
  TORCH_CHECK(grads.size() == count && exp_avgs.size() == count && exp_avg_sqs.size() == count &&
                  copies.size() == count,
              "cpu_adam: tensor lists differ in length (params ", count, ", grads ", grads.size(),
              ", exp_avgs ", exp_avgs.size(), ", exp_avg_sqs ", exp_avg_sqs.size(), ", copies ",
              copies.size(), ")");
  std::vector<TensorSlots> slots;
  slots.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    const at::Tensor& param = params[i];
    TORCH_CHECK(param.device().is_cpu() && param.scalar_type() == at::ScalarType::Float,
                "cpu_adam: params[", i, "] must be an fp32 CPU tensor, got ", param.scalar_type(), " on ",
                param.device());
    TORCH_CHECK(param.is_contiguous(), "cpu_adam: params[", i, "] must be contiguous");
    check_companion(grads[i], param, "grads", i);
    check_companion(exp_avgs[i], param, "exp_avgs", i);
    check_companion(exp_avg_sqs[i], param, "exp_avg_sqs", i);
    TORCH_CHECK(exp_avgs[i].scalar_type() == at::ScalarType::Float &&
                    exp_avg_sqs[i].scalar_type() == at::ScalarType::Float,
                "cpu_adam: exp_avgs[", i, "] and exp_avg_sqs[", i, "] must be fp32");
    const Elem grad_elem = elem_of(grads[i]);
    TORCH_CHECK(grad_elem != Elem::kNone, "cpu_adam: grads[", i, "] must be fp32, bf16 or fp16, got ",
                grads[i].scalar_type());

    TensorSlots slot{param.data_ptr<float>(), grads[i].data_ptr(), exp_avgs[i].data_ptr<float>(),
                     exp_avg_sqs[i].data_ptr<float>(), nullptr, grad_elem, Elem::kNone};
    const std::optional<at::Tensor> copy = copies.get(i);
    if (copy.has_value()) {
      check_companion(*copy, param, "low_precision_copies", i);
      slot.copy_elem = elem_of(*copy);
      TORCH_CHECK(slot.copy_elem == Elem::kBF16 || slot.copy_elem == Elem::kFP16,
                  "cpu_adam: low_precision_copies[", i, "] must be bf16 or fp16, got ", copy->scalar_type());
      slot.copy = copy->data_ptr();
    }
    slots.push_back(slot);
  }
  return slots;
}

template <typename GradT>
void run_tile_with_grad(const TensorSlots& t, int64_t begin, int64_t length, const AdamScalars& s) {
  float* param = t.param + begin;
  const GradT* grad = static_cast<const GradT*>(t.grad) + begin;
  float* exp_avg = t.exp_avg + begin;
  float* exp_avg_sq = t.exp_avg_sq + begin;
  switch (t.copy_elem) {
    case Elem::kBF16:
      adam_update_range<GradT, BF16>(param, grad, exp_avg, exp_avg_sq, static_cast<BF16*>(t.copy) + begin,
                                     length, s);
      break;
    case Elem::kFP16:
      adam_update_range<GradT, FP16>(param, grad, exp_avg, exp_avg_sq, static_cast<FP16*>(t.copy) + begin,
                                     length, s);
      break;
    default:
      adam_update_range<GradT, void>(param, grad, exp_avg, exp_avg_sq, nullptr, length, s);
      break;
  }
}

void run_tile(const TensorSlots& t, int64_t begin, int64_t length, const AdamScalars& s) {
  switch (t.grad_elem) {
    case Elem::kBF16:
      run_tile_with_grad<BF16>(t, begin, length, s);
      break;
    case Elem::kFP16:
      run_tile_with_grad<FP16>(t, begin, length, s);
      break;
    default:
      run_tile_with_grad<float>(t, begin, length, s);
      break;
  }
}

AdamScalars make_scalars(int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay,
                         bool adamw_mode, bool bias_correction, double grad_scale) {
  TORCH_CHECK(step >= 1, "cpu_adam: step must be >= 1 (the count including this update), got ", step);
  // Computed in double and rounded once, as torch computes them in Python floats.
  const double bias_correction1 = bias_correction ? 1.0 - std::pow(beta1, static_cast<double>(step)) : 1.0;
  const double bias_correction2 = bias_correction ? 1.0 - std::pow(beta2, static_cast<double>(step)) : 1.0;
  AdamScalars s{};
  s.beta1 = static_cast<float>(beta1);
  s.beta2 = static_cast<float>(beta2);
  s.eps = static_cast<float>(eps);
  s.weight_decay = static_cast<float>(weight_decay);
  s.decay_factor = static_cast<float>(1.0 - lr * weight_decay);
  s.step_size = static_cast<float>(lr / bias_correction1);
  s.inv_bias_correction2_sqrt = static_cast<float>(1.0 / std::sqrt(bias_correction2));
  s.grad_scale = static_cast<float>(grad_scale);
  s.adamw_mode = adamw_mode;
  return s;
}

// One Adam step over every tensor in the lists, all at the same step count.
void adam_step(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
               const c10::List<std::optional<at::Tensor>>& low_precision_copies, int64_t step, double lr,
               double beta1, double beta2, double eps, double weight_decay, bool adamw_mode, bool bias_correction,
               double grad_scale, int64_t num_threads) {
  const std::vector<TensorSlots> slots = check_and_collect(params, grads, exp_avgs, exp_avg_sqs, low_precision_copies);
  const AdamScalars scalars =
      make_scalars(step, lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction, grad_scale);

  std::vector<Tile> tiles;
  int64_t total_elements = 0;
  for (size_t i = 0; i < slots.size(); ++i) {
    const int64_t numel = params[i].numel();
    total_elements += numel;
    for (int64_t begin = 0; begin < numel; begin += kTileElements) {
      tiles.push_back(Tile{static_cast<int64_t>(i), begin, std::min(kTileElements, numel - begin)});
    }
  }
  const int threads = num_threads > 0 ? static_cast<int>(num_threads) : omp_get_max_threads();
  const int64_t tile_count = static_cast<int64_t>(tiles.size());
  // All checks are done above: nothing inside the parallel region can throw.
  // Static schedule: each thread streams one contiguous range, the same split torch's parallel fill
  // used when the state was first touched, which keeps pages local on multi-socket machines.
#pragma omp parallel for schedule(static) num_threads(threads) if (total_elements >= kParallelMinElements && threads > 1)
  for (int64_t k = 0; k < tile_count; ++k) {
    const Tile& tile = tiles[k];
    run_tile(slots[tile.tensor], tile.begin, tile.length, scalars);
  }
}

std::string kernel_info() {
  return std::string(simd::kName) + " (" + std::to_string(simd::kWidth) + " fp32 lanes), OpenMP max " +
         std::to_string(omp_get_max_threads()) + " threads";
}

}  // namespace
}  // namespace zero_engine

ZE_TORCH_LIBRARY(ZE_OP_NAMESPACE, m) {
  m.def(
      "adam_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)?[] low_precision_copies, int step, float lr, float beta1, float beta2, float eps, "
      "float weight_decay, bool adamw_mode, bool bias_correction, float grad_scale, int num_threads) -> ()",
      &zero_engine::adam_step);
  m.def("kernel_info() -> str", &zero_engine::kernel_info);
}
