#include "common/unix_socket.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace deltad::common {
namespace {

using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::SizeIs;

bool IsOpen(int fd) { return ::fcntl(fd, F_GETFD) != -1; }

int OpenFdCount() {
  int n = 0;
  for (const auto& entry :
       std::filesystem::directory_iterator("/proc/self/fd")) {
    (void)entry;
    ++n;
  }
  return n;
}

// Both ends of a connected stream socketpair.
struct Pair {
  UniqueFd a;
  UniqueFd b;
};

Pair MakePair() {
  int fds[2];
  EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
  return Pair{UniqueFd(fds[0]), UniqueFd(fds[1])};
}

// A memfd holding `text`.
UniqueFd MemfdWith(const std::string& text) {
  UniqueFd fd(::memfd_create("unix-socket-test", MFD_CLOEXEC));
  EXPECT_TRUE(fd.valid());
  EXPECT_EQ(::pwrite(fd.get(), text.data(), text.size(), 0),
            static_cast<ssize_t>(text.size()));
  return fd;
}

std::string ReadAll(int fd, size_t n) {
  std::string out(n, '\0');
  const ssize_t got = ::pread(fd, out.data(), n, 0);
  out.resize(got < 0 ? 0 : got);
  return out;
}

// A fresh directory, removed with its contents at the end of the test.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = "/tmp/deltad-sock-XXXXXX";
    char* made = ::mkdtemp(tmpl.data());
    EXPECT_NE(made, nullptr);
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string Path(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Waits for `pid` and returns its exit status, or -1 when it did not exit.
int ExitCodeOf(pid_t pid) {
  int status = 0;
  if (::waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// --- UniqueFd
// -----------------------------------------------------------------

TEST(UniqueFd, ClosesOnDestruction) {
  int raw;
  {
    UniqueFd fd(::dup(STDERR_FILENO));
    raw = fd.get();
    ASSERT_TRUE(IsOpen(raw));
  }
  EXPECT_FALSE(IsOpen(raw));
}

TEST(UniqueFd, MoveTransfersOwnership) {
  UniqueFd a(::dup(STDERR_FILENO));
  const int raw = a.get();
  UniqueFd b(std::move(a));
  EXPECT_FALSE(a.valid());  // NOLINT(bugprone-use-after-move): checked
  EXPECT_EQ(b.get(), raw);
  UniqueFd c;
  c = std::move(b);
  EXPECT_EQ(c.get(), raw);
  EXPECT_TRUE(IsOpen(raw));
  c = UniqueFd();
  EXPECT_FALSE(IsOpen(raw));
}

TEST(UniqueFd, ReleaseGivesUpOwnershipAndResetClosesTheOldOne) {
  UniqueFd a(::dup(STDERR_FILENO));
  const int raw = a.release();
  EXPECT_FALSE(a.valid());
  EXPECT_TRUE(IsOpen(raw));
  a.reset(raw);
  UniqueFd b(::dup(STDERR_FILENO));
  const int other = b.get();
  a.reset(b.release());
  EXPECT_FALSE(IsOpen(raw));
  EXPECT_TRUE(IsOpen(other));
}

// --- PeerCredentials
// ------------------------------------------------------------

TEST(PeerCredentials, ReturnsThisProcessOverASocketpair) {
  Pair p = MakePair();
  auto cred = PeerCredentials(p.a.get());
  ASSERT_TRUE(cred.ok()) << cred.status();
  EXPECT_EQ(cred->pid, ::getpid());
  EXPECT_EQ(cred->uid, ::getuid());
  EXPECT_EQ(cred->gid, ::getgid());
}

TEST(PeerCredentials, FailsOnSomethingThatIsNotASocket) {
  UniqueFd fd = MemfdWith("x");
  auto cred = PeerCredentials(fd.get());
  EXPECT_FALSE(cred.ok());
  EXPECT_THAT(cred.status().message(), HasSubstr("SO_PEERCRED"));
}

TEST(PeerCredentials, ReturnsTheChildThatConnectedAcrossFork) {
  TempDir dir;
  const std::string path = dir.Path("d.sock");
  auto listener = ListenUnix(path, 0600);
  ASSERT_TRUE(listener.ok()) << listener.status();

  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto conn = ConnectUnix(path);
    if (!conn.ok()) ::_exit(2);
    char byte;  // wait for the parent to look before going away
    (void)!::read(conn->get(), &byte, 1);
    ::_exit(0);
  }
  UniqueFd conn(::accept4(listener->get(), nullptr, nullptr, SOCK_CLOEXEC));
  ASSERT_TRUE(conn.valid());
  auto cred = PeerCredentials(conn.get());
  ASSERT_TRUE(cred.ok()) << cred.status();
  EXPECT_EQ(cred->pid, child);
  EXPECT_NE(cred->pid, ::getpid());
  EXPECT_EQ(cred->uid, ::getuid());
  conn.reset();  // lets the child's read return
  EXPECT_EQ(ExitCodeOf(child), 0);
}

// --- SendFds / RecvFds
// ----------------------------------------------------------

TEST(FdPassing, CarriesTheTagAndADescriptorToTheSameFile) {
  Pair p = MakePair();
  UniqueFd file = MemfdWith("hello");
  ASSERT_TRUE(SendFds(p.a.get(), 0xDEADBEEFCAFEF00Dull, {file.get()}).ok());
  auto got = RecvFds(p.b.get(), 4);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->tag, 0xDEADBEEFCAFEF00Dull);
  ASSERT_THAT(got->fds, SizeIs(1));
  UniqueFd received(got->fds[0]);
  EXPECT_NE(received.get(), file.get());
  EXPECT_EQ(ReadAll(received.get(), 5), "hello");
  EXPECT_TRUE(::fcntl(received.get(), F_GETFD) & FD_CLOEXEC);
}

TEST(FdPassing, KeepsTheOrderOfSeveralDescriptors) {
  Pair p = MakePair();
  std::vector<UniqueFd> files;
  std::vector<int> raw;
  for (int i = 0; i < 5; ++i) {
    files.push_back(MemfdWith("file" + std::to_string(i)));
    raw.push_back(files.back().get());
  }
  ASSERT_TRUE(SendFds(p.a.get(), 7, raw).ok());
  auto got = RecvFds(p.b.get(), 5);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_THAT(got->fds, SizeIs(5));
  for (int i = 0; i < 5; ++i) {
    UniqueFd fd(got->fds[i]);
    EXPECT_EQ(ReadAll(fd.get(), 5), "file" + std::to_string(i));
  }
}

TEST(FdPassing, ATagWithoutDescriptorsArrivesAlone) {
  Pair p = MakePair();
  ASSERT_TRUE(SendFds(p.a.get(), 42, {}).ok());
  ASSERT_TRUE(SendFds(p.a.get(), 43, {}).ok());
  auto first = RecvFds(p.b.get(), 0);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->tag, 42u);
  EXPECT_THAT(first->fds, IsEmpty());
  auto second = RecvFds(p.b.get(), 3);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->tag, 43u);
}

TEST(FdPassing, CarriesAPayloadBesideTheDescriptors) {
  Pair p = MakePair();
  UniqueFd file = MemfdWith("x");
  const std::string big(kMaxPayloadBytes, 'z');
  ASSERT_TRUE(SendFds(p.a.get(), 5, {file.get()}, "token-123").ok());
  ASSERT_TRUE(SendFds(p.a.get(), 6, {}, big).ok());
  auto first = RecvFds(p.b.get(), 1);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->tag, 5u);
  EXPECT_EQ(first->payload, "token-123");
  ASSERT_EQ(first->fds.size(), 1u);
  ::close(first->fds[0]);
  auto second = RecvFds(p.b.get(), 0);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->tag, 6u);
  EXPECT_EQ(second->payload, big);
}

TEST(FdPassing, APayloadOverTheLimitIsRefusedOnBothEnds) {
  Pair p = MakePair();
  EXPECT_EQ(
      SendFds(p.a.get(), 1, {}, std::string(kMaxPayloadBytes + 1, 'a')).code(),
      absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(SendFds(p.a.get(), 1, {}, std::string(100, 'a')).ok());
  auto got = RecvFds(p.b.get(), 0, /*max_payload=*/99);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(got.status().message(), HasSubstr("100 bytes"));
}

TEST(FdPassing, MoreDescriptorsThanAllowedIsAnErrorAndLeaksNone) {
  Pair p = MakePair();
  UniqueFd f1 = MemfdWith("1");
  UniqueFd f2 = MemfdWith("2");
  UniqueFd f3 = MemfdWith("3");
  const int before = OpenFdCount();
  ASSERT_TRUE(SendFds(p.a.get(), 1, {f1.get(), f2.get(), f3.get()}).ok());
  auto got = RecvFds(p.b.get(), 1);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(got.status().message(), HasSubstr("truncated"));
  EXPECT_EQ(OpenFdCount(), before);
}

// Regression: CMSG_SPACE rounds up, so with an odd limit one descriptor more
// than allowed arrived without MSG_CTRUNC and was handed to the caller.
TEST(FdPassing, OneDescriptorOverAnOddLimitIsAnErrorAndLeaksNone) {
  for (int limit : {1, 3}) {
    Pair p = MakePair();
    std::vector<UniqueFd> owned;
    std::vector<int> fds;
    for (int i = 0; i <= limit; ++i) {
      owned.push_back(MemfdWith("x"));
      fds.push_back(owned.back().get());
    }
    const int before = OpenFdCount();
    ASSERT_TRUE(SendFds(p.a.get(), 1, fds).ok());
    auto got = RecvFds(p.b.get(), limit);
    EXPECT_EQ(got.status().code(), absl::StatusCode::kResourceExhausted)
        << "limit " << limit;
    EXPECT_EQ(OpenFdCount(), before) << "limit " << limit;
  }
}

TEST(FdPassing, ADescriptorWhenNoneAreAllowedIsAnErrorAndLeaksNone) {
  Pair p = MakePair();
  UniqueFd f1 = MemfdWith("1");
  const int before = OpenFdCount();
  ASSERT_TRUE(SendFds(p.a.get(), 1, {f1.get()}).ok());
  auto got = RecvFds(p.b.get(), 0);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(OpenFdCount(), before);
}

TEST(FdPassing, ReceivingFromAClosedPeerIsUnavailable) {
  Pair p = MakePair();
  p.a.reset();
  auto got = RecvFds(p.b.get(), 1);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(got.status().message(), HasSubstr("closed"));
}

TEST(FdPassing, SendingToAClosedPeerIsAnErrorNotSigpipe) {
  Pair p = MakePair();
  p.b.reset();
  UniqueFd f = MemfdWith("x");
  absl::Status s = SendFds(p.a.get(), 1, {f.get()});
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr("sendmsg"));
}

TEST(FdPassing, RejectsBadArguments) {
  Pair p = MakePair();
  std::vector<int> too_many(kMaxFdsPerMessage + 1, STDERR_FILENO);
  EXPECT_EQ(SendFds(p.a.get(), 1, too_many).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SendFds(p.a.get(), 1, {-1}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RecvFds(p.b.get(), -1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RecvFds(p.b.get(), kMaxFdsPerMessage + 1).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(FdPassing, ChildMapsAMemfdAndReadsWhatTheParentWrote) {
  struct {
    UniqueFd owned;
    int fd;
    int64_t bytes;
  } s{UniqueFd(::memfd_create("fd-passing", MFD_CLOEXEC)), -1,
      ::sysconf(_SC_PAGESIZE)};
  ASSERT_TRUE(s.owned.valid());
  s.fd = s.owned.get();
  ASSERT_EQ(::ftruncate(s.fd, s.bytes), 0);
  void* p =
      ::mmap(nullptr, s.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, s.fd, 0);
  ASSERT_NE(p, MAP_FAILED);
  auto* bytes = static_cast<unsigned char*>(p);
  for (int64_t i = 0; i < s.bytes; ++i) bytes[i] = static_cast<uint8_t>(i * 7);

  Pair pair = MakePair();
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // Only what arrives over the socket: drop the inherited slab mapping.
    ::munmap(p, s.bytes);
    pair.a.reset();
    auto got = RecvFds(pair.b.get(), 1);
    if (!got.ok() || got->tag != 99 || got->fds.size() != 1) ::_exit(2);
    void* q = ::mmap(nullptr, s.bytes, PROT_READ | PROT_WRITE, MAP_SHARED,
                     got->fds[0], 0);
    if (q == MAP_FAILED) ::_exit(3);
    auto* seen = static_cast<unsigned char*>(q);
    for (int64_t i = 0; i < s.bytes; ++i) {
      if (seen[i] != static_cast<uint8_t>(i * 7)) ::_exit(4);
    }
    seen[0] = 0xEE;  // an answer the parent reads through its own mapping
    ::_exit(0);
  }
  pair.b.reset();
  ASSERT_TRUE(SendFds(pair.a.get(), 99, {s.fd}).ok());
  EXPECT_EQ(ExitCodeOf(child), 0);
  EXPECT_EQ(bytes[0], 0xEE);
  ::munmap(p, s.bytes);
}

// --- ListenUnix / ConnectUnix
// -----------------------------------------------------

TEST(ListenUnix, SetsTheModeAndConnectUnixReachesIt) {
  TempDir dir;
  for (mode_t mode : {mode_t{0660}, mode_t{0600}}) {
    const std::string path = dir.Path("mode.sock");
    auto listener = ListenUnix(path, mode);
    ASSERT_TRUE(listener.ok()) << listener.status();
    struct stat st;
    ASSERT_EQ(::stat(path.c_str(), &st), 0);
    EXPECT_TRUE(S_ISSOCK(st.st_mode));
    EXPECT_EQ(st.st_mode & 07777, mode);
    EXPECT_TRUE(::fcntl(listener->get(), F_GETFD) & FD_CLOEXEC);

    auto client = ConnectUnix(path);
    ASSERT_TRUE(client.ok()) << client.status();
    UniqueFd server(::accept4(listener->get(), nullptr, nullptr, SOCK_CLOEXEC));
    ASSERT_TRUE(server.valid());
    ASSERT_TRUE(SendFds(client->get(), 5, {}).ok());
    auto got = RecvFds(server.get(), 0);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->tag, 5u);
    auto cred = PeerCredentials(server.get());
    ASSERT_TRUE(cred.ok()) << cred.status();
    EXPECT_EQ(cred->pid, ::getpid());
  }
}

TEST(ListenUnix, MissingDirectoryIsNotFound) {
  TempDir dir;
  const std::string path = dir.Path("no/such/dir/d.sock");
  auto listener = ListenUnix(path, 0660);
  EXPECT_EQ(listener.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(listener.status().message(),
              HasSubstr("directory " + dir.Path("no/such/dir") +
                        " of socket path " + path + " does not exist"));
}

TEST(ListenUnix, ReplacesAStaleSocketFile) {
  TempDir dir;
  const std::string path = dir.Path("stale.sock");
  {
    auto old = ListenUnix(path, 0660);
    ASSERT_TRUE(old.ok()) << old.status();
  }  // closed: the file stays, nobody listens
  ASSERT_TRUE(std::filesystem::exists(path));
  auto listener = ListenUnix(path, 0660);
  ASSERT_TRUE(listener.ok()) << listener.status();
  EXPECT_TRUE(ConnectUnix(path).ok());
}

TEST(ListenUnix, RefusesToTakeOverALiveSocket) {
  TempDir dir;
  const std::string path = dir.Path("live.sock");
  auto first = ListenUnix(path, 0660);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = ListenUnix(path, 0660);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(second.status().message(), HasSubstr("another process"));
  EXPECT_TRUE(ConnectUnix(path).ok()) << "the first one must still work";
}

// Clients wait for the socket file, then connect: the file must not appear
// before the socket listens (a CI run once saw "connection refused" there).
TEST(ListenUnix, AClientThatSeesTheFileConnectsAtOnce) {
  TempDir dir;
  for (int i = 0; i < 50; ++i) {
    const std::string path = dir.Path(absl::StrCat("race", i, ".sock"));
    absl::Status connected = absl::UnknownError("never saw the file");
    std::thread client([&] {
      struct stat st;
      while (::stat(path.c_str(), &st) != 0) std::this_thread::yield();
      connected = ConnectUnix(path).status();
    });
    auto listener = ListenUnix(path, 0660);
    client.join();
    ASSERT_TRUE(listener.ok()) << listener.status();
    ASSERT_TRUE(connected.ok()) << "try " << i << ": " << connected;
  }
  int files = 0;  // no private name is left behind
  for (const auto& entry : std::filesystem::directory_iterator(dir.Path(""))) {
    EXPECT_THAT(entry.path().filename().string(), testing::EndsWith(".sock"));
    ++files;
  }
  EXPECT_EQ(files, 50);
}

TEST(ListenUnix, APathWithNoRoomForItsPrivateNameIsBoundInPlace) {
  TempDir dir;
  const size_t most = sizeof(sockaddr_un{}.sun_path) - 1;
  const std::string path =
      dir.Path(std::string(most - dir.Path("").size(), 'p'));
  ASSERT_EQ(path.size(), most);
  auto listener = ListenUnix(path, 0600);
  ASSERT_TRUE(listener.ok()) << listener.status();
  struct stat st;
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  EXPECT_TRUE(ConnectUnix(path).ok());
}

TEST(ListenUnix, RefusesToReplaceSomethingThatIsNotASocket) {
  TempDir dir;
  const std::string path = dir.Path("file");
  UniqueFd file(::open(path.c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0600));
  ASSERT_TRUE(file.valid());
  auto listener = ListenUnix(path, 0660);
  EXPECT_EQ(listener.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(listener.status().message(), HasSubstr("not a socket"));
  EXPECT_TRUE(std::filesystem::is_regular_file(path));
}

TEST(ListenUnix, RejectsABadPathOrMode) {
  TempDir dir;
  EXPECT_EQ(ListenUnix(dir.Path(std::string(200, 'x')), 0660).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ListenUnix("", 0660).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ListenUnix(dir.Path("m.sock"), 010000).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ConnectUnix, NothingListeningIsUnavailable) {
  TempDir dir;
  auto missing_dir = ConnectUnix(dir.Path("no/such/dir/d.sock"));
  EXPECT_EQ(missing_dir.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(missing_dir.status().message(), HasSubstr("no such file"));
  const std::string path = dir.Path("stale.sock");
  { ASSERT_TRUE(ListenUnix(path, 0660).ok()); }
  auto refused = ConnectUnix(path);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(refused.status().message(), HasSubstr("connection refused"));
}

}  // namespace
}  // namespace deltad::common
