#include "tests/integration/daemon_process.h"

#include <poll.h>
#include <stdlib.h>
#include <sys/socket.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/side_protocol.h"

#ifndef DELTAD_BINARY
#error \
    "DELTAD_BINARY must name the deltad binary (tests/integration/CMakeLists.txt)"
#endif
#ifndef DELTAD_SIDE_PEER_BINARY
#error "DELTAD_SIDE_PEER_BINARY must name the side peer helper binary"
#endif

namespace deltad::testing_util {

namespace side = common::side;

namespace {

// A Unix socket path must fit in sun_path (108 bytes), ".fds" included, so
// a long $TMPDIR is passed over for /tmp.
std::string TempBase() {
  const char* tmp = std::getenv("TMPDIR");
  if (tmp != nullptr && tmp[0] == '/' && std::string(tmp).size() < 48) {
    return tmp;
  }
  return "/tmp";
}

absl::StatusOr<std::string> MakeTempDir() {
  std::string pattern = TempBase() + "/deltad-it.XXXXXX";
  if (::mkdtemp(pattern.data()) == nullptr) {
    return absl::ErrnoToStatus(errno, absl::StrCat("mkdtemp ", pattern));
  }
  return pattern;
}

absl::Status WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

// Waits up to `timeout` for `fd` to be readable (or closed by the other
// end).
absl::Status WaitReadable(int fd, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(absl::StrCat(
          "nothing to read within ", absl::FormatDuration(timeout)));
    }
    struct pollfd p = {fd, POLLIN, 0};
    const int ready = ::poll(&p, 1,
                             static_cast<int>(absl::ToInt64Milliseconds(
                                 left + absl::Milliseconds(1))));
    if (ready > 0) return absl::OkStatus();
    if (ready < 0 && errno != EINTR) return absl::ErrnoToStatus(errno, "poll");
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<DaemonProcess>> DaemonProcess::Start(
    DaemonOptions options) {
  std::unique_ptr<DaemonProcess> d(new DaemonProcess());
  auto dir = MakeTempDir();
  if (!dir.ok()) return dir.status();
  d->dir_ = *dir;
  d->socket_path_ = options.socket_path.empty() ? d->dir_ + "/deltad.sock"
                                                : options.socket_path;
  d->log_path_ = d->dir_ + "/deltad.log";
  // Always a config file of our own, even an empty one: the default path
  // (/etc/deltad/deltad.conf) would let the machine's config into the test.
  const std::string config_path = d->dir_ + "/deltad.conf";
  if (absl::Status s = WriteFile(config_path, options.config_text); !s.ok()) {
    return s;
  }

  std::vector<std::string> argv = {
      DELTAD_BINARY,
      "--config=" + config_path,
      "--socket=" + d->socket_path_,
      "--metrics=127.0.0.1:0",
      "--backend=sim",
  };
  if (options.sim_gpus > 0) {
    argv.push_back(absl::StrCat("--sim_gpus=", options.sim_gpus));
  }
  const std::pair<const char*, const std::string*> sizes[] = {
      {"--sim_memory=", &options.sim_memory},
      {"--host_pool=", &options.host_pool},
      {"--host_slab=", &options.host_slab},
  };
  for (const auto& [flag, value] : sizes) {
    if (!value->empty()) argv.push_back(flag + *value);
  }
  for (const std::string& f : options.flags) argv.push_back(f);

  SpawnOptions spawn;
  spawn.output_file = d->log_path_;
  spawn.env = options.env;
  auto process = ChildProcess::Spawn(argv, spawn);
  if (!process.ok()) return process.status();
  d->process_ = std::move(*process);
  if (options.wait_ready) {
    if (absl::Status ready = d->WaitReady(options.ready_timeout); !ready.ok()) {
      const ExitStatus e = d->process_->Kill();
      return absl::Status(ready.code(),
                          absl::StrCat(ready.message(), " (", e.ToString(),
                                       ")\ncommand:", absl::StrJoin(argv, " "),
                                       "\n--- deltad output ---\n", d->Output(),
                                       "--- end of deltad output ---"));
    }
  }
  return d;
}

absl::Status DaemonProcess::WaitReady(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  std::unique_ptr<v1::MemoryManager::Stub> stub;
  std::string last_error = "its socket never accepted a connection";
  while (absl::Now() < deadline) {
    if (!process_->Running()) {
      return absl::UnavailableError("deltad exited before it was ready");
    }
    // The side socket comes up last (server.cc): both accepting means the
    // whole server is up. A side connection is harmless: it registers a
    // peer that is forgotten when the connection closes.
    if (common::ConnectUnix(socket_path_).ok() &&
        common::ConnectUnix(side_socket_path()).ok()) {
      if (stub == nullptr) stub = NewStub();
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() +
                           std::chrono::seconds(10));
      v1::NodeStatusResponse status;
      const grpc::Status s =
          stub->NodeStatus(&context, v1::NodeStatusRequest(), &status);
      if (s.ok()) return absl::OkStatus();
      last_error = absl::StrCat("NodeStatus failed: ", s.error_message());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("deltad was not ready within ",
                   absl::FormatDuration(timeout), ": ", last_error));
}

DaemonProcess::~DaemonProcess() {
  if (process_ != nullptr) process_->Kill();
  // DELTAD_KEEP_TEST_DIRS=1 keeps the log and config for a post-mortem.
  const char* keep = std::getenv("DELTAD_KEEP_TEST_DIRS");
  if (!dir_.empty() && (keep == nullptr || std::string(keep) != "1")) {
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }
}

std::string DaemonProcess::side_socket_path() const {
  return side::SideSocketPath(socket_path_);
}

std::shared_ptr<grpc::Channel> DaemonProcess::NewChannel(
    int max_send_bytes) const {
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(max_send_bytes);
  // Channels with equal arguments share connections through gRPC's global
  // subchannel pool; a local pool gives each channel its own, so tests of
  // one connection's fate do not disturb another's.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel(target(), grpc::InsecureChannelCredentials(),
                                   args);
}

std::unique_ptr<v1::MemoryManager::Stub> DaemonProcess::NewStub() const {
  return v1::MemoryManager::NewStub(NewChannel());
}

std::string DaemonProcess::Output() const { return ReadFileOrEmpty(log_path_); }

ExitStatus DaemonProcess::Stop(absl::Duration timeout) {
  process_->Signal(SIGTERM);
  return process_->WaitOrKill(timeout);
}

ExitStatus DaemonProcess::Wait(absl::Duration timeout) {
  return process_->WaitOrKill(timeout);
}

// --- Peer -------------------------------------------------------------------

absl::StatusOr<Peer> Peer::Connect(const std::string& side_socket_path,
                                   absl::Duration timeout) {
  auto fd = common::ConnectUnix(side_socket_path);
  if (!fd.ok()) return fd.status();
  Peer peer(std::move(*fd), "");
  auto hello = peer.Receive(timeout, 0);
  if (!hello.ok()) {
    return absl::Status(
        hello.status().code(),
        absl::StrCat("waiting for the peer token: ", hello.status().message()));
  }
  if (hello->tag != side::kPeerToken || hello->payload.empty()) {
    return absl::InternalError(
        absl::StrCat("expected a peer token first, got tag ", hello->tag, " '",
                     hello->payload, "'"));
  }
  peer.token_ = std::move(hello->payload);
  return peer;
}

absl::Status Peer::Send(uint64_t tag, absl::string_view payload,
                        absl::Span<const int> fds) {
  if (!fd_.valid()) return absl::FailedPreconditionError("peer is closed");
  return common::SendFds(fd_.get(), tag, fds, payload);
}

absl::StatusOr<common::ReceivedFds> Peer::Receive(absl::Duration timeout,
                                                  int max_fds) {
  if (!fd_.valid()) return absl::FailedPreconditionError("peer is closed");
  if (absl::Status s = WaitReadable(fd_.get(), timeout); !s.ok()) return s;
  return common::RecvFds(fd_.get(), max_fds);
}

bool Peer::WaitClosedByDaemon(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    auto message = Receive(deadline - absl::Now(), common::kMaxFdsPerMessage);
    if (message.ok()) {
      for (int fd : message->fds) ::close(fd);
      continue;
    }
    // A reset connection is as closed as one that saw EOF.
    return !absl::IsDeadlineExceeded(message.status());
  }
  return false;
}

absl::StatusOr<std::vector<Peer::Grant>> Peer::FetchSlabs(
    const std::string& session_token, absl::Duration timeout) {
  if (absl::Status s = Send(side::kSlabsWanted, session_token); !s.ok()) {
    return s;
  }
  return ReceiveGrants(side::kSlab, side::kSlabsDone, timeout);
}

absl::StatusOr<std::vector<Peer::Grant>> Peer::FetchChunks(
    const std::string& session_token, int64_t target_bytes,
    absl::Duration timeout) {
  if (absl::Status s =
          Send(side::kChunksWanted,
               side::EncodeChunksWanted({session_token, target_bytes}));
      !s.ok()) {
    return s;
  }
  return ReceiveGrants(side::kChunk, side::kChunksDone, timeout);
}

absl::Status Peer::ReturnChunks(const std::string& session_token,
                                const std::vector<uint64_t>& chunk_ids,
                                absl::Duration timeout) {
  if (absl::Status s =
          Send(side::kChunksReturned,
               side::EncodeChunksReturned({session_token, chunk_ids}));
      !s.ok()) {
    return s;
  }
  auto answer = Receive(timeout, 0);
  if (!answer.ok()) return answer.status();
  if (answer->tag == side::kChunksDone) return absl::OkStatus();
  if (answer->tag == side::kError) return absl::UnknownError(answer->payload);
  return absl::InternalError(
      absl::StrCat("unexpected side-socket tag ", answer->tag));
}

absl::StatusOr<std::vector<Peer::Grant>> Peer::ReceiveGrants(
    side::Tag item, side::Tag done, absl::Duration timeout) {
  if (!fd_.valid()) return absl::FailedPreconditionError("peer is closed");
  const timeval tv = absl::ToTimeval(timeout);
  ::setsockopt(fd_.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return side::ReceiveGrants(fd_.get(), item, done);
}

// --- PeerProcess ------------------------------------------------------------

absl::StatusOr<std::unique_ptr<PeerProcess>> PeerProcess::Start(
    const std::string& side_socket_path, absl::Duration timeout) {
  std::unique_ptr<PeerProcess> p(new PeerProcess());
  SpawnOptions spawn;
  spawn.pipe_stdin = true;
  spawn.pipe_stdout = true;
  auto process =
      ChildProcess::Spawn({DELTAD_SIDE_PEER_BINARY, side_socket_path}, spawn);
  if (!process.ok()) return process.status();
  p->process_ = std::move(*process);
  auto line = p->process_->ReadLine(timeout);
  if (!line.ok()) return line.status();
  constexpr absl::string_view kPrefix = "token ";
  if (!absl::StartsWith(*line, kPrefix)) {
    return absl::InternalError(
        absl::StrCat("side peer helper failed: ", *line));
  }
  p->token_ = line->substr(kPrefix.size());
  return p;
}

ExitStatus PeerProcess::Exit(absl::Duration timeout) {
  process_->CloseStdin();
  return process_->WaitOrKill(timeout);
}

}  // namespace deltad::testing_util
