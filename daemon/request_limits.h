#ifndef DELTAD_DAEMON_REQUEST_LIMITS_H_
#define DELTAD_DAEMON_REQUEST_LIMITS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "deltad/v1/memory_manager.pb.h"

namespace deltad::daemon {

// The limits on what one client may send or make the daemon hold that came
// with bounding hostile clients, with their defaults. Each is a field of
// `limits` in the configuration (proto/deltad/v1/daemon_config.proto), whose
// defaults config.cc takes from here; docs/RELIABILITY.md ("Limits") lists
// them with the older ones (message size, batch, tensors, sessions per GPU)
// and what passing each one gets.
struct RequestLimits {
  // --- What one message may carry.
  // A request's bytes on the wire (limits.max_message_bytes, whose default
  // config.cc sets). Past it the daemon answers RESOURCE_EXHAUSTED naming
  // the limit and counts it; gRPC refuses on its own, unseen, a message past
  // kMessageBytesBackstop times this, so that no message can make it buffer
  // more (server.cc).
  int64_t max_message_bytes = int64_t{4} << 20;
  // OpenSessionRequest.label: text for operators, which every NodeStatus
  // reply repeats.
  int32_t max_label_bytes = 256;

  // --- What one client may make the daemon hold.
  // Orders waiting for a session's stream: a client that does not read
  // them is ended with RESOURCE_EXHAUSTED past this.
  int64_t max_queued_order_bytes = int64_t{1} << 20;
  // Sessions of one user (uid), on all GPUs together.
  int32_t max_sessions_per_uid = 256;
  // Side-socket connections of one user (one per training process, each
  // holding a thread), so one user cannot take every connection the
  // daemon serves (4096 in all).
  int32_t max_side_connections_per_uid = 256;
  // gRPC connections of one user (a session holds one), so one
  // user cannot take every connection (4096 in all) or, with connections
  // that never read, the memory gRPC holds for each (about a megabyte).
  int32_t max_grpc_connections_per_uid = 256;

  // --- Replies.
  // Sessions listed in one NodeStatus reply; the rest are counted in
  // NodeStatusResponse.sessions_omitted.
  int32_t max_status_sessions = 1024;

  // --- gRPC.
  // Memory gRPC may use for its buffers (grpc::ResourceQuota), and its
  // threads: each open Session stream holds one.
  int64_t grpc_memory_bytes = int64_t{256} << 20;
  int32_t grpc_max_threads = 2048;
  // Concurrent calls on one connection (HTTP/2 streams), also before its
  // client acknowledged the daemon's SETTINGS (daemon/http2_gate.h). A
  // session's connection (one each, client/grpc_daemon_link.cc) carries
  // its Session stream and a few unary calls; each call can hold what its
  // client sends for a message it has not finished (bench/stream_flood.py):
  // 256 connections that kept 32 such calls each held +422 MiB, with 8
  // each +20 MiB. Clients that open another call for each one gRPC resets
  // still reach about +400 MiB (docs/RELIABILITY.md).
  int32_t max_concurrent_streams = 8;
  // How long a new connection has to acknowledge the daemon's SETTINGS
  // before gRPC takes it (an honest client does at once); past it, it is
  // refused.
  int32_t settings_ack_ms = 10000;
  // A client may ping no more often than this (the client library pings
  // every 10 s); past max_ping_strikes pings that come sooner, gRPC sends
  // GOAWAY ENHANCE_YOUR_CALM. 0 strikes (the default): never. With the
  // gRPC here (1.51) a connection past its strikes that does not read goes
  // on being read, and its PINGs cost the daemon about 8 KB each until the
  // client closes it: +80 MiB for 374 KiB of PINGs, against +1 MiB with no
  // strikes, where gRPC stops reading a connection once 10,000 answers wait
  // for it (bench/ping_flood.py).
  int32_t min_ping_interval_ms = 5000;
  int32_t max_ping_strikes = 0;
  // The daemon pings every connection this often, calls or none, and
  // closes it when the answer takes longer than keepalive_timeout_ms: a
  // vanished client does not hold a stream and its thread for ever, nor a
  // flooding one its connection.
  int32_t keepalive_time_ms = 60000;
  int32_t keepalive_timeout_ms = 20000;

  // --- The heap: the glibc malloc arenas the daemon's threads share, 0
  // for glibc's default (8 per core). glibc gives each thread that contends
  // an arena of its own, and what a connection or a session frees in one
  // stays mapped beside what others still use there: after a flood of 32
  // connections of PINGs the daemon kept +12 to +104 MiB that no trim gave
  // back, against +2 to +7 MiB with 2 arenas. But the soak's 200-odd
  // threads then share 2 locks: in one run each (docs/RELIABILITY.md),
  // the daemon used 71% of a core against 57%, stalled for about 25 s and
  // lost 50 sessions, where the default's run lost none. Operators who
  // expect floods can set it; the default stays glibc's.
  int32_t malloc_arenas = 0;
};

// gRPC's own bound on a received message, in multiples of
// max_message_bytes: between the two the daemon refuses, names the limit and
// counts; past it gRPC refuses before the daemon sees the message.
inline constexpr int64_t kMessageBytesBackstop = 4;

// Whether a request of `bytes` on the wire is within max_message_bytes:
// RESOURCE_EXHAUSTED naming the limit if not.
absl::Status CheckMessageBytes(size_t bytes, const RequestLimits& limits);

// Whether a request's fields are within the limits. INVALID_ARGUMENT with a
// message that names the field and the limit ("OpenSessionRequest.label is
// 300 bytes; the limit is 256 (limits.max_label_bytes)"). Checks what the
// Node does not: what the daemon keeps of a request's strings. Sizes, ids,
// GPUs and batch contents are the Node's to check, against its state, and a
// token of any size that is none of the daemon's is UNAUTHENTICATED there
// (tokens are compared length first, so a long one costs nothing).
absl::Status Validate(const v1::OpenSessionRequest& request,
                      const RequestLimits& limits);
// The other requests keep no string of theirs: nothing to check here.
template <typename Request>
absl::Status Validate(const Request& /*request*/,
                      const RequestLimits& /*limits*/) {
  return absl::OkStatus();
}

}  // namespace deltad::daemon

#endif  // DELTAD_DAEMON_REQUEST_LIMITS_H_
