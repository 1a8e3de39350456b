// Every malformed request, one per request handler, with the status
// code and the piece of the message it must get.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/integration/bad_input_fixture.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/daemon_test.h"

namespace deltad::testing_util {
namespace {

using ::testing::HasSubstr;

// --- Every malformed request, with the status it gets ----------------------

// One malformed request per row: the call, the code it must get and a piece
// of the message. Batches on the Session stream get no call status (the
// stream carries on); their refusal comes as Orders.rejected_code and
// rejected_batch, which the table checks the same way. Every limit is set
// low here, and each one passed is RESOURCE_EXHAUSTED.
TEST_F(BadInputTest, EachMalformedRequestGetsItsOwnStatus) {
  DaemonOptions options;
  options.config_text =
      "default_host_quota_bytes: 67108864\n"
      "limits { max_batch_events: 8 max_message_bytes: 65536 "
      "max_tensors_per_session: 16 max_sessions_per_gpu: 2 "
      "max_host_quota_bytes: 134217728 }\n";
  options.flags = {"--drain_seconds=5"};
  StartDaemon(std::move(options));

  const v1::OpenSessionResponse mine = MustOpen(peer_->token(), 0);
  SessionStream stream(*stub_, mine.session_token());
  ASSERT_TRUE(stream.Send(Created({1})));
  ASSERT_TRUE(WaitForTensors(mine.session_id(), 1));
  // GPU 1 holds its limit of two sessions, of two other processes.
  auto p1 = PeerProcess::Start(daemon_->side_socket_path());
  auto p2 = PeerProcess::Start(daemon_->side_socket_path());
  auto p3 = PeerProcess::Start(daemon_->side_socket_path());
  ASSERT_TRUE(p1.ok() && p2.ok() && p3.ok());
  MustOpen((*p1)->token(), 1);
  MustOpen((*p2)->token(), 1);
  const v1::OpenSessionResponse closed = MustOpen((*p3)->token(), 0);
  ASSERT_TRUE(Close(closed.session_token()).ok());

  auto open = [&](const std::function<void(v1::OpenSessionRequest&)>& edit) {
    return [this, edit] {
      v1::OpenSessionRequest r;
      r.set_gpu(0);
      r.set_peer_token(peer_->token());
      edit(r);
      return Open(r);
    };
  };
  auto release = [&](const std::function<void(v1::ReleaseRequest&)>& edit) {
    return [this, edit, token = mine.session_token()] {
      v1::ReleaseRequest r;
      r.set_session_token(token);
      r.set_bytes(kMiB);
      edit(r);
      return Release(r);
    };
  };
  auto list = [&](const std::function<void(v1::ListTensorsRequest&)>& edit) {
    return [this, edit, id = mine.session_id()] {
      grpc::ClientContext context;
      context.set_deadline(Deadline());
      v1::ListTensorsRequest r;
      r.set_session_id(id);
      r.set_peer_token(peer_->token());
      edit(r);
      v1::ListTensorsResponse response;
      return stub_->ListTensors(&context, r, &response);
    };
  };
  // A batch on the stream, as a status: its refusal, or OK when it went in.
  auto batch = [&](v1::EventBatch b) {
    return [&stream, b] {
      if (!stream.Send(b)) return grpc::Status(grpc::StatusCode::UNKNOWN, "");
      auto o = stream.NextMatching(
          [](const v1::Orders& x) { return !x.rejected_batch().empty(); },
          absl::Seconds(5));
      if (!o) return grpc::Status::OK;
      return grpc::Status(static_cast<grpc::StatusCode>(o->rejected_code()),
                          o->rejected_batch());
    };
  };
  auto with = [](v1::EventBatch b,
                 const std::function<void(v1::EventBatch&)>& edit) {
    edit(b);
    return b;
  };
  v1::EventBatch nine;
  for (uint64_t id = 100; id < 109; ++id) {
    *nine.add_created() = Created({id}).created(0);
  }
  using Code = grpc::StatusCode;
  struct Row {
    std::string request;
    std::function<grpc::Status()> call;
    Code code;
    std::string says;
  };
  const std::vector<Row> table = {
      // OpenSession
      {"OpenSession without a peer token",
       open([](auto& r) { r.clear_peer_token(); }), Code::UNAUTHENTICATED,
       "peer token"},
      {"OpenSession with a made-up peer token",
       open([](auto& r) { r.set_peer_token("0123456789abcdef"); }),
       Code::UNAUTHENTICATED, "peer token"},
      {"OpenSession on GPU -1", open([](auto& r) { r.set_gpu(-1); }),
       Code::INVALID_ARGUMENT, "no GPU -1"},
      {"OpenSession on GPU 2 of 2", open([](auto& r) { r.set_gpu(2); }),
       Code::INVALID_ARGUMENT, "no GPU 2"},
      {"OpenSession asking a negative budget",
       open([](auto& r) { r.set_requested_budget_bytes(-1); }),
       Code::INVALID_ARGUMENT, "negative"},
      {"OpenSession asking negative host bytes",
       open([](auto& r) { r.set_requested_host_bytes(-1); }),
       Code::INVALID_ARGUMENT, "negative"},
      {"OpenSession at priority 101",
       open([](auto& r) { r.set_priority(101); }), Code::INVALID_ARGUMENT,
       "priority"},
      {"OpenSession a second time on one GPU", open([](auto&) {}),
       Code::ALREADY_EXISTS, "already"},
      {"OpenSession past max_sessions_per_gpu", open([&](auto& r) {
         r.set_gpu(1);
         r.set_peer_token((*p3)->token());
       }),
       Code::RESOURCE_EXHAUSTED, "2"},
      {"OpenSession past max_host_quota_bytes", open([&](auto& r) {
         r.set_peer_token((*p3)->token());
         r.set_requested_host_bytes(128 * kMiB + 1);
       }),
       Code::RESOURCE_EXHAUSTED, "max_host_quota_bytes"},
      {"OpenSession past max_message_bytes",
       open([](auto& r) { r.set_label(std::string(128 << 10, 'L')); }),
       Code::RESOURCE_EXHAUSTED, "limits.max_message_bytes"},
      // CloseSession
      {"CloseSession without a token", [&] { return Close(""); },
       Code::UNAUTHENTICATED, "session token"},
      {"CloseSession of a closed session",
       [&] { return Close(closed.session_token()); }, Code::UNAUTHENTICATED,
       "session token"},
      // Release
      {"Release with an unknown session token",
       release([](auto& r) { r.set_session_token("nobody"); }),
       Code::UNAUTHENTICATED, "session token"},
      {"Release of a negative size", release([](auto& r) { r.set_bytes(-1); }),
       Code::INVALID_ARGUMENT, "must be positive"},
      {"Release of more than the GPU's budget",
       release([](auto& r) { r.set_bytes(int64_t{1} << 40); }),
       Code::RESOURCE_EXHAUSTED, "budget"},
      {"Release with a batch past max_batch_events",
       release([&](auto& r) { *r.mutable_batch() = nine; }),
       Code::RESOURCE_EXHAUSTED, "the limit is 8"},
      // ListTensors
      {"ListTensors without a peer token",
       list([](auto& r) { r.clear_peer_token(); }), Code::UNAUTHENTICATED,
       "peer token"},
      {"ListTensors of an unknown session",
       list([](auto& r) { r.set_session_id(987654); }), Code::NOT_FOUND,
       "no session 987654"},
      {"ListTensors past 1000", list([](auto& r) { r.set_limit(1001); }),
       Code::INVALID_ARGUMENT, "at most 1000"},
      // Batches on the Session stream
      {"a tensor of 0 bytes",
       batch(with(Created({2}),
                  [](auto& b) { b.mutable_created(0)->set_bytes(0); })),
       Code::INVALID_ARGUMENT, "size"},
      {"a negative compute cost",
       batch(with(
           Created({2}),
           [](auto& b) { b.mutable_created(0)->set_compute_cost_ns(-1); })),
       Code::INVALID_ARGUMENT, "compute cost"},
      {"an unknown parent",
       batch(with(Created({2}),
                  [](auto& b) { b.mutable_created(0)->add_parent_ids(42); })),
       Code::NOT_FOUND, "parent 42"},
      {"a tensor that is its own parent",
       batch(with(Created({2}),
                  [](auto& b) { b.mutable_created(0)->add_parent_ids(2); })),
       Code::INVALID_ARGUMENT, "cycle"},
      {"a tensor id that exists", batch(Created({1})), Code::ALREADY_EXISTS,
       "already exists"},
      {"an event for an unknown tensor",
       batch(Event(v1::TensorEvent::ACCESSED, 77)), Code::NOT_FOUND,
       "tensor 77"},
      {"an unknown event kind",
       batch(Event(static_cast<v1::TensorEvent::Kind>(99), 1)),
       Code::INVALID_ARGUMENT, "unknown event kind"},
      {"RELOADED for a resident tensor",
       batch(Event(v1::TensorEvent::RELOADED, 1)), Code::FAILED_PRECONDITION,
       "tensor 1"},
      {"a batch past max_batch_events", batch(nine), Code::RESOURCE_EXHAUSTED,
       "the limit is 8"},
  };
  for (const Row& row : table) {
    const grpc::Status s = row.call();
    EXPECT_EQ(s.error_code(), row.code)
        << row.request << ": got " << Describe(s);
    EXPECT_THAT(s.error_message(), HasSubstr(row.says))
        << row.request << ": got " << Describe(s);
    ExpectServing(row.request);
  }
  // Each refused batch applied nothing: only tensor 1 is there.
  EXPECT_EQ(SessionOf(mine.session_id()).tensors(), 1u);

  // max_tensors_per_session, in batches within the batch limit: 15 more
  // fit, the 17th tensor does not.
  for (uint64_t first = 2; first <= 16; first += 5) {
    v1::EventBatch b;
    for (uint64_t id = first; id < std::min<uint64_t>(first + 5, 17); ++id) {
      *b.add_created() = Created({id}).created(0);
    }
    ASSERT_TRUE(stream.Send(b));
  }
  ASSERT_TRUE(WaitForTensors(mine.session_id(), 16));
  const grpc::Status over = batch(Created({17}))();
  EXPECT_EQ(over.error_code(), Code::RESOURCE_EXHAUSTED) << Describe(over);
  EXPECT_THAT(over.error_message(), HasSubstr("the limit is 16"));
  EXPECT_EQ(SessionOf(mine.session_id()).tensors(), 16u);
}

}  // namespace
}  // namespace deltad::testing_util
