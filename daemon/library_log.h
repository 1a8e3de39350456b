#ifndef DELTAD_DAEMON_LIBRARY_LOG_H_
#define DELTAD_DAEMON_LIBRARY_LOG_H_

#include <cstdint>
#include <cstdio>
#include <functional>

#include "absl/strings/string_view.h"
#include "common/log_limit.h"

namespace deltad::daemon {

// What gRPC and protobuf log go through a limit: a local client can make
// them log at will (a connection that speaks no HTTP/2, pings past the
// policy, a message that does not parse), and the journal must not fill
// with it. Lines beyond `kBurst` per window are held back and counted; the
// next line let through says how many were.
class LibraryLog {
 public:
  static constexpr int kBurst = 20;
  static constexpr std::chrono::seconds kWindow{10};

  explicit LibraryLog(std::FILE* out) : out_(out), limit_(kBurst, kWindow) {}

  // One line from `library` ("grpc", "protobuf"), if the limit allows.
  void Write(absl::string_view library, absl::string_view severity,
             absl::string_view file, int line, absl::string_view message);

 private:
  std::FILE* out_;
  common::LogLimit limit_;
};

// Routes gRPC's (gpr_set_log_function) and protobuf's (SetLogHandler) log
// lines through one LibraryLog on stderr, for the daemon's lifetime. Call
// once, before the server starts. Only lines of the severity GRPC_VERBOSITY
// asks for (default: errors) are written, though gRPC is told to log them
// all: see GoawayLimit.
void RouteLibraryLogs();

// The limit a gRPC log line says the server sent a GOAWAY for, or nullptr:
// "max_ping_strikes" for ENHANCE_YOUR_CALM "too_many_pings" (past
// limits.max_ping_strikes), "grpc_memory_bytes" for ENHANCE_YOUR_CALM
// "Buffers full" (the memory quota, limits.grpc_memory_bytes, ran short
// and gRPC closes idle connections to free some). gRPC C++ has no server
// hook, interceptor or channelz field that sees these GOAWAYs, but chttp2
// logs every GOAWAY it sends, at debug severity.
const char* GoawayLimit(absl::string_view grpc_log_line);

// The gRPC log lines routed through the daemon since RouteLibraryLogs ran,
// written or not: what telling gRPC to log at debug severity costs is a
// formatted line each (rpc_bench reports how many a run saw).
int64_t GrpcLogLinesRouted();

// Calls `observer` (thread safe, cheap) with GoawayLimit's name for each
// GOAWAY gRPC logs from now on that names a limit; an empty one stops that.
// RouteLibraryLogs must have run.
void ObserveGoaways(std::function<void(const char* limit)> observer);

}  // namespace deltad::daemon

#endif  // DELTAD_DAEMON_LIBRARY_LOG_H_
