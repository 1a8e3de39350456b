#ifndef DELTAD_TESTS_UNIT_POLICIES_TENSOR_TABLE_TEST_HELPERS_H_
#define DELTAD_TESTS_UNIT_POLICIES_TENSOR_TABLE_TEST_HELPERS_H_

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/types/span.h"
#include "gtest/gtest.h"
#include "policies/tensor.h"
#include "policies/tensor_table.h"
#include "tests/unit/policies/status_assertions.h"

namespace deltad::policy::testing_util {

inline constexpr TensorState kAllStates[] = {
    TensorState::kResident,  TensorState::kOffloading, TensorState::kOffloaded,
    TensorState::kReloading, TensorState::kEvicted,    TensorState::kFreed};

struct Expected {
  int64_t device = 0;
  int64_t releasing = 0;
  int64_t host = 0;
  int64_t evicted = 0;
  int64_t tensors = 0;
};

inline testing::AssertionResult StatsAre(const MemoryStats& s,
                                         const Expected& e) {
  if (s.device_bytes == e.device && s.releasing_bytes == e.releasing &&
      s.host_bytes == e.host && s.evicted_bytes == e.evicted &&
      s.tensors == e.tensors) {
    return testing::AssertionSuccess();
  }
  return testing::AssertionFailure()
         << "got device=" << s.device_bytes
         << " releasing=" << s.releasing_bytes << " host=" << s.host_bytes
         << " evicted=" << s.evicted_bytes << " tensors=" << s.tensors
         << "; want device=" << e.device << " releasing=" << e.releasing
         << " host=" << e.host << " evicted=" << e.evicted
         << " tensors=" << e.tensors;
}

// Stats of one 100-byte tensor in each state, written out by hand.
inline Expected StatsOf100In(TensorState state) {
  switch (state) {
    case TensorState::kResident:
      return {.device = 100, .tensors = 1};
    case TensorState::kOffloading:
      return {.device = 100, .releasing = 100, .host = 100, .tensors = 1};
    case TensorState::kOffloaded:
      return {.host = 100, .tensors = 1};
    case TensorState::kReloading:
      return {.device = 100, .host = 100, .tensors = 1};
    case TensorState::kEvicted:
      return {.evicted = 100, .tensors = 1};
    case TensorState::kFreed:
      return {};
  }
  return {};
}

inline Scope GpuScope(GpuId gpu) {
  Scope s;
  s.gpu = gpu;
  return s;
}

inline Scope SessionScope(GpuId gpu, SessionId session) {
  Scope s;
  s.gpu = gpu;
  s.session = session;
  return s;
}

inline TensorSpec Spec(TensorId id, int64_t bytes = 100,
                       std::vector<TensorId> parents = {},
                       SessionId session = 1, GpuId gpu = 0) {
  TensorSpec s;
  s.id = id;
  s.bytes = bytes;
  s.parents = std::move(parents);
  s.session = session;
  s.gpu = gpu;
  return s;
}

// Moves the resident tensor `id` to `state` through legal calls. kFreed is
// reached with Free(); the caller gives it a live child if it must stay.
inline void Reach(TensorTable& table, TensorId id, TensorState state) {
  switch (state) {
    case TensorState::kResident:
      return;
    case TensorState::kOffloading:
      ASSERT_TRUE(IsOk(table.SetState(id, TensorState::kOffloading)));
      return;
    case TensorState::kOffloaded:
      ASSERT_TRUE(IsOk(table.SetState(id, TensorState::kOffloading)));
      ASSERT_TRUE(IsOk(table.SetState(id, TensorState::kOffloaded)));
      return;
    case TensorState::kReloading:
      ASSERT_TRUE(IsOk(table.SetState(id, TensorState::kOffloading)));
      ASSERT_TRUE(IsOk(table.SetState(id, TensorState::kOffloaded)));
      ASSERT_TRUE(IsOk(table.SetState(id, TensorState::kReloading)));
      return;
    case TensorState::kEvicted:
      ASSERT_TRUE(IsOk(table.SetState(id, TensorState::kEvicted)));
      return;
    case TensorState::kFreed:
      ASSERT_TRUE(IsOk(table.Free(id)));
      return;
  }
}

inline std::vector<TensorId> Ids(const TensorTable& table,
                                 absl::Span<const uint32_t> slots) {
  std::vector<TensorId> ids;
  for (uint32_t s : slots) ids.push_back(table.AtSlot(s).id);
  std::sort(ids.begin(), ids.end());
  return ids;
}

inline TensorState StateOf(const TensorTable& table, TensorId id) {
  const Tensor* t = table.Find(id);
  EXPECT_NE(t, nullptr) << "tensor " << id;
  return t == nullptr ? TensorState::kFreed : t->state;
}

}  // namespace deltad::policy::testing_util

#endif  // DELTAD_TESTS_UNIT_POLICIES_TENSOR_TABLE_TEST_HELPERS_H_
