// Bad input on the Session stream: batches naming tensors of another
// session, bad sizes, unknown parents and cycles, duplicate ids, unknown
// event kinds, oversized batches, streams outliving their session, and
// random batches.
#include <cstdint>
#include <iterator>
#include <limits>
#include <random>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/integration/bad_input_fixture.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/daemon_test.h"

namespace deltad::testing_util {
namespace {

using ::testing::HasSubstr;

// --- The Session stream -----------------------------------------------------

TEST_F(BadInputTest, BatchNamingAnotherSessionsTensorsDoesNotTouchThem) {
  // Session A belongs to another process, on the same GPU as ours (B).
  auto other = PeerProcess::Start(daemon_->side_socket_path());
  ASSERT_TRUE(other.ok()) << other.status();
  const v1::OpenSessionResponse a = MustOpen((*other)->token(), 0);
  SessionStream stream_a(*stub_, a.session_token());
  ASSERT_TRUE(stream_a.Send(Created({1, 2, 3})));
  ASSERT_TRUE(WaitForTensors(a.session_id(), 3));
  const v1::SessionStatus a_before = SessionOf(a.session_id());
  EXPECT_EQ(a_before.device_bytes(), 3 * kMiB);

  const v1::OpenSessionResponse b = MustOpen(peer_->token(), 0);
  SessionStream stream_b(*stub_, b.session_token());
  const struct {
    v1::TensorEvent::Kind kind;
    uint64_t id;
  } foreign[] = {
      {v1::TensorEvent::FREED, 1},     {v1::TensorEvent::ACCESSED, 2},
      {v1::TensorEvent::OFFLOADED, 3}, {v1::TensorEvent::EVICTED, 1},
      {v1::TensorEvent::RELOADED, 2},  {v1::TensorEvent::RELEASE_FAILED, 3},
  };
  for (const auto& f : foreign) {
    SCOPED_TRACE(absl::StrCat(v1::TensorEvent::Kind_Name(f.kind), " ", f.id));
    ASSERT_TRUE(stream_b.Send(Event(f.kind, f.id)));
    EXPECT_THAT(stream_b.NextRejection(), HasSubstr("has no such tensor"));
    ExpectServing("a batch naming another session's tensor");
  }
  v1::EventBatch child = Created({10});
  child.mutable_created(0)->add_parent_ids(1);
  ASSERT_TRUE(stream_b.Send(child));
  EXPECT_THAT(stream_b.NextRejection(),
              HasSubstr("parent 1 is not a tensor of this session"));

  // B's ids are its own: B may create and free its own tensor 1.
  ASSERT_TRUE(stream_b.Send(Created({1})));
  ASSERT_TRUE(WaitForTensors(b.session_id(), 1));
  ASSERT_TRUE(stream_b.Send(Event(v1::TensorEvent::FREED, 1)));
  ASSERT_TRUE(WaitForTensors(b.session_id(), 0));

  const v1::SessionStatus a_after = SessionOf(a.session_id());
  EXPECT_EQ(a_after.tensors(), 3u);
  EXPECT_EQ(a_after.device_bytes(), a_before.device_bytes());
  EXPECT_EQ(a_after.host_bytes(), a_before.host_bytes());
  EXPECT_EQ(Status().gpus(0).used_bytes(), 3 * kMiB);
  // And A still works: its tensors are there to be freed.
  ASSERT_TRUE(stream_a.Send(Event(v1::TensorEvent::FREED, 2)));
  EXPECT_TRUE(WaitForTensors(a.session_id(), 2));
}

TEST_F(BadInputTest, ZeroNegativeAndAbsurdTensorSizesAreRejected) {
  const v1::OpenSessionResponse mine = MustOpen(peer_->token(), 0);
  SessionStream stream(*stub_, mine.session_token());
  const struct {
    int64_t bytes;
    const char* says;
  } sizes[] = {
      {0, "size must be positive, got 0"},
      {-1, "size must be positive, got -1"},
      {std::numeric_limits<int64_t>::min(), "size must be positive"},
      {8 * kGiB, "whole budget"},  // the GPU's memory; its budget is 90%
      {std::numeric_limits<int64_t>::max(), "whole budget"},
  };
  for (const auto& size : sizes) {
    SCOPED_TRACE(absl::StrCat("bytes ", size.bytes));
    ASSERT_TRUE(stream.Send(Created({7}, size.bytes)));
    EXPECT_THAT(stream.NextRejection(), HasSubstr(size.says));
    ExpectServing("a bad tensor size");
  }
  v1::EventBatch cost = Created({7});
  cost.mutable_created(0)->set_compute_cost_ns(-1);
  ASSERT_TRUE(stream.Send(cost));
  EXPECT_THAT(stream.NextRejection(), HasSubstr("compute cost"));
  // One bad tensor refuses the batch whole.
  v1::EventBatch mixed = Created({1, 2, 3});
  mixed.mutable_created(2)->set_bytes(0);
  ASSERT_TRUE(stream.Send(mixed));
  EXPECT_THAT(stream.NextRejection(), HasSubstr("tensor 3: size"));
  EXPECT_EQ(SessionOf(mine.session_id()).tensors(), 0u);
  // The stream carries on.
  ASSERT_TRUE(stream.Send(Created({7})));
  EXPECT_TRUE(WaitForTensors(mine.session_id(), 1));
}

TEST_F(BadInputTest, UnknownParentsAndCyclesAreRejected) {
  const v1::OpenSessionResponse mine = MustOpen(peer_->token(), 0);
  SessionStream stream(*stub_, mine.session_token());

  v1::EventBatch unknown = Created({1});
  unknown.mutable_created(0)->add_parent_ids(42);
  ASSERT_TRUE(stream.Send(unknown));
  EXPECT_THAT(stream.NextRejection(),
              HasSubstr("parent 42 is not a tensor of this session"));

  v1::EventBatch self = Created({1});
  self.mutable_created(0)->add_parent_ids(1);
  ASSERT_TRUE(stream.Send(self));
  EXPECT_THAT(stream.NextRejection(), HasSubstr("cycle"));

  v1::EventBatch loop = Created({1, 2, 3});
  loop.mutable_created(0)->add_parent_ids(3);
  loop.mutable_created(1)->add_parent_ids(1);
  loop.mutable_created(2)->add_parent_ids(2);
  ASSERT_TRUE(stream.Send(loop));
  EXPECT_THAT(stream.NextRejection(), HasSubstr("cycle in parents"));
  ExpectServing("parents that do not exist");
  EXPECT_EQ(SessionOf(mine.session_id()).tensors(), 0u);

  // A parent freed before its child is reported is gone too.
  ASSERT_TRUE(stream.Send(Created({5})));
  ASSERT_TRUE(WaitForTensors(mine.session_id(), 1));
  ASSERT_TRUE(stream.Send(Event(v1::TensorEvent::FREED, 5)));
  ASSERT_TRUE(WaitForTensors(mine.session_id(), 0));
  v1::EventBatch orphan = Created({6});
  orphan.mutable_created(0)->add_parent_ids(5);
  ASSERT_TRUE(stream.Send(orphan));
  EXPECT_THAT(stream.NextRejection(), HasSubstr("parent 5"));

  // Parents later in the same batch are fine.
  v1::EventBatch forward = Created({10, 11});
  forward.mutable_created(0)->add_parent_ids(11);
  ASSERT_TRUE(stream.Send(forward));
  EXPECT_TRUE(WaitForTensors(mine.session_id(), 2));
}

TEST_F(BadInputTest, DuplicateTensorIdsAreRejected) {
  const v1::OpenSessionResponse mine = MustOpen(peer_->token(), 0);
  SessionStream stream(*stub_, mine.session_token());
  ASSERT_TRUE(stream.Send(Created({1, 2, 1})));
  EXPECT_THAT(stream.NextRejection(),
              HasSubstr("tensor 1 is created twice in one batch"));
  EXPECT_EQ(SessionOf(mine.session_id()).tensors(), 0u);

  ASSERT_TRUE(stream.Send(Created({5})));
  ASSERT_TRUE(WaitForTensors(mine.session_id(), 1));
  ASSERT_TRUE(stream.Send(Created({5}, 2 * kMiB)));
  EXPECT_THAT(stream.NextRejection(), HasSubstr("tensor 5 already exists"));
  ExpectServing("duplicate tensor ids");
  EXPECT_EQ(SessionOf(mine.session_id()).device_bytes(), kMiB);

  // Freed twice: the second FREED names a tensor that is gone.
  v1::EventBatch twice = Event(v1::TensorEvent::FREED, 5);
  *twice.add_events() = twice.events(0);
  ASSERT_TRUE(stream.Send(twice));
  EXPECT_THAT(stream.NextRejection(), HasSubstr("freed earlier in this batch"));
  EXPECT_EQ(SessionOf(mine.session_id()).tensors(), 1u);

  // Once freed, the id may be reused.
  ASSERT_TRUE(stream.Send(Event(v1::TensorEvent::FREED, 5)));
  ASSERT_TRUE(WaitForTensors(mine.session_id(), 0));
  ASSERT_TRUE(stream.Send(Created({5})));
  EXPECT_TRUE(WaitForTensors(mine.session_id(), 1));
}

TEST_F(BadInputTest, UnknownEventKindsAndIllegalTransitionsAreRejected) {
  const v1::OpenSessionResponse mine = MustOpen(peer_->token(), 0);
  SessionStream stream(*stub_, mine.session_token());
  ASSERT_TRUE(stream.Send(Created({1})));
  ASSERT_TRUE(WaitForTensors(mine.session_id(), 1));
  for (int kind : {0, 10, 1000, -1}) {
    SCOPED_TRACE(absl::StrCat("kind ", kind));
    ASSERT_TRUE(
        stream.Send(Event(static_cast<v1::TensorEvent::Kind>(kind), 1)));
    EXPECT_THAT(stream.NextRejection(), HasSubstr("unknown event kind"));
  }
  // Reloaded without having been offloaded.
  ASSERT_TRUE(stream.Send(Event(v1::TensorEvent::RELOADED, 1)));
  EXPECT_THAT(stream.NextRejection(), HasSubstr("for tensor 1"));
  ExpectServing("unknown event kinds");
  EXPECT_EQ(SessionOf(mine.session_id()).device_bytes(), kMiB);
}

TEST_F(BadInputTest, BatchOverMaxBatchEventsIsRejected) {
  const v1::OpenSessionResponse mine = MustOpen(peer_->token(), 0);
  SessionStream stream(*stub_, mine.session_token());
  v1::EventBatch too_many;
  for (uint64_t id = 1; id <= kMaxBatchEvents + 1; ++id) {
    *too_many.add_created() = Created({id}).created(0);
  }
  ASSERT_TRUE(stream.Send(too_many));
  EXPECT_THAT(stream.NextRejection(),
              HasSubstr(absl::StrCat("the limit is ", kMaxBatchEvents)));
  // Creations and events count together.
  v1::EventBatch mixed = Created({1, 2, 3, 4});
  for (uint64_t id = 1; id <= kMaxBatchEvents - 3; ++id) {
    v1::TensorEvent* e = mixed.add_events();
    e->set_kind(v1::TensorEvent::ACCESSED);
    e->set_tensor_id(1 + id % 4);
  }
  ASSERT_TRUE(stream.Send(mixed));
  EXPECT_THAT(stream.NextRejection(),
              HasSubstr(absl::StrCat("the limit is ", kMaxBatchEvents)));
  ExpectServing("an oversized batch");
  EXPECT_EQ(SessionOf(mine.session_id()).tensors(), 0u);
  // Exactly the limit is fine.
  v1::EventBatch full;
  for (uint64_t id = 1; id <= kMaxBatchEvents; ++id) {
    *full.add_created() = Created({id}).created(0);
  }
  ASSERT_TRUE(stream.Send(full));
  EXPECT_TRUE(WaitForTensors(mine.session_id(), kMaxBatchEvents));
}

TEST_F(BadInputTest, StreamNamingAnotherSessionMidwayIsRejected) {
  const v1::OpenSessionResponse mine = MustOpen(peer_->token(), 0);
  const v1::OpenSessionResponse other = MustOpen(peer_->token(), 1);
  SessionStream stream(*stub_, mine.session_token());
  v1::SessionMessage m;
  m.set_session_token(other.session_token());
  *m.mutable_batch() = Created({1});
  ASSERT_TRUE(stream.SendMessage(m));
  EXPECT_THAT(stream.NextRejection(),
              HasSubstr("a stream carries one session's batches"));
  EXPECT_EQ(SessionOf(mine.session_id()).tensors(), 0u);
  EXPECT_EQ(SessionOf(other.session_id()).tensors(), 0u);
  // A second stream for a session is refused; the first carries on.
  SessionStream second(*stub_, mine.session_token());
  const grpc::Status s = second.FinishWithoutWritesDone();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ALREADY_EXISTS) << Describe(s);
  EXPECT_THAT(s.error_message(), HasSubstr("already has a stream"));
  ASSERT_TRUE(stream.Send(Created({1})));
  EXPECT_TRUE(WaitForTensors(mine.session_id(), 1));
  ExpectServing("a stream naming another session");
}

TEST_F(BadInputTest, RequestsAfterCloseSessionAreUnauthenticated) {
  const v1::OpenSessionResponse mine = MustOpen(peer_->token(), 0);
  ASSERT_TRUE(Close(mine.session_token()).ok());
  EXPECT_EQ(Status().sessions_size(), 0);

  grpc::Status s = Close(mine.session_token());
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << Describe(s);
  EXPECT_THAT(s.error_message(), HasSubstr("unknown or closed session token"));

  v1::ReleaseRequest release;
  release.set_session_token(mine.session_token());
  release.set_bytes(kMiB);
  s = Release(release);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << Describe(s);

  SessionStream stream(*stub_, mine.session_token());
  stream.Send(Created({1}));
  s = stream.FinishWithoutWritesDone();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << Describe(s);

  // Slabs of a closed session are refused too.
  auto slabs = peer_->FetchSlabs(mine.session_token());
  ASSERT_FALSE(slabs.ok());
  EXPECT_THAT(slabs.status().message(), HasSubstr("UNAUTHENTICATED"));
  ExpectServing("requests after CloseSession");
  // The process may open on that GPU again.
  MustOpen(peer_->token(), 0);
}

TEST_F(BadInputTest, BatchOnAStreamWhoseSessionWasClosedEndsItUnauthenticated) {
  const v1::OpenSessionResponse mine = MustOpen(peer_->token(), 0);
  SessionStream stream(*stub_, mine.session_token());
  ASSERT_TRUE(stream.Send(Created({1})));
  ASSERT_TRUE(WaitForTensors(mine.session_id(), 1));
  ASSERT_TRUE(Close(mine.session_token()).ok());
  EXPECT_EQ(Status().sessions_size(), 0);
  EXPECT_EQ(Status().gpus(0).used_bytes(), 0);
  // The stream outlived its session: the next batch cannot be applied, and
  // the process must learn why rather than see a clean end.
  stream.Send(Created({2}));
  const grpc::Status s = stream.FinishWithoutWritesDone();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << Describe(s);
  ExpectServing("a batch after CloseSession");
}

// --- Fuzz -------------------------------------------------------------------

TEST_F(BadInputTest, RandomBatchesNeverHurtTheDaemon) {
  auto other = PeerProcess::Start(daemon_->side_socket_path());
  ASSERT_TRUE(other.ok()) << other.status();
  const v1::OpenSessionResponse theirs = MustOpen((*other)->token(), 0);
  SessionStream their_stream(*stub_, theirs.session_token());
  ASSERT_TRUE(their_stream.Send(Created({1, 2})));
  ASSERT_TRUE(WaitForTensors(theirs.session_id(), 2));

  const v1::OpenSessionResponse mine = MustOpen(peer_->token(), 0, 64 * kMiB);
  SessionStream stream(*stub_, mine.session_token());
  std::mt19937_64 random(20240611);
  auto pick = [&](int n) {
    return static_cast<int>(random() % static_cast<uint64_t>(n));
  };
  const int64_t sizes[] = {0,
                           -1,
                           1,
                           4096,
                           kMiB,
                           kGiB,
                           8 * kGiB,
                           std::numeric_limits<int64_t>::max(),
                           std::numeric_limits<int64_t>::min()};
  for (int round = 0; round < 300; ++round) {
    v1::EventBatch b;
    const int entries = pick(kMaxBatchEvents + 3);
    for (int i = 0; i < entries; ++i) {
      const uint64_t id = static_cast<uint64_t>(pick(12));
      if (pick(2) == 0) {
        v1::TensorCreated* c = b.add_created();
        c->set_tensor_id(id);
        c->set_bytes(pick(3) == 0 ? sizes[pick(std::size(sizes))] : kMiB);
        c->set_compute_cost_ns(pick(10) == 0 ? -5 : pick(100000));
        for (int p = pick(3); p > 0; --p) {
          c->add_parent_ids(static_cast<uint64_t>(pick(12)));
        }
        c->mutable_flags()->set_evict_pinned(pick(4) == 0);
        c->mutable_flags()->set_offload_pinned(pick(4) == 0);
        c->mutable_flags()->set_uncomputable(pick(4) == 0);
      } else {
        v1::TensorEvent* e = b.add_events();
        e->set_kind(static_cast<v1::TensorEvent::Kind>(pick(9)));
        e->set_tensor_id(id);
        e->set_at_ns(round);
      }
    }
    b.set_device_bytes_in_use(sizes[pick(std::size(sizes))]);
    ASSERT_TRUE(stream.Send(b)) << "stream broke at round " << round;
    if (round % 50 == 0) {
      ExpectServing(absl::StrCat("random batch ", round));
      v1::ReleaseRequest release;
      release.set_session_token(mine.session_token());
      release.set_bytes(sizes[pick(std::size(sizes))]);
      (void)Release(release);
    }
  }
  ExpectServing("300 random batches");
  // None of it reached the other process's session.
  const v1::SessionStatus after = SessionOf(theirs.session_id());
  EXPECT_EQ(after.tensors(), 2u);
  EXPECT_EQ(after.device_bytes(), 2 * kMiB);
  // Ending the stream reclaims everything the session held.
  const grpc::Status s = stream.Finish();
  EXPECT_TRUE(s.ok()) << Describe(s);
  EXPECT_TRUE(WaitForSessions(1));
  EXPECT_TRUE(WaitForStatus([](const v1::NodeStatusResponse& r) {
    return r.gpus(0).used_bytes() == 2 * kMiB;
  }));
}

}  // namespace
}  // namespace deltad::testing_util
