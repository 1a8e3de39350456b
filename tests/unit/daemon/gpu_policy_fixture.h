// The fixture of the GpuPolicy tests: a policy of one GPU, sessions whose
// streams are open, and batches built in a line.
#ifndef DELTAD_TESTS_UNIT_DAEMON_GPU_POLICY_FIXTURE_H_
#define DELTAD_TESTS_UNIT_DAEMON_GPU_POLICY_FIXTURE_H_

#include <cstdint>
#include <initializer_list>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "daemon/gpu_policy.h"
#include "gtest/gtest.h"

namespace deltad::daemon {

using Kind = v1::TensorEvent::Kind;
inline constexpr Kind kAccessed = v1::TensorEvent::ACCESSED;
inline constexpr Kind kFreed = v1::TensorEvent::FREED;
inline constexpr Kind kOffloaded = v1::TensorEvent::OFFLOADED;
inline constexpr Kind kReloaded = v1::TensorEvent::RELOADED;
inline constexpr Kind kEvicted = v1::TensorEvent::EVICTED;
inline constexpr Kind kRecomputed = v1::TensorEvent::RECOMPUTED;
inline constexpr Kind kReleaseFailed = v1::TensorEvent::RELEASE_FAILED;
inline constexpr Kind kHostCopied = v1::TensorEvent::HOST_COPIED;
inline constexpr Kind kHostCopyDropped = v1::TensorEvent::HOST_COPY_DROPPED;

inline constexpr SessionId kA = 1;
inline constexpr SessionId kB = 2;
inline constexpr SessionId kC = 3;
inline constexpr int64_t kPlentyHost = int64_t{1} << 40;

// With 1 GB/s each way a swap of b bytes costs about 2b ns: compute cost 0
// makes a tensor an eviction, 100 ns per byte an offload.
enum class Cost { kCheap, kCostly };

struct Flags {
  bool evict_pinned = false;
  bool offload_pinned = false;
  bool uncomputable = false;
};

inline void AddCreated(v1::EventBatch& batch, uint64_t id, int64_t bytes,
                       Cost cost = Cost::kCheap,
                       std::vector<uint64_t> parents = {}, Flags flags = {}) {
  v1::TensorCreated* c = batch.add_created();
  c->set_tensor_id(id);
  c->set_bytes(bytes);
  c->set_compute_cost_ns(cost == Cost::kCheap ? 0 : 100 * bytes);
  for (uint64_t p : parents) c->add_parent_ids(p);
  c->mutable_flags()->set_evict_pinned(flags.evict_pinned);
  c->mutable_flags()->set_offload_pinned(flags.offload_pinned);
  c->mutable_flags()->set_uncomputable(flags.uncomputable);
}

inline void AddEvent(v1::EventBatch& batch, int kind, uint64_t id) {
  v1::TensorEvent* e = batch.add_events();
  e->set_kind(static_cast<Kind>(kind));
  e->set_tensor_id(id);
}

inline v1::EventBatch Events(
    std::initializer_list<std::pair<Kind, uint64_t>> list) {
  v1::EventBatch batch;
  for (const auto& [kind, id] : list) AddEvent(batch, kind, id);
  return batch;
}

inline std::string UsageString(const SessionUsage& u) {
  return absl::StrCat("budget=", u.budget_bytes, " quota=", u.host_quota_bytes,
                      " device=", u.device_bytes, " host=", u.host_bytes,
                      " tensors=", u.tensors, " releases=", u.releases_ordered);
}

inline std::vector<uint64_t> Ids(const std::vector<v1::ReleaseOrder>& orders) {
  std::vector<uint64_t> ids;
  for (const v1::ReleaseOrder& o : orders) ids.push_back(o.tensor_id());
  return ids;
}

inline std::vector<uint64_t> Ids(const v1::Orders& orders) {
  std::vector<uint64_t> ids;
  for (const v1::ReleaseOrder& o : orders.release()) {
    ids.push_back(o.tensor_id());
  }
  return ids;
}

inline int64_t Bytes(const std::vector<v1::ReleaseOrder>& orders) {
  int64_t sum = 0;
  for (const v1::ReleaseOrder& o : orders) sum += o.bytes();
  return sum;
}

inline std::vector<SessionId> Keys(
    const std::map<SessionId, std::vector<v1::ReleaseOrder>>& orders) {
  std::vector<SessionId> keys;
  for (const auto& [id, list] : orders) keys.push_back(id);
  return keys;
}

inline GpuPolicyOptions Options() {
  GpuPolicyOptions o;
  o.link = {1e9, 1e9};
  return o;
}

class GpuPolicyTest : public ::testing::Test {
 protected:
  void Make(int64_t gpu_budget, GpuPolicyOptions options = Options()) {
    auto p = GpuPolicy::Create(0, gpu_budget, options);
    ASSERT_TRUE(p.ok()) << p.status();
    policy_ = std::move(*p);
  }
  void AddSession(SessionId s, int64_t budget, int64_t host = kPlentyHost) {
    const absl::Status status = policy_->AddSession(s, budget, host);
    ASSERT_TRUE(status.ok()) << status;
    // As if its stream were open: orders can reach it.
    ASSERT_TRUE(policy_->SetReachable(s, true).ok());
  }
  absl::Status Apply(SessionId s, const v1::EventBatch& batch) {
    now_ += 10;
    return policy_->Apply(s, batch, now_);
  }
  // `count` tensors with ids first, first+1, ..., one batch each so that
  // each is staler than the next.
  void Fill(SessionId s, uint64_t first, int count, int64_t bytes,
            Cost cost = Cost::kCheap, Flags flags = {}) {
    for (int i = 0; i < count; ++i) {
      v1::EventBatch batch;
      AddCreated(batch, first + static_cast<uint64_t>(i), bytes, cost, {},
                 flags);
      const absl::Status status = Apply(s, batch);
      ASSERT_TRUE(status.ok()) << status;
    }
  }
  SessionUsage U(SessionId s) const {
    auto u = policy_->Usage(s);
    EXPECT_TRUE(u.ok()) << u.status();
    return u.ok() ? *u : SessionUsage{};
  }
  std::string AllUsage() const {
    std::string out = absl::StrCat("gpu=", policy_->device_bytes());
    for (SessionId s : {kA, kB, kC}) {
      auto u = policy_->Usage(s);
      if (u.ok()) absl::StrAppend(&out, " | ", s, ": ", UsageString(*u));
    }
    return out;
  }
  absl::StatusOr<std::map<SessionId, std::vector<v1::ReleaseOrder>>> MakeRoom(
      SessionId s, int64_t bytes) {
    now_ += 10;
    return policy_->MakeRoom(s, bytes, now_);
  }
  std::map<SessionId, v1::Orders> Plan(SessionId s) {
    now_ += 10;
    return policy_->Plan(s, now_);
  }

  std::unique_ptr<GpuPolicy> policy_;
  int64_t now_ = 1000;
};

}  // namespace deltad::daemon

#endif  // DELTAD_TESTS_UNIT_DAEMON_GPU_POLICY_FIXTURE_H_
