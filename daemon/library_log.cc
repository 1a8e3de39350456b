#include "daemon/library_log.h"

#include <grpc/support/log.h>

#include <atomic>
#include <mutex>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/stubs/logging.h"

namespace deltad::daemon {
namespace {

LibraryLog* TheLog() {
  static auto* const log = new LibraryLog(stderr);
  return log;
}

// The least severe gRPC line written: what GRPC_VERBOSITY asked for before
// RouteLibraryLogs lowered gRPC's own threshold.
std::atomic<int> grpc_shown_severity{GPR_LOG_SEVERITY_ERROR};

std::atomic<int64_t> grpc_lines_routed{0};

std::mutex observer_mu;
std::function<void(const char*)>* TheObserver() {
  static auto* const observer = new std::function<void(const char*)>();
  return observer;
}

const char* GprSeverity(gpr_log_severity s) {
  switch (s) {
    case GPR_LOG_SEVERITY_DEBUG:
      return "debug";
    case GPR_LOG_SEVERITY_INFO:
      return "info";
    case GPR_LOG_SEVERITY_ERROR:
      return "error";
  }
  return "?";
}

void FromGrpc(gpr_log_func_args* args) {
  grpc_lines_routed.fetch_add(1, std::memory_order_relaxed);
  const char* message = args->message == nullptr ? "" : args->message;
  if (const char* limit = GoawayLimit(message)) {
    std::lock_guard<std::mutex> lock(observer_mu);
    if (*TheObserver()) (*TheObserver())(limit);
  }
  if (args->severity < grpc_shown_severity.load(std::memory_order_relaxed)) {
    return;
  }
  TheLog()->Write("grpc", GprSeverity(args->severity),
                  args->file == nullptr ? "" : args->file, args->line, message);
}

void FromProtobuf(google::protobuf::LogLevel level, const char* file, int line,
                  const std::string& message) {
  const char* severity = level >= google::protobuf::LOGLEVEL_ERROR ? "error"
                         : level == google::protobuf::LOGLEVEL_WARNING
                             ? "warning"
                             : "info";
  TheLog()->Write("protobuf", severity, file == nullptr ? "" : file, line,
                  message);
}

}  // namespace

void LibraryLog::Write(absl::string_view library, absl::string_view severity,
                       absl::string_view file, int line,
                       absl::string_view message) {
  int64_t held_back = 0;
  if (!limit_.Allow(&held_back)) return;
  std::string text = absl::StrCat("deltad: ", library, " ", severity, ": ",
                                  message, " (", file, ":", line, ")");
  if (held_back > 0) {
    absl::StrAppend(&text, " [", held_back, " library log lines held back]");
  }
  std::fprintf(out_, "%s\n", text.c_str());
  std::fflush(out_);
}

void RouteLibraryLogs() {
  TheLog();
  // Once only: a second call would read back the threshold lowered below.
  static const bool routed = [] {
    gpr_log_verbosity_init();  // reads GRPC_VERBOSITY
    grpc_shown_severity =
        gpr_should_log(GPR_LOG_SEVERITY_DEBUG)  ? GPR_LOG_SEVERITY_DEBUG
        : gpr_should_log(GPR_LOG_SEVERITY_INFO) ? GPR_LOG_SEVERITY_INFO
                                                : GPR_LOG_SEVERITY_ERROR;
    // The GOAWAY line is a debug one; gRPC drops those before they reach
    // FromGrpc unless told otherwise.
    gpr_set_log_verbosity(GPR_LOG_SEVERITY_DEBUG);
    gpr_set_log_function(&FromGrpc);
    return true;
  }();
  (void)routed;
  google::protobuf::SetLogHandler(&FromProtobuf);
}

const char* GoawayLimit(absl::string_view grpc_log_line) {
  // chttp2_transport.cc send_goaway: "<peer>: Sending goaway err=<error>";
  // the error is the server's own, "too_many_pings" from
  // grpc_chttp2_add_ping_strike or "Buffers full" from the transport's
  // benign reclaimer, and the peer of a connection the daemon hands to gRPC
  // is "fd:<n>", so a client cannot forge the match.
  constexpr absl::string_view kSent = ": Sending goaway err=";
  const size_t at = grpc_log_line.find(kSent);
  if (at == absl::string_view::npos) return nullptr;
  const absl::string_view error = grpc_log_line.substr(at + kSent.size());
  if (absl::StrContains(error, "too_many_pings")) return "max_ping_strikes";
  if (absl::StrContains(error, "Buffers full")) return "grpc_memory_bytes";
  return nullptr;
}

int64_t GrpcLogLinesRouted() {
  return grpc_lines_routed.load(std::memory_order_relaxed);
}

void ObserveGoaways(std::function<void(const char* limit)> observer) {
  std::lock_guard<std::mutex> lock(observer_mu);
  *TheObserver() = std::move(observer);
}

}  // namespace deltad::daemon
