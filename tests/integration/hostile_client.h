// What the hostile-client tests share: the daemon's limits they set, the
// fixture with its honest session (which every attack must leave
// unaffected), and the daemon's resident memory.
#ifndef DELTAD_TESTS_INTEGRATION_HOSTILE_CLIENT_H_
#define DELTAD_TESTS_INTEGRATION_HOSTILE_CLIENT_H_

#include <sys/types.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/client_unary_call.h"
#include "grpcpp/impl/rpc_method.h"
#include "grpcpp/support/sync_stream.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/daemon_test.h"

namespace deltad::testing_util {

constexpr int kMaxLabelBytes = 64;
constexpr int kMaxBatchEvents = 16;
constexpr int kMaxStatusSessions = 3;
constexpr int kMaxQueuedOrderBytes = 64 * 1024;
// This process's own connection and the other processes the tests start
// (at most three) fit; the test of this limit opens more.
constexpr int kMaxSideConnectionsPerUid = 5;
// What a flood may add to the daemon's resident memory (the target
// for every flood).
constexpr int64_t kFloodRssBound = 64 * kMiB;

// The resident memory of process `pid` (VmRSS), in bytes; -1 if unknown.
inline int64_t RssBytes(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0)
      return std::atoll(line.c_str() + 6) * 1024;
  }
  return -1;
}

inline grpc::ByteBuffer Bytes(const std::string& bytes) {
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

class HostileClientTest : public DaemonTest {
 protected:
  // Limits a derived fixture adds to the ones above.
  virtual std::string ExtraLimits() const { return ""; }
  // Configuration a derived fixture adds beside the limits.
  virtual std::string ExtraConfig() const { return ""; }

  void SetUp() override {
    StartDaemonWithLimits(
        absl::StrCat("max_label_bytes: ", kMaxLabelBytes,
                     " max_batch_events: ", kMaxBatchEvents,
                     " max_status_sessions: ", kMaxStatusSessions,
                     " max_queued_order_bytes: ", kMaxQueuedOrderBytes,
                     " max_side_connections_per_uid: ",
                     kMaxSideConnectionsPerUid, ExtraLimits()),
        ExtraConfig());
    // The honest session: a tensor on GPU 0, on a stream that reads.
    honest_ = MustOpen(peer_->token(), 0);
    honest_stream_ =
        std::make_unique<SessionStream>(*stub_, honest_.session_token());
    ASSERT_TRUE(honest_stream_->Send(Created({1})));
    ASSERT_TRUE(WaitForTensors(honest_.session_id(), 1));
  }

  void TearDown() override {
    ExpectHonestSessionUnaffected();
    honest_stream_.reset();
    DaemonTest::TearDown();
  }

  // The honest session still has its tensor and its Release answers.
  void ExpectHonestSessionUnaffected() {
    EXPECT_EQ(SessionOf(honest_.session_id()).tensors(), 1u);
    v1::ReleaseRequest request;
    request.set_session_token(honest_.session_token());
    request.set_bytes(kMiB);
    const grpc::Status s = Release(request);
    EXPECT_TRUE(s.ok()) << "the honest session's Release: " << Describe(s);
  }

  // A unary call with `bytes` as its request, as they are.
  grpc::Status RawCall(const char* method, const std::string& bytes) {
    auto channel = daemon_->NewChannel();
    grpc::ClientContext context;
    context.set_deadline(Deadline());
    grpc::ByteBuffer response;
    return grpc::internal::BlockingUnaryCall<grpc::ByteBuffer,
                                             grpc::ByteBuffer>(
        channel.get(),
        grpc::internal::RpcMethod(method,
                                  grpc::internal::RpcMethod::NORMAL_RPC),
        &context, Bytes(bytes), &response);
  }

  // A Session stream whose first message is `bytes`, as they are; the
  // status it ends with.
  grpc::Status RawStream(const std::string& bytes) {
    auto channel = daemon_->NewChannel();
    grpc::ClientContext context;
    context.set_deadline(Deadline());
    std::unique_ptr<
        grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>>
        stream(grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer,
                                                         grpc::ByteBuffer>::
                   Create(channel.get(),
                          grpc::internal::RpcMethod(
                              "/deltad.v1.MemoryManager/Session",
                              grpc::internal::RpcMethod::BIDI_STREAMING),
                          &context));
    (void)stream->Write(Bytes(bytes));
    grpc::ByteBuffer ignored;
    while (stream->Read(&ignored)) {
    }
    return stream->Finish();
  }

  v1::OpenSessionResponse honest_;
  std::unique_ptr<SessionStream> honest_stream_;
};

}  // namespace deltad::testing_util

#endif  // DELTAD_TESTS_INTEGRATION_HOSTILE_CLIENT_H_
