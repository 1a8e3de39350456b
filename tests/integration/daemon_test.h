#ifndef DELTAD_TESTS_INTEGRATION_DAEMON_TEST_H_
#define DELTAD_TESTS_INTEGRATION_DAEMON_TEST_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "deltad/v1/memory_manager.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/session_stream.h"

namespace deltad::testing_util {

inline constexpr int64_t kMiB = int64_t{1} << 20;
inline constexpr int64_t kGiB = int64_t{1} << 30;

inline v1::EventBatch Created(std::initializer_list<uint64_t> ids,
                              int64_t bytes = kMiB) {
  v1::EventBatch b;
  for (uint64_t id : ids) {
    v1::TensorCreated* c = b.add_created();
    c->set_tensor_id(id);
    c->set_bytes(bytes);
    c->set_compute_cost_ns(1000);
  }
  return b;
}

inline v1::EventBatch Event(v1::TensorEvent::Kind kind, uint64_t id) {
  v1::EventBatch b;
  v1::TensorEvent* e = b.add_events();
  e->set_kind(kind);
  e->set_tensor_id(id);
  e->set_at_ns(1);
  return b;
}

inline std::string Describe(const grpc::Status& s) {
  return absl::StrCat("code ", s.error_code(), ": ", s.error_message());
}

// The status line of one raw HTTP/1.0 request to 127.0.0.1:port, and the
// body; empty when nothing answered.
inline std::pair<std::string, std::string> Http(int port,
                                                const std::string& method,
                                                const std::string& path) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return {};
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string reply;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string request = absl::StrCat(
        method, " ", path, " HTTP/1.0\r\nContent-Length: 4\r\n\r\nx=1\n");
    if (::write(fd, request.data(), request.size()) ==
        static_cast<ssize_t>(request.size())) {
      char buf[4096];
      ssize_t n;
      while ((n = ::read(fd, buf, sizeof(buf))) > 0) reply.append(buf, n);
    }
  }
  ::close(fd);
  const size_t eol = reply.find("\r\n");
  const size_t body = reply.find("\r\n\r\n");
  return {reply.substr(0, eol),
          body == std::string::npos ? "" : reply.substr(body + 4)};
}

// The metrics port deltad printed at start-up.
inline int MetricsPort(const std::string& daemon_output) {
  const size_t at = daemon_output.find("/metrics (port ");
  if (at == std::string::npos) return 0;
  return std::atoi(daemon_output.c_str() + at + 15);
}

// The daemon's /metrics once it holds every line of `wanted` (counters a
// client's refusal moves as the daemon gets to it), or as it was after 5 s.
inline std::string MetricsOnceTheyHold(
    const std::string& daemon_output,
    std::initializer_list<absl::string_view> wanted) {
  std::string metrics;
  for (int i = 0; i < 50; ++i) {
    metrics = Http(MetricsPort(daemon_output), "GET", "/metrics").second;
    if (std::all_of(wanted.begin(), wanted.end(), [&](absl::string_view w) {
          return absl::StrContains(metrics, w);
        })) {
      break;
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
  return metrics;
}

// A test with a real deltad (DaemonProcess) of its own, a stub to it and a
// side connection (peer_) as a training process holds one, with the calls
// the tests make. StartDaemon starts it; TearDown checks that it is still
// up and that SIGTERM stops it cleanly (exit 0: no crash, and under ASan no
// leak).
class DaemonTest : public ::testing::Test {
 protected:
  void StartDaemon(DaemonOptions options) {
    auto daemon = DaemonProcess::Start(std::move(options));
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = std::move(*daemon);
    stub_ = daemon_->NewStub();
    auto peer = Peer::Connect(daemon_->side_socket_path());
    ASSERT_TRUE(peer.ok()) << peer.status();
    peer_ = std::make_unique<Peer>(std::move(*peer));
  }

  // A daemon with `limits { <limits> }` in its configuration. The drain at
  // the end of each test is bounded: what is left open by then (a test that
  // keeps a stream on purpose) must not slow the suite.
  // `extra`: more of the configuration, beside the limits.
  void StartDaemonWithLimits(const std::string& limits,
                             const std::string& extra = "") {
    DaemonOptions options;
    options.config_text = absl::StrCat("limits { ", limits, " }\n", extra);
    options.flags = {"--drain_seconds=5"};
    StartDaemon(std::move(options));
  }

  void TearDown() override {
    if (daemon_ == nullptr || stopped_) return;
    EXPECT_TRUE(daemon_->Running()) << "deltad died during the test\n"
                                    << daemon_->Output();
    if (peer_ != nullptr) peer_->Close();
    // An idle but connected channel makes gRPC's shutdown wait out its
    // whole grace period (2 s): the test's own goes first.
    stub_.reset();
    const ExitStatus e = daemon_->Stop();
    EXPECT_TRUE(e.ok()) << "deltad did not stop cleanly on SIGTERM: "
                        << e.ToString() << "\n"
                        << daemon_->Output();
  }

  grpc::Status Open(const std::string& peer_token, int gpu,
                    v1::OpenSessionResponse* response = nullptr,
                    int64_t host_bytes = 0) {
    v1::OpenSessionRequest request;
    request.set_gpu(gpu);
    request.set_peer_token(peer_token);
    request.set_requested_host_bytes(host_bytes);
    request.set_label("integration test");
    return Open(request, response);
  }
  grpc::Status Open(const v1::OpenSessionRequest& request,
                    v1::OpenSessionResponse* response = nullptr) {
    grpc::ClientContext context;
    context.set_deadline(Deadline());
    v1::OpenSessionResponse ignored;
    return stub_->OpenSession(&context, request,
                              response != nullptr ? response : &ignored);
  }
  // Opens a session that must open.
  v1::OpenSessionResponse MustOpen(const std::string& peer_token, int gpu,
                                   int64_t host_bytes = 0) {
    v1::OpenSessionResponse response;
    const grpc::Status s = Open(peer_token, gpu, &response, host_bytes);
    EXPECT_TRUE(s.ok()) << Describe(s);
    return response;
  }

  grpc::Status Close(const std::string& session_token) {
    grpc::ClientContext context;
    context.set_deadline(Deadline());
    v1::CloseSessionRequest request;
    request.set_session_token(session_token);
    v1::CloseSessionResponse response;
    return stub_->CloseSession(&context, request, &response);
  }

  grpc::Status Release(const v1::ReleaseRequest& request,
                       v1::ReleaseResponse* response = nullptr) {
    grpc::ClientContext context;
    context.set_deadline(Deadline());
    v1::ReleaseResponse ignored;
    return stub_->Release(&context, request,
                          response != nullptr ? response : &ignored);
  }

  v1::NodeStatusResponse Status() {
    grpc::ClientContext context;
    context.set_deadline(Deadline());
    v1::NodeStatusResponse response;
    const grpc::Status s =
        stub_->NodeStatus(&context, v1::NodeStatusRequest(), &response);
    EXPECT_TRUE(s.ok()) << "NodeStatus: " << Describe(s);
    return response;
  }

  // The daemon process is alive and answers NodeStatus: checked after every
  // piece of bad input.
  void ExpectServing(const std::string& after) {
    ASSERT_TRUE(daemon_->Running()) << "deltad died after " << after << "\n"
                                    << daemon_->Output();
    grpc::ClientContext context;
    context.set_deadline(Deadline());
    v1::NodeStatusResponse response;
    const grpc::Status s =
        stub_->NodeStatus(&context, v1::NodeStatusRequest(), &response);
    ASSERT_TRUE(s.ok()) << "NodeStatus after " << after << ": " << Describe(s)
                        << "\n"
                        << daemon_->Output();
  }

  // Polls NodeStatus until `done` holds or `timeout` passes.
  bool WaitForStatus(
      const std::function<bool(const v1::NodeStatusResponse&)>& done,
      absl::Duration timeout = kTimeout) {
    const absl::Time deadline = absl::Now() + timeout;
    for (;;) {
      if (done(Status())) return true;
      if (absl::Now() >= deadline) return false;
      absl::SleepFor(absl::Milliseconds(20));
    }
  }

  // The NodeStatus record of a session; a default one when it is not open.
  v1::SessionStatus SessionOf(uint64_t session_id) {
    const v1::NodeStatusResponse status = Status();
    for (const v1::SessionStatus& s : status.sessions()) {
      if (s.session_id() == session_id) return s;
    }
    return v1::SessionStatus();
  }
  bool WaitForTensors(uint64_t session_id, uint64_t tensors) {
    return WaitForStatus([&](const v1::NodeStatusResponse& r) {
      for (const v1::SessionStatus& s : r.sessions()) {
        if (s.session_id() == session_id) return s.tensors() == tensors;
      }
      return false;
    });
  }
  bool WaitForSessions(int n) {
    return WaitForStatus([n](const v1::NodeStatusResponse& r) {
      return r.sessions_size() == n;
    });
  }

  std::unique_ptr<DaemonProcess> daemon_;
  std::unique_ptr<v1::MemoryManager::Stub> stub_;
  std::unique_ptr<Peer> peer_;
  bool stopped_ = false;  // the test stopped the daemon itself
};

}  // namespace deltad::testing_util

#endif  // DELTAD_TESTS_INTEGRATION_DAEMON_TEST_H_
