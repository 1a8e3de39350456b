// Bad input on the side socket: unknown tags, malformed messages, and
// requests for another session's slabs and chunks.
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/side_protocol.h"
#include "common/unix_socket.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/integration/bad_input_fixture.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/daemon_test.h"

namespace deltad::testing_util {
namespace {

namespace side = common::side;
using ::testing::HasSubstr;

// --- The side socket --------------------------------------------------------

TEST_F(BadInputTest, SideSocketUnknownTagGetsAnErrorAndTheConnectionEnds) {
  auto garbage = Peer::Connect(daemon_->side_socket_path());
  ASSERT_TRUE(garbage.ok()) << garbage.status();
  const v1::OpenSessionResponse doomed = MustOpen(garbage->token(), 1);
  for (uint64_t tag :
       {uint64_t{0}, uint64_t{99}, std::numeric_limits<uint64_t>::max()}) {
    SCOPED_TRACE(absl::StrCat("tag ", tag));
    auto peer = Peer::Connect(daemon_->side_socket_path());
    ASSERT_TRUE(peer.ok()) << peer.status();
    ASSERT_TRUE(peer->Send(tag, "whatever").ok());
    auto answer = peer->Receive();
    ASSERT_TRUE(answer.ok()) << answer.status();
    EXPECT_EQ(answer->tag, side::kError);
    EXPECT_THAT(answer->payload, HasSubstr(absl::StrCat(
                                     "unknown side-socket message tag ", tag)));
    EXPECT_TRUE(peer->WaitClosedByDaemon());
    ExpectServing("an unknown side-socket tag");
  }
  // A process that breaks the protocol loses its sessions, as if it died.
  ASSERT_TRUE(garbage->Send(side::kSlab, "x").ok());
  EXPECT_TRUE(garbage->WaitClosedByDaemon());
  EXPECT_TRUE(WaitForSessions(0));
  EXPECT_EQ(SessionOf(doomed.session_id()).session_id(), 0u);
}

TEST_F(BadInputTest, SideSocketMalformedMessagesCloseOnlyThatConnection) {
  const v1::OpenSessionResponse mine = MustOpen(peer_->token(), 0, 64 * kMiB);
  // A payload over the protocol's bound.
  {
    auto peer = Peer::Connect(daemon_->side_socket_path());
    ASSERT_TRUE(peer.ok()) << peer.status();
    ASSERT_TRUE(peer->Send(side::kSlabsWanted,
                           std::string(side::kMaxMessageBytes + 1, 'p'))
                    .ok());
    EXPECT_TRUE(peer->WaitClosedByDaemon());
    ExpectServing("an oversized side-socket payload");
  }
  // Descriptors sent to the daemon, which never accepts any.
  {
    auto peer = Peer::Connect(daemon_->side_socket_path());
    ASSERT_TRUE(peer.ok()) << peer.status();
    const int fds[] = {0, 1, 2};
    ASSERT_TRUE(peer->Send(side::kSlabsWanted, mine.session_token(), fds).ok());
    EXPECT_TRUE(peer->WaitClosedByDaemon());
    ExpectServing("descriptors sent to the side socket");
  }
  // A header announcing a huge payload, then nothing.
  {
    auto fd = common::ConnectUnix(daemon_->side_socket_path());
    ASSERT_TRUE(fd.ok()) << fd.status();
    char header[common::kHeaderBytes];
    const uint64_t tag = side::kSlabsWanted;
    const uint32_t length = std::numeric_limits<uint32_t>::max();
    std::memcpy(header, &tag, sizeof tag);
    std::memcpy(header + sizeof tag, &length, sizeof length);
    ASSERT_EQ(::send(fd->get(), header, sizeof header, MSG_NOSIGNAL),
              static_cast<ssize_t>(sizeof header));
    ExpectServing("a side-socket header announcing 4 GiB");
  }
  // Half a header, then the connection closes.
  {
    auto fd = common::ConnectUnix(daemon_->side_socket_path());
    ASSERT_TRUE(fd.ok()) << fd.status();
    ASSERT_EQ(::send(fd->get(), "\x02\x00\x00", 3, MSG_NOSIGNAL), 3);
  }
  ExpectServing("half a side-socket header");
  // Many connections at once, dropped at once.
  {
    std::vector<common::UniqueFd> many;
    for (int i = 0; i < 200; ++i) {
      auto fd = common::ConnectUnix(daemon_->side_socket_path());
      ASSERT_TRUE(fd.ok()) << i << ": " << fd.status();
      many.push_back(std::move(*fd));
    }
  }
  ExpectServing("200 side connections");
  // None of it touched the well-behaved peer.
  EXPECT_EQ(Status().sessions_size(), 1);
  auto slabs = peer_->FetchSlabs(mine.session_token());
  ASSERT_TRUE(slabs.ok()) << slabs.status();
  EXPECT_EQ(slabs->size(), 1u);
}

TEST_F(BadInputTest, SlabsOfAnotherProcessSessionArePermissionDenied) {
  auto other = PeerProcess::Start(daemon_->side_socket_path());
  ASSERT_TRUE(other.ok()) << other.status();
  const v1::OpenSessionResponse theirs =
      MustOpen((*other)->token(), 0, 128 * kMiB);
  ASSERT_EQ(theirs.host_slabs_size(), 2);
  const v1::OpenSessionResponse mine = MustOpen(peer_->token(), 0, 64 * kMiB);
  ASSERT_EQ(mine.host_slabs_size(), 1);

  auto stolen = peer_->FetchSlabs(theirs.session_token());
  ASSERT_FALSE(stolen.ok());
  EXPECT_THAT(stolen.status().message(), HasSubstr("PERMISSION_DENIED"));
  EXPECT_THAT(stolen.status().message(),
              HasSubstr(absl::StrCat("session ", theirs.session_id(),
                                     " belongs to another process")));
  // A second connection of this very process is another peer too: slabs
  // go only over the connection whose token opened the session.
  auto second = Peer::Connect(daemon_->side_socket_path());
  ASSERT_TRUE(second.ok()) << second.status();
  stolen = second->FetchSlabs(mine.session_token());
  ASSERT_FALSE(stolen.ok());
  EXPECT_THAT(stolen.status().message(), HasSubstr("PERMISSION_DENIED"));

  for (const std::string& token :
       {std::string(), std::string("bogus"), std::string(4000, 'z')}) {
    auto unknown = peer_->FetchSlabs(token);
    ASSERT_FALSE(unknown.ok());
    EXPECT_THAT(unknown.status().message(), HasSubstr("UNAUTHENTICATED"));
  }
  ExpectServing("asking for another process's slabs");

  // The connection stays usable after refusals: the own slabs come, with
  // descriptors that map memory of the announced size.
  auto own = peer_->FetchSlabs(mine.session_token());
  ASSERT_TRUE(own.ok()) << own.status();
  ASSERT_EQ(own->size(), 1u);
  EXPECT_EQ((*own)[0].id, mine.host_slabs(0).slab_id());
  EXPECT_EQ((*own)[0].bytes, 64 * kMiB);
  struct stat st;
  ASSERT_EQ(::fstat((*own)[0].fd.get(), &st), 0);
  EXPECT_GE(st.st_size, 64 * kMiB);
  void* mapped = ::mmap(nullptr, 64 * kMiB, PROT_READ | PROT_WRITE, MAP_SHARED,
                        (*own)[0].fd.get(), 0);
  ASSERT_NE(mapped, MAP_FAILED);
  static_cast<char*>(mapped)[64 * kMiB - 1] = 1;
  ::munmap(mapped, 64 * kMiB);
  // The other session is untouched.
  EXPECT_EQ(SessionOf(theirs.session_id()).gpu(), 0);
  EXPECT_EQ(Status().sessions_size(), 2);
}

TEST_F(BadInputTest, ChunksOfAnotherSessionCannotBeFetchedOrReturned) {
  // Two connections of this process are two peers; one session each.
  auto other = Peer::Connect(daemon_->side_socket_path());
  ASSERT_TRUE(other.ok()) << other.status();
  const v1::OpenSessionResponse mine = MustOpen(peer_->token(), 0);
  const v1::OpenSessionResponse theirs = MustOpen(other->token(), 1);
  ASSERT_GT(mine.chunk_bytes(), 0);
  EXPECT_EQ(mine.backend(), "sim");

  auto own = peer_->FetchChunks(mine.session_token(), 4 * mine.chunk_bytes());
  ASSERT_TRUE(own.ok()) << own.status();
  ASSERT_EQ(own->size(), 4u);
  struct stat st;
  ASSERT_EQ(::fstat((*own)[0].fd.get(), &st), 0);
  EXPECT_EQ(st.st_size, mine.chunk_bytes());
  auto their_own =
      other->FetchChunks(theirs.session_token(), theirs.chunk_bytes());
  ASSERT_TRUE(their_own.ok()) << their_own.status();
  ASSERT_EQ(their_own->size(), 1u);

  // Another peer's session: no chunks for it over this connection.
  auto stolen = peer_->FetchChunks(theirs.session_token(), 1 << 30);
  ASSERT_FALSE(stolen.ok());
  EXPECT_THAT(stolen.status().message(), HasSubstr("PERMISSION_DENIED"));
  // Its chunks cannot be returned in this session's name, alone or beside
  // this session's own: nothing is returned at all.
  const uint64_t their_chunk = (*their_own)[0].id;
  for (const std::vector<uint64_t>& ids :
       {std::vector<uint64_t>{their_chunk},
        std::vector<uint64_t>{(*own)[0].id, their_chunk}}) {
    const absl::Status s = peer_->ReturnChunks(mine.session_token(), ids);
    EXPECT_THAT(s.message(), HasSubstr("NOT_FOUND")) << s;
  }
  // Nor in the other session's name over this connection.
  EXPECT_THAT(
      peer_->ReturnChunks(theirs.session_token(), {their_chunk}).message(),
      HasSubstr("PERMISSION_DENIED"));
  EXPECT_EQ(SessionOf(mine.session_id()).chunk_bytes(), 4 * mine.chunk_bytes());
  EXPECT_EQ(SessionOf(theirs.session_id()).chunk_bytes(), theirs.chunk_bytes());

  // Malformed requests are refused and the connection carries on.
  ASSERT_TRUE(peer_->Send(side::kChunksWanted, "short").ok());
  auto answer = peer_->Receive();
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_EQ(answer->tag, side::kError);
  EXPECT_THAT(answer->payload, HasSubstr("malformed chunk request"));
  ASSERT_TRUE(peer_
                  ->Send(side::kChunksWanted,
                         side::EncodeChunksWanted({mine.session_token(), -1}))
                  .ok());
  answer = peer_->Receive();
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_EQ(answer->tag, side::kError);
  for (const std::string& payload :
       {std::string(), std::string(3, 'x'), std::string("\xff\xff\xff\x7f"),
        side::EncodeChunksReturned({mine.session_token(), {}}) + "odd"}) {
    ASSERT_TRUE(peer_->Send(side::kChunksReturned, payload).ok());
    answer = peer_->Receive();
    ASSERT_TRUE(answer.ok()) << answer.status();
    EXPECT_EQ(answer->tag, side::kError);
    EXPECT_THAT(answer->payload, HasSubstr("malformed chunk return"));
  }
  ExpectServing("chunk requests naming other sessions");

  // The own chunks go back; the GPU's accounting follows.
  std::vector<uint64_t> ids;
  for (const Peer::Grant& g : *own) ids.push_back(g.id);
  EXPECT_TRUE(peer_->ReturnChunks(mine.session_token(), ids).ok());
  EXPECT_EQ(SessionOf(mine.session_id()).chunk_bytes(), 0);
  EXPECT_EQ(Status().gpus(0).chunk_bytes(), 0);
}

}  // namespace
}  // namespace deltad::testing_util
