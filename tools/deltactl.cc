// deltactl: the operator's view of a node's deltad. Reads the daemon's
// status, its sessions, the largest tensors of a session and its health over
// gRPC; changes nothing.
//
// Exit codes: 0 done (health: SERVING), 1 the daemon could not be reached or
// refused (health: anything but SERVING), 2 bad command line.
#include <sys/socket.h>
#include <sys/time.h>

#include <cerrno>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "common/side_protocol.h"
#include "common/unix_socket.h"
#include "deltad/v1/memory_manager.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "tools/call_retry.h"
#include "tools/table.h"

ABSL_FLAG(std::string, socket, "/run/deltad/deltad.sock",
          "deltad's gRPC Unix socket");
ABSL_FLAG(std::string, tcp, "",
          "reach deltad over TCP at host:port instead of the Unix socket");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(10),
          "how long to wait for the daemon's answer");

namespace {

namespace v1 = deltad::v1;
namespace health = grpc::health::v1;
using deltad::tools::FormatBytes;
using deltad::tools::FormatDuration;
using deltad::tools::FormatGBps;
using deltad::tools::Printable;
using deltad::tools::Table;

constexpr int kOk = 0;
constexpr int kFailed = 1;
constexpr int kBadUsage = 2;
// The most ListTensors returns (see ListTensorsRequest.limit).
constexpr uint32_t kMaxTop = 1000;

constexpr char kUsage[] =
    "deltactl: the operator's view of deltad.\n"
    "\n"
    "  deltactl [--socket=/run/deltad/deltad.sock] [--tcp=host:port] "
    "<command>\n"
    "\n"
    "Commands:\n"
    "  status              version, backend, host pool and every GPU\n"
    "  sessions            every session: GPU, process, budget and use\n"
    "  top <session> [N]   the session's N largest tensors (default 20, at\n"
    "                      most 1000); only for the session's own user,\n"
    "                      root or deltad's user, over --socket\n"
    "  health              the gRPC health check: SERVING (exit 0) or not\n"
    "                      (exit 1)\n"
    "\n"
    "Exit codes: 0 done, 1 deltad unreachable or refused, 2 bad usage.";

int BadUsage(const std::string& why) {
  std::fprintf(stderr, "deltactl: %s\n\n%s\n", why.c_str(), kUsage);
  return kBadUsage;
}

// What the tool talks to, and how it names it in errors.
struct Daemon {
  std::string address;
  std::shared_ptr<grpc::Channel> channel;
  std::string socket_path;  // empty over TCP
};

// The daemon knows who calls only through its side socket (SO_PEERCRED):
// the token it hands out there names this process, and lives as long as
// the returned connection does.
absl::StatusOr<std::string> PeerToken(const std::string& socket_path,
                                      deltad::common::UniqueFd& connection) {
  const std::string side = deltad::common::side::SideSocketPath(socket_path);
  auto fd = deltad::common::ConnectUnix(side);
  if (!fd.ok()) return fd.status();
  const absl::Duration timeout = absl::GetFlag(FLAGS_timeout);
  const timeval tv = absl::ToTimeval(timeout);
  if (::setsockopt(fd->get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) != 0) {
    return absl::ErrnoToStatus(errno, "setting the side socket's timeout");
  }
  auto hello = deltad::common::RecvFds(fd->get(), 0);
  if (!hello.ok()) return hello.status();
  if (hello->tag != deltad::common::side::kPeerToken ||
      hello->payload.empty()) {
    return absl::InternalError(absl::StrCat("expected a peer token from ", side,
                                            ", got tag ", hello->tag));
  }
  connection = std::move(*fd);
  return std::move(hello->payload);
}

// One deadline for the whole command, its calls and their retries.
absl::Time CommandDeadline() {
  static const absl::Time deadline = absl::Now() + absl::GetFlag(FLAGS_timeout);
  return deadline;
}

// Makes one of deltactl's calls (each only reads) with a new context per
// attempt, repeated where the connection went away under it
// (tools/call_retry.h).
template <typename Request, typename Response, typename Stub>
grpc::Status Call(Stub& stub,
                  grpc::Status (Stub::*method)(grpc::ClientContext*,
                                               const Request&, Response*),
                  const Request& request, Response* response) {
  return deltad::tools::CallWithRetries(
      CommandDeadline(), [&](absl::Time deadline) {
        grpc::ClientContext context;
        context.set_deadline(absl::ToChronoTime(deadline));
        return (stub.*method)(&context, request, response);
      });
}

// gRPC and absl number their codes alike; absl has the names.
std::string CodeName(const grpc::Status& status) {
  return absl::StatusCodeToString(
      static_cast<absl::StatusCode>(status.error_code()));
}

int RpcFailed(const Daemon& daemon, const grpc::Status& status) {
  const grpc::StatusCode code = status.error_code();
  // These two mean no answer came; anything else is the daemon's own.
  if (code == grpc::StatusCode::UNAVAILABLE ||
      code == grpc::StatusCode::DEADLINE_EXCEEDED) {
    std::fprintf(stderr, "deltactl: cannot reach deltad at %s: %s: %s\n",
                 daemon.address.c_str(), CodeName(status).c_str(),
                 status.error_message().c_str());
  } else {
    std::fprintf(stderr, "deltactl: deltad at %s refused: %s: %s\n",
                 daemon.address.c_str(), CodeName(status).c_str(),
                 status.error_message().c_str());
  }
  return kFailed;
}

grpc::Status GetStatus(const Daemon& daemon, v1::NodeStatusResponse* response) {
  auto stub = v1::MemoryManager::NewStub(daemon.channel);
  return Call(*stub, &v1::MemoryManager::Stub::NodeStatus,
              v1::NodeStatusRequest(), response);
}

int Status(const Daemon& daemon) {
  v1::NodeStatusResponse r;
  if (grpc::Status s = GetStatus(daemon, &r); !s.ok()) {
    return RpcFailed(daemon, s);
  }
  std::printf("deltad %s, %s backend, at %s\n", Printable(r.version()).c_str(),
              Printable(r.backend()).c_str(), daemon.address.c_str());
  std::printf("host pool: %s, %s granted\n",
              FormatBytes(r.host_pool_bytes()).c_str(),
              FormatBytes(r.host_pool_granted_bytes()).c_str());
  std::printf("sessions: %d\n\n",
              r.sessions_size() + static_cast<int>(r.sessions_omitted()));
  using A = Table::Align;
  Table t({{"GPU", A::kRight},
           {"NAME", A::kLeft},
           {"MEMORY", A::kRight},
           {"BUDGET", A::kRight},
           {"USED", A::kRight},
           {"CHUNKS", A::kRight},
           {"UNLISTED", A::kRight},
           {"UNRESPONSIVE", A::kRight},
           {"SESSIONS", A::kRight},
           {"D2H GB/s", A::kRight},
           {"H2D GB/s", A::kRight}});
  for (const v1::GpuStatus& g : r.gpus()) {
    t.AddRow({absl::StrCat(g.gpu()), Printable(g.name()),
              FormatBytes(g.memory_bytes()), FormatBytes(g.budget_bytes()),
              FormatBytes(g.used_bytes()), FormatBytes(g.chunk_bytes()),
              FormatBytes(g.unlisted_bytes()),
              FormatBytes(g.unresponsive_bytes()), absl::StrCat(g.sessions()),
              FormatGBps(g.d2h_bytes_per_second()),
              FormatGBps(g.h2d_bytes_per_second())});
  }
  std::fputs(t.Render().c_str(), stdout);
  return kOk;
}

int Sessions(const Daemon& daemon) {
  v1::NodeStatusResponse r;
  if (grpc::Status s = GetStatus(daemon, &r); !s.ok()) {
    return RpcFailed(daemon, s);
  }
  if (r.sessions().empty()) {
    std::printf("no sessions\n");
    return kOk;
  }
  using A = Table::Align;
  Table t({{"ID", A::kRight},
           {"GPU", A::kRight},
           {"PID", A::kRight},
           {"UID", A::kRight},
           {"LABEL", A::kLeft},
           {"BUDGET", A::kRight},
           {"FLOOR", A::kRight},
           {"DEVICE", A::kRight},
           {"CHUNKS", A::kRight},
           {"HOST", A::kRight},
           {"TENSORS", A::kRight},
           {"RELEASES", A::kRight},
           {"STATE", A::kLeft}});
  for (const v1::SessionStatus& s : r.sessions()) {
    // A process silent past its lease holds its chunks unseen: said here,
    // with how long, so that an operator can find it.
    const std::string state =
        s.unresponsive_ms() > 0
            ? absl::StrFormat("unresponsive %.1fs",
                              static_cast<double>(s.unresponsive_ms()) / 1e3)
            : "ok";
    t.AddRow({absl::StrCat(s.session_id()), absl::StrCat(s.gpu()),
              absl::StrCat(s.pid()), absl::StrCat(s.uid()),
              s.label().empty() ? "-" : Printable(s.label()),
              FormatBytes(s.budget_bytes()), FormatBytes(s.floor_bytes()),
              FormatBytes(s.device_bytes()), FormatBytes(s.chunk_bytes()),
              FormatBytes(s.host_bytes()), absl::StrCat(s.tensors()),
              absl::StrCat(s.releases()), state});
  }
  std::fputs(t.Render().c_str(), stdout);
  if (r.sessions_omitted() > 0) {
    std::printf(
        "(%u more sessions not listed: deltad bounds the reply, see "
        "limits.max_status_sessions)\n",
        r.sessions_omitted());
  }
  return kOk;
}

int Top(const Daemon& daemon, const std::vector<std::string>& args) {
  if (args.empty() || args.size() > 2) {
    return BadUsage("top takes a session id and, optionally, N");
  }
  v1::ListTensorsRequest request;
  uint64_t session = 0;
  if (!absl::SimpleAtoi(args[0], &session)) {
    return BadUsage(
        absl::StrCat("top: \"", args[0], "\" is not a session id (a number)"));
  }
  request.set_session_id(session);
  if (daemon.socket_path.empty()) {
    std::fprintf(stderr,
                 "deltactl: top needs deltad's Unix socket (--socket), not "
                 "--tcp: the daemon shows a session's tensors only to its "
                 "own user, and learns who asks over that socket\n");
    return kBadUsage;
  }
  deltad::common::UniqueFd side;
  auto token = PeerToken(daemon.socket_path, side);
  if (!token.ok()) {
    std::fprintf(stderr, "deltactl: cannot reach deltad's side socket: %s\n",
                 std::string(token.status().message()).c_str());
    return kFailed;
  }
  request.set_peer_token(*token);
  if (args.size() == 2) {
    uint32_t n = 0;
    if (!absl::SimpleAtoi(args[1], &n) || n < 1 || n > kMaxTop) {
      return BadUsage(absl::StrCat("top: N must be from 1 to ", kMaxTop,
                                   ", got \"", args[1], "\""));
    }
    request.set_limit(n);
  }
  auto stub = v1::MemoryManager::NewStub(daemon.channel);
  v1::ListTensorsResponse r;
  const grpc::Status s =
      Call(*stub, &v1::MemoryManager::Stub::ListTensors, request, &r);
  if (!s.ok()) return RpcFailed(daemon, s);
  // Who the session is, for the heading; the list stands without it.
  std::string who = absl::StrCat("session ", session);
  v1::NodeStatusResponse status;
  if (GetStatus(daemon, &status).ok()) {
    for (const v1::SessionStatus& info : status.sessions()) {
      if (info.session_id() != session) continue;
      absl::StrAppend(&who, " (GPU ", info.gpu(), ", pid ", info.pid(),
                      info.label().empty() ? "" : ", ", Printable(info.label()),
                      "): ", info.tensors(), " tensors");
    }
  }
  if (r.tensors().empty()) {
    std::printf("%s, none to list\n", who.c_str());
    return kOk;
  }
  std::printf("%s, the %d largest:\n", who.c_str(), r.tensors_size());
  using A = Table::Align;
  Table t({{"TENSOR", A::kRight},
           {"SIZE", A::kRight},
           {"STATE", A::kLeft},
           {"RECOMPUTES", A::kRight},
           {"IDLE", A::kRight}});
  for (const v1::TensorStatus& tensor : r.tensors()) {
    t.AddRow({absl::StrCat(tensor.tensor_id()), FormatBytes(tensor.bytes()),
              Printable(tensor.state()), absl::StrCat(tensor.recomputes()),
              FormatDuration(tensor.idle_ns())});
  }
  std::fputs(t.Render().c_str(), stdout);
  return kOk;
}

int Health(const Daemon& daemon) {
  auto stub = health::Health::NewStub(daemon.channel);
  health::HealthCheckRequest request;  // "": the server as a whole
  health::HealthCheckResponse r;
  const grpc::Status s = Call(*stub, &health::Health::Stub::Check, request, &r);
  if (!s.ok()) return RpcFailed(daemon, s);
  std::printf(
      "%s\n",
      health::HealthCheckResponse::ServingStatus_Name(r.status()).c_str());
  return r.status() == health::HealthCheckResponse::SERVING ? kOk : kFailed;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  const std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  if (positional.size() < 2) return BadUsage("no command given");
  const std::string command = positional[1];
  const std::vector<std::string> args(positional.begin() + 2, positional.end());
  if (command == "help") {
    std::printf("%s\n", kUsage);
    return kOk;
  }
  const bool known = command == "status" || command == "sessions" ||
                     command == "top" || command == "health";
  if (!known)
    return BadUsage(absl::StrCat("unknown command \"", command, "\""));
  if (command != "top" && !args.empty()) {
    return BadUsage(absl::StrCat(command, " takes no arguments"));
  }
  if (absl::GetFlag(FLAGS_timeout) <= absl::ZeroDuration()) {
    return BadUsage("--timeout must be positive");
  }
  (void)CommandDeadline();  // the command's time starts here

  Daemon daemon;
  daemon.address = absl::GetFlag(FLAGS_tcp).empty()
                       ? "unix:" + absl::GetFlag(FLAGS_socket)
                       : absl::GetFlag(FLAGS_tcp);
  if (absl::GetFlag(FLAGS_tcp).empty()) {
    daemon.socket_path = absl::GetFlag(FLAGS_socket);
  }
  daemon.channel =
      grpc::CreateChannel(daemon.address, grpc::InsecureChannelCredentials());
  if (command == "status") return Status(daemon);
  if (command == "sessions") return Sessions(daemon);
  if (command == "top") return Top(daemon, args);
  return Health(daemon);
}
