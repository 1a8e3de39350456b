#include "daemon/grpc_call_census.h"

#include <grpc/grpc.h>
#include <grpc/support/alloc.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace deltad::daemon {
namespace {

std::atomic<int64_t> seen_in_process{0};

}  // namespace

class GrpcCallCensus::Factory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* /*info*/) override {
    seen_in_process.fetch_add(1, std::memory_order_release);
    return nullptr;  // counted; nothing to intercept
  }
};

GrpcCallCensus::GrpcCallCensus(std::function<void(int64_t)> ended_unseen,
                               std::chrono::milliseconds period)
    : ended_unseen_(std::move(ended_unseen)) {
  if (period.count() > 0) {
    thread_ = std::thread([this, period] { Loop(period); });
  }
}

GrpcCallCensus::~GrpcCallCensus() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
GrpcCallCensus::Counter() {
  return std::make_unique<Factory>();
}

int64_t GrpcCallCensus::seen() {
  return seen_in_process.load(std::memory_order_acquire);
}

void GrpcCallCensus::Loop(std::chrono::milliseconds period) {
  std::unique_lock<std::mutex> lock(mu_);
  while (!wake_.wait_for(lock, period, [this] { return stop_; })) {
    lock.unlock();
    Sample();
    lock.lock();
  }
}

absl::StatusOr<int64_t> GrpcCallCensus::CallsStarted() {
  int64_t started = 0;
  intptr_t next = 0;
  // Paged: each page ends with the highest id it listed, and `end` on the
  // last.
  for (int page = 0; page < 64; ++page) {
    char* text = grpc_channelz_get_servers(next);
    if (text == nullptr) return absl::UnavailableError("channelz is off");
    const nlohmann::json json = nlohmann::json::parse(text, nullptr, false);
    gpr_free(text);
    if (json.is_discarded() || !json.is_object()) {
      return absl::InternalError("channelz's answer is not JSON");
    }
    auto servers = json.find("server");
    if (servers == json.end()) return started;  // no server: nothing started
    for (const nlohmann::json& server : *servers) {
      // int64 fields are strings in proto3's JSON, and 0 is left out.
      const auto data = server.find("data");
      if (data != server.end()) {
        const auto calls = data->find("callsStarted");
        int64_t n = 0;
        if (calls != data->end() &&
            (!calls->is_string() ||
             !absl::SimpleAtoi(calls->get<std::string>(), &n))) {
          return absl::InternalError("channelz's callsStarted is unreadable");
        }
        started += n;
      }
      const auto ref = server.find("ref");
      int64_t id = 0;
      if (ref != server.end() && ref->contains("serverId") &&
          (*ref)["serverId"].is_string() &&
          absl::SimpleAtoi((*ref)["serverId"].get<std::string>(), &id)) {
        next = std::max<intptr_t>(next, static_cast<intptr_t>(id) + 1);
      }
    }
    if (json.value("end", false)) return started;
  }
  return started;
}

void GrpcCallCensus::Sample() {
  // Seen first: every call seen by then was started by then, so the
  // difference never falls below the calls ended unseen.
  const int64_t seen = seen_in_process.load(std::memory_order_acquire);
  absl::StatusOr<int64_t> started = CallsStarted();
  if (!started.ok()) {
    if (!said_unreadable_) {
      std::fprintf(stderr,
                   "deltad: calls gRPC ends before the daemon sees them are "
                   "not counted: %s\n",
                   std::string(started.status().message()).c_str());
      said_unreadable_ = true;
    }
    return;
  }
  recent_.push_back(*started - seen);
  if (recent_.size() > kWindow) recent_.pop_front();
  if (recent_.size() < kWindow) return;  // a call between the two may be in all
  const int64_t certain = *std::min_element(recent_.begin(), recent_.end());
  const int64_t counted = counted_.load();
  if (certain <= counted) return;
  counted_.store(certain);
  if (ended_unseen_) ended_unseen_(certain - counted);
  int64_t held_back = 0;
  if (log_.Allow(&held_back)) {
    std::fprintf(stderr,
                 "deltad: gRPC ended %lld call(s) before the daemon saw them "
                 "(%lld in all): a message past gRPC's own limit (4 times "
                 "limits.max_message_bytes), its memory quota "
                 "(limits.grpc_memory_bytes), or a call its client cancelled "
                 "before its message came (%lld such lines held back before "
                 "this one)\n",
                 static_cast<long long>(certain - counted),
                 static_cast<long long>(certain),
                 static_cast<long long>(held_back));
  }
}

}  // namespace deltad::daemon
