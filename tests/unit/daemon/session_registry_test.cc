#include "daemon/session_registry.h"

#include <set>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace deltad::daemon {
namespace {

using ::testing::HasSubstr;

PeerIdentity Peer(pid_t pid, uid_t uid = 1000) {
  PeerIdentity p;
  p.pid = pid;
  p.uid = uid;
  p.gid = uid;
  return p;
}

std::string Register(SessionRegistry& r, pid_t pid) {
  auto t = r.RegisterPeer(Peer(pid));
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? *t : std::string();
}

TEST(SessionRegistry, ASessionIsBoundToTheProcessThatRegistered) {
  SessionRegistry r(8);
  const std::string peer = Register(r, 4242);
  auto s = r.Open(peer, 3, 2, "job-a rank 0");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->peer.pid, 4242);
  EXPECT_EQ(s->gpu, 3);
  EXPECT_EQ(s->priority, 2u);
  auto auth = r.Authorize(s->token);
  ASSERT_TRUE(auth.ok());
  EXPECT_EQ(auth->id, s->id);
}

TEST(SessionRegistry, OpeningNeedsALivePeerToken) {
  SessionRegistry r(8);
  auto s = r.Open("not-a-token", 0, 1, "");
  EXPECT_EQ(s.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_THAT(s.status().message(), HasSubstr("side socket"));
}

TEST(SessionRegistry, TokensAreUnguessableAndDistinct) {
  SessionRegistry r(64);
  std::set<std::string> seen;
  for (pid_t pid = 1; pid <= 50; ++pid) {
    const std::string peer = Register(r, pid);
    auto s = r.Open(peer, 0, 1, "");
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(peer.size(), 32u);  // 128 bits as hex
    EXPECT_EQ(s->token.size(), 32u);
    EXPECT_TRUE(seen.insert(peer).second);
    EXPECT_TRUE(seen.insert(s->token).second);
  }
}

TEST(SessionRegistry, APeerTokenIsNotASessionTokenNorTheOtherWay) {
  SessionRegistry r(8);
  const std::string peer = Register(r, 1);
  auto s = r.Open(peer, 0, 1, "");
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(r.Authorize(peer).status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(r.Open(s->token, 1, 1, "").status().code(),
            absl::StatusCode::kUnauthenticated);
}

TEST(SessionRegistry, OneSessionPerProcessAndGpu) {
  SessionRegistry r(8);
  const std::string peer = Register(r, 7);
  ASSERT_TRUE(r.Open(peer, 0, 1, "").ok());
  EXPECT_EQ(r.Open(peer, 0, 1, "").status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_TRUE(r.Open(peer, 1, 1, "").ok());  // another GPU is fine
}

TEST(SessionRegistry, TheSessionLimitPerGpuIsEnforced) {
  SessionRegistry r(2);
  ASSERT_TRUE(r.Open(Register(r, 1), 0, 1, "").ok());
  ASSERT_TRUE(r.Open(Register(r, 2), 0, 1, "").ok());
  SessionLimit refused_at = SessionLimit::kNone;
  auto third = r.Open(Register(r, 3), 0, 1, "", &refused_at);
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(third.status().message(), HasSubstr("maximum of 2"));
  EXPECT_EQ(refused_at, SessionLimit::kPerGpu);
  EXPECT_TRUE(r.Open(Register(r, 4), 1, 1, "").ok());
}

TEST(SessionRegistry, TheSessionLimitPerUidIsEnforcedOnAllGpus) {
  SessionRegistry r(8, /*max_sessions_per_uid=*/2);
  const std::string p1 = Register(r, 1);
  ASSERT_TRUE(r.Open(p1, 0, 1, "").ok());
  ASSERT_TRUE(r.Open(p1, 1, 1, "").ok());
  SessionLimit refused_at = SessionLimit::kNone;
  auto third = r.Open(Register(r, 2), 2, 1, "",  // same uid, other process
                      &refused_at);
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(third.status().message(),
              HasSubstr("limits.max_sessions_per_uid"));
  EXPECT_EQ(refused_at, SessionLimit::kPerUid);  // counted under its name
  PeerIdentity other = Peer(3);
  other.uid += 1;
  auto token = r.RegisterPeer(other);
  ASSERT_TRUE(token.ok());
  EXPECT_TRUE(r.Open(*token, 2, 1, "").ok()) << "another user is not held";
}

TEST(SessionRegistry, ClosingRevokesTheToken) {
  SessionRegistry r(8);
  auto s = r.Open(Register(r, 1), 0, 1, "");
  ASSERT_TRUE(s.ok());
  ASSERT_TRUE(r.Close(s->token).ok());
  EXPECT_EQ(r.Authorize(s->token).status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(r.Close(s->token).status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(r.SessionsOnGpu(0), 0u);
}

TEST(SessionRegistry, AProcessThatGoesAwayLosesEverySessionAndItsToken) {
  SessionRegistry r(8);
  const std::string dying = Register(r, 10);
  const std::string other = Register(r, 11);
  auto a = r.Open(dying, 0, 1, "");
  auto b = r.Open(dying, 1, 1, "");
  auto c = r.Open(other, 0, 1, "");
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  const std::vector<SessionInfo> closed = r.ForgetPeer(dying);
  ASSERT_EQ(closed.size(), 2u);
  EXPECT_EQ(r.Authorize(a->token).status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(r.Authorize(b->token).status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_TRUE(r.Authorize(c->token).ok());  // the other process is untouched
  EXPECT_EQ(r.Open(dying, 2, 1, "").status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_TRUE(r.ForgetPeer(dying).empty());  // twice is harmless
}

TEST(SessionRegistry, ConcurrentOpensNeverExceedTheLimit) {
  SessionRegistry r(16);
  std::vector<std::string> peers;
  for (pid_t pid = 1; pid <= 64; ++pid) peers.push_back(Register(r, pid));
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = t; i < 64; i += 4) (void)r.Open(peers[i], 0, 1, "");
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(r.SessionsOnGpu(0), 16u);
  std::set<SessionId> ids;
  for (const SessionInfo& s : r.List()) ids.insert(s.id);
  EXPECT_EQ(ids.size(), 16u);
}

}  // namespace
}  // namespace deltad::daemon
