// Checks multi_tensor_plan.h on the host: every chunk of every tensor is handed to exactly one
// block, with the right addresses and sizes, within the metadata limits. Built and run by
// tests/test_ops.py with a plain C++ compiler; exits non-zero and names the scenario on failure.
#include <cstdint>
#include <cstdio>
#include <vector>

#include "multi_tensor_plan.h"

using zero_engine::mta::for_each_launch;
using zero_engine::mta::kPlanInvalidArgument;
using zero_engine::mta::Limits;
using zero_engine::mta::TensorListMetadata;

namespace {

constexpr int kDepth = 4;
int failures = 0;

void fail(const char* scenario, const char* what, long long a, long long b) {
  if (failures < 20) {  // the first few say what is wrong; thousands more would not
    std::printf("%s: %s (%lld vs %lld)\n", scenario, what, a, b);
  }
  ++failures;
}

// A fake, never dereferenced address that encodes (tensor, list).
void* fake_address(int64_t tensor, int list) {
  return reinterpret_cast<void*>(static_cast<uintptr_t>((tensor + 1) * 8 + list));
}

// Plans `numels` in chunks of `chunk_size`; `fail_at_launch` > 0 makes that launch report error 7.
void check(const char* scenario, int64_t chunk_size, const std::vector<int64_t>& numels, int fail_at_launch = 0) {
  const int64_t count = static_cast<int64_t>(numels.size());
  std::vector<std::vector<void*>> lists(kDepth, std::vector<void*>(count));
  for (int d = 0; d < kDepth; ++d) {
    for (int64_t t = 0; t < count; ++t) {
      lists[d][t] = fake_address(t, d);
    }
  }
  void* const* pointers[kDepth] = {lists[0].data(), lists[1].data(), lists[2].data(), lists[3].data()};
  std::vector<std::vector<int>> seen(count);
  for (int64_t t = 0; t < count; ++t) {
    seen[t].assign(static_cast<size_t>((numels[t] + chunk_size - 1) / chunk_size), 0);
  }
  int launches = 0;
  const int status = for_each_launch<kDepth>(
      chunk_size, count, pointers, numels.data(), [&](const TensorListMetadata<kDepth>& meta, int blocks) -> int {
        ++launches;
        if (launches == fail_at_launch) {
          return 7;
        }
        if (blocks <= 0 || blocks > Limits<kDepth>::kMaxBlocks) {
          fail(scenario, "block count out of range", blocks, Limits<kDepth>::kMaxBlocks);
          return 0;
        }
        for (int b = 0; b < blocks; ++b) {
          const int slot = meta.block_to_tensor[b];
          if (slot >= Limits<kDepth>::kMaxTensors) {
            fail(scenario, "slot out of range", slot, Limits<kDepth>::kMaxTensors);
            continue;
          }
          const int64_t t = static_cast<int64_t>(reinterpret_cast<uintptr_t>(meta.addresses[0][slot]) / 8) - 1;
          if (t < 0 || t >= count) {
            fail(scenario, "unknown tensor address", t, count);
            continue;
          }
          for (int d = 1; d < kDepth; ++d) {
            if (meta.addresses[d][slot] != lists[d][t]) {
              fail(scenario, "lists disagree on the tensor of a slot", t, d);
            }
          }
          if (meta.sizes[slot] != numels[t]) {
            fail(scenario, "wrong size", meta.sizes[slot], numels[t]);
          }
          const int64_t chunk = meta.block_to_chunk[b];
          if (chunk < 0 || chunk >= static_cast<int64_t>(seen[t].size())) {
            fail(scenario, "chunk out of range", chunk, static_cast<long long>(seen[t].size()));
            continue;
          }
          ++seen[t][chunk];
        }
        return 0;
      });
  if (fail_at_launch > 0) {
    if (status != 7 || launches != fail_at_launch) {
      fail(scenario, "a launch error did not stop the plan", status, launches);
    }
    std::printf("%s: stopped at launch %d as asked\n", scenario, launches);
    return;
  }
  if (status != 0) {
    fail(scenario, "plan failed", status, 0);
  }
  for (int64_t t = 0; t < count; ++t) {
    for (size_t c = 0; c < seen[t].size(); ++c) {
      if (seen[t][c] != 1) {
        fail(scenario, "chunk not covered exactly once (tensor, chunk)", t, static_cast<long long>(c));
      }
    }
  }
  std::printf("%s: %d launches\n", scenario, launches);
}

}  // namespace

int main() {
  check("empty list", 4, {});
  check("one element", 4, {1});
  std::vector<int64_t> small;
  for (int i = 0; i < 100; ++i) small.push_back(1 + i % 7);
  check("100 small tensors (tensor limit)", 4, small);
  check("exactly 36 tensors", 4, std::vector<int64_t>(36, 4));
  check("one tensor over several launches (carry-over)", 4, {4 * 1000 + 3});
  check("empty tensors between others", 4, {0, 5, 0, 0, 9, 0});
  check("block limit reached on a last chunk", 4, {4 * 320, 4 * 320, 3});
  check("block limit reached mid-tensor after others", 4, {7, 4 * 400 + 1, 2, 4 * 319});
  std::vector<int64_t> mixed;
  for (int i = 0; i < 200; ++i) mixed.push_back(static_cast<int64_t>(i * 37 % 997) * (i % 3 == 0 ? 50 : 1));
  check("200 mixed tensors", 4, mixed);
  check("a launch error stops the plan", 4, small, 2);

  const int64_t numel = 8;
  void* address = fake_address(0, 0);
  void* const list[1] = {address};
  void* const* lists[kDepth] = {list, list, list, list};
  const int status = for_each_launch<kDepth>(0, 1, lists, &numel, [](const TensorListMetadata<kDepth>&, int) { return 0; });
  if (status != kPlanInvalidArgument) {
    fail("chunk size 0", "not rejected", status, kPlanInvalidArgument);
  }
  std::printf(failures == 0 ? "all scenarios passed\n" : "%d FAILURES\n", failures);
  return failures == 0 ? 0 : 1;
}
