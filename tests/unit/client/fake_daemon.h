#ifndef DELTAD_TESTS_UNIT_CLIENT_FAKE_DAEMON_H_
#define DELTAD_TESTS_UNIT_CLIENT_FAKE_DAEMON_H_

// A daemon of the test's own behind the client's DaemonLink seam
// (ClientOptions::open_link): it opens one session with a fixed budget,
// grants host slabs and device chunks as memfds (as the sim backend does),
// and hands out chunks past the budget at a pace the test sets, as a GPU
// does while other sessions release for this one. No gRPC, no socket: the
// client's own rounds are what the test sees.

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/daemon_link.h"
#include "common/side_protocol.h"
#include "common/unix_socket.h"

namespace deltad::client::testing_util {

struct FakeDaemonOptions {
  int64_t budget_bytes = 0;
  int64_t chunk_bytes = int64_t{2} << 20;
  int64_t slab_bytes = int64_t{16} << 20;
  // Chunks each call may grant past the budget (the budget's own come at
  // once); 0: none past it.
  int chunks_per_fetch_past_budget = 1;
};

// What the daemon saw, for the test's checks.
struct FakeDaemonCounts {
  std::atomic<int64_t> fetches{0};
  std::atomic<int64_t> chunks_granted{0};
};

// Every Release answers that room was found (others released for this
// session) and orders nothing: no order ever comes on its stream.
class FakeDaemonLink final : public DaemonLink {
 public:
  FakeDaemonLink(const FakeDaemonOptions& options, FakeDaemonCounts* counts,
                 LostFn on_lost)
      : options_(options), counts_(counts), on_lost_(std::move(on_lost)) {
    session_.set_session_token("fake-token");
    session_.set_session_id(1);
    session_.set_granted_budget_bytes(options.budget_bytes);
    session_.set_host_quota_bytes(options.slab_bytes);
    session_.set_backend("sim");
    session_.set_chunk_bytes(options.chunk_bytes);
    session_.set_lease_ms(60000);
  }

  const v1::OpenSessionResponse& session() const override { return session_; }
  int gpu() const override { return 0; }
  std::vector<common::side::Grant> TakeSlabs() override {
    std::vector<common::side::Grant> slabs;
    if (slab_taken_) return slabs;
    slab_taken_ = true;
    slabs.push_back(Memfd(next_id_++, options_.slab_bytes));
    return slabs;
  }
  absl::StatusOr<std::vector<common::side::Grant>> FetchChunks(
      int64_t target_bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++counts_->fetches;
    std::vector<common::side::Grant> chunks;
    int past_budget = 0;
    while (held_ + options_.chunk_bytes <= target_bytes) {
      if (held_ + options_.chunk_bytes > options_.budget_bytes &&
          past_budget++ >= options_.chunks_per_fetch_past_budget) {
        break;
      }
      chunks.push_back(Memfd(next_id_++, options_.chunk_bytes));
      if (!chunks.back().fd.valid()) {
        return absl::InternalError("memfd_create failed");
      }
      held_ += options_.chunk_bytes;
      ++counts_->chunks_granted;
    }
    return chunks;
  }
  absl::Status ReturnChunks(const std::vector<uint64_t>& ids) override {
    std::lock_guard<std::mutex> lock(mu_);
    held_ -= static_cast<int64_t>(ids.size()) * options_.chunk_bytes;
    return absl::OkStatus();
  }
  absl::Status Send(const v1::EventBatch&) override {
    return alive_ ? absl::OkStatus()
                  : absl::UnavailableError("the fake session ended");
  }
  absl::StatusOr<v1::ReleaseResponse> Release(int64_t, const v1::EventBatch&,
                                              uint64_t) override {
    v1::ReleaseResponse r;
    r.set_room_available(true);
    return r;
  }
  void Close() override { alive_ = false; }
  void Heartbeat(int64_t) override {}
  bool alive() const override { return alive_; }
  int64_t release_calls_sent_again() const override { return 0; }
  bool WriteStalled(int64_t) const override { return false; }
  void Cancel(const std::string& why) override {
    if (alive_.exchange(false)) on_lost_(this, why);
  }
  bool SideClosedByDaemon() const override { return false; }

 private:
  static common::side::Grant Memfd(uint64_t id, int64_t bytes) {
    common::side::Grant g;
    g.id = id;
    g.bytes = bytes;
    const int fd = ::memfd_create("fake-deltad", MFD_CLOEXEC);
    if (fd >= 0 && ::ftruncate(fd, bytes) == 0) {
      g.fd = common::UniqueFd(fd);
    } else if (fd >= 0) {
      ::close(fd);
    }
    return g;
  }

  const FakeDaemonOptions options_;
  FakeDaemonCounts* counts_;
  LostFn on_lost_;
  v1::OpenSessionResponse session_;
  std::atomic<bool> alive_{true};
  bool slab_taken_ = false;
  std::mutex mu_;
  int64_t held_ = 0;  // chunk bytes granted and not returned
  uint64_t next_id_ = 1;
};

// The opener for ClientOptions::open_link. `counts` must outlive the client.
inline DaemonLink::OpenFn FakeDaemon(FakeDaemonOptions options,
                                     FakeDaemonCounts* counts) {
  return [options, counts](const LinkOptions&, DaemonLink::OrdersFn,
                           DaemonLink::LostFn on_lost)
             -> absl::StatusOr<std::unique_ptr<DaemonLink>> {
    return std::make_unique<FakeDaemonLink>(options, counts,
                                            std::move(on_lost));
  };
}

}  // namespace deltad::client::testing_util

#endif  // DELTAD_TESTS_UNIT_CLIENT_FAKE_DAEMON_H_
