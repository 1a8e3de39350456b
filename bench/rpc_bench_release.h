// rpc_bench's timing of the Release path (over RPC and in-process) beside
// the empty RPC, and the rows of its report.
#ifndef DELTAD_BENCH_RPC_BENCH_RELEASE_H_
#define DELTAD_BENCH_RPC_BENCH_RELEASE_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/report.h"
#include "bench/rpc_bench_stream.h"
#include "bench/rpc_bench_util.h"
#include "deltad/v1/memory_manager.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace deltad::bench {

// The empty RPC: grpc.health.v1.Health/Check for the server as a whole
// (service ""), which the daemon serves with gRPC's default health service:
// no daemon code runs, and the request and response are a few bytes. Its
// generated stub takes the same blocking unary path as Release's.
class HealthCheck {
 public:
  explicit HealthCheck(const std::shared_ptr<grpc::Channel>& channel)
      : stub_(grpc::health::v1::Health::NewStub(channel)) {}

  // Whether the daemon answers SERVING; dies when the call fails.
  bool Call() {
    grpc::health::v1::HealthCheckRequest request;
    grpc::health::v1::HealthCheckResponse response;
    grpc::ClientContext context;
    const grpc::Status s = stub_->Check(&context, request, &response);
    if (!s.ok()) Die(absl::StrCat("health check: ", s.error_message()));
    return response.status() == grpc::health::v1::HealthCheckResponse::SERVING;
  }

 private:
  std::unique_ptr<grpc::health::v1::Health::Stub> stub_;
};

struct ReleaseResult {
  std::vector<double> release_us;
  std::vector<double> empty_us;  // over RPC only
  int64_t victims = 0;
  int64_t offloads = 0;
};

// The events that carry out a release and then bring the tensor back
// (reload or recompute), so that the next decision sees the same table.
inline void AddRestore(const v1::ReleaseOrder& o, v1::EventBatch* batch) {
  const bool offload = o.action() == v1::ReleaseOrder::OFFLOAD;
  v1::TensorEvent* done = batch->add_events();
  done->set_kind(offload ? v1::TensorEvent::OFFLOADED
                         : v1::TensorEvent::EVICTED);
  done->set_tensor_id(o.tensor_id());
  done->set_at_ns(NowNs());
  v1::TensorEvent* back = batch->add_events();
  back->set_kind(offload ? v1::TensorEvent::RELOADED
                         : v1::TensorEvent::RECOMPUTED);
  back->set_tensor_id(o.tensor_id());
  back->set_at_ns(NowNs());
}

// Carries out and undoes the releases in `restore`, if any, with a Release of
// 1 byte: the GPU has room for a byte, so it applies the batch and orders
// nothing.
template <typename CallRelease>
inline void Restore(const Session& s, v1::ReleaseRequest& restore,
                    CallRelease& call) {
  if (!restore.has_batch()) return;
  restore.set_session_token(s.token);
  restore.set_bytes(1);
  v1::ReleaseResponse response;
  const absl::Status st = call(restore, &response);
  if (!st.ok()) Die("restoring released tensors: " + st.ToString());
  if (response.release_size() != 0) Die("a 1-byte Release ordered releases");
  restore.Clear();
}

// Each step: an untimed Release of 1 byte whose batch carries out and undoes
// the last step's releases (the GPU has room for a byte, so it applies the
// batch and orders nothing); then, timed, the empty RPC (over RPC only) and
// a Release asking room for `ask` bytes, more than the GPU has free, so the
// policy must choose victims among the whole GPU's tensors.
template <typename CallRelease>
inline ReleaseResult TimeReleases(const Session& s, int64_t ask, int calls,
                                  HealthCheck* empty, CallRelease call) {
  ReleaseResult r;
  v1::ReleaseRequest restore;
  for (int i = 0; i < kWarmupCalls + calls; ++i) {
    const bool timed = i >= kWarmupCalls;
    Restore(s, restore, call);
    if (empty != nullptr) {
      const auto t0 = Clock::now();
      (void)empty->Call();
      if (timed) r.empty_us.push_back(Micros(Clock::now() - t0));
    }
    v1::ReleaseRequest request;
    request.set_session_token(s.token);
    request.set_bytes(ask);
    v1::ReleaseResponse response;
    const auto t0 = Clock::now();
    const absl::Status st = call(request, &response);
    const auto t1 = Clock::now();
    if (!st.ok()) Die("Release: " + st.ToString());
    if (!response.room_available() || response.release_size() == 0) {
      Die("Release ordered nothing: the GPU's free bytes were misjudged");
    }
    if (timed) {
      r.release_us.push_back(Micros(t1 - t0));
      r.victims += response.release_size();
    }
    for (const v1::ReleaseOrder& o : response.release()) {
      if (timed && o.action() == v1::ReleaseOrder::OFFLOAD) ++r.offloads;
      AddRestore(o, restore.mutable_batch());
    }
  }
  Restore(s, restore, call);
  return r;
}

inline std::string LatencyRow(const std::string& what,
                              const std::string& victims, const Percentiles& p,
                              double empty_p99, const std::string& target,
                              const std::string& verdict) {
  return absl::StrFormat("| %s | %s | %.1f | %.1f | %.1f | %.2fx | %s | %s |\n",
                         what, victims, p.p50, p.p99, p.mean, p.p99 / empty_p99,
                         target, verdict);
}

inline std::string IngestRow(const std::string& what, const IngestResult& r,
                             const std::string& target,
                             const std::string& verdict) {
  return absl::StrFormat("| %s | %d | %.2f | %.0f | %.1f | %s | %s |\n", what,
                         r.events, r.seconds, r.per_second(), r.cpu_seconds,
                         target, verdict);
}

}  // namespace deltad::bench

#endif  // DELTAD_BENCH_RPC_BENCH_RELEASE_H_
