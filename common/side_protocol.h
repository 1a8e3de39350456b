#ifndef DELTAD_COMMON_SIDE_PROTOCOL_H_
#define DELTAD_COMMON_SIDE_PROTOCOL_H_

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>

#include "absl/strings/string_view.h"

// The side socket: the Unix socket beside the gRPC socket (its path plus
// ".fds") over which a process proves who it is and receives file
// descriptors, neither of which gRPC can do. Each message is one SendFds /
// RecvFds message (common/unix_socket.h): a tag, a small payload, and
// descriptors.
//
//   daemon  -> process  kPeerToken   payload: the peer token, sent once,
//                                    right after the connection is accepted
//   process -> daemon   kSlabsWanted payload: a session token
//   daemon  -> process  kSlab        payload: SlabRecord; one descriptor
//                                    (repeated, one message per slab)
//   daemon  -> process  kSlabsDone   payload: empty; the list is complete
//   daemon  -> process  kError       payload: what was wrong (text)
//
// The connection is the process's lifeline: when it closes, the daemon
// reclaims every session the process opened.
namespace deltad::common::side {

inline constexpr char kSocketSuffix[] = ".fds";

enum Tag : uint64_t {
  kPeerToken = 1,
  kSlabsWanted = 2,
  kSlab = 3,
  kSlabsDone = 4,
  kError = 5,
};

// The largest payload either side sends; tokens and slab records are far
// below it.
inline constexpr size_t kMaxMessageBytes = 4096;

// One host slab as kSlab describes it; the descriptor rides along.
struct SlabRecord {
  uint64_t slab_id = 0;
  int64_t bytes = 0;
};

inline std::string EncodeSlab(const SlabRecord& r) {
  std::string out(sizeof(r.slab_id) + sizeof(r.bytes), '\0');
  std::memcpy(out.data(), &r.slab_id, sizeof(r.slab_id));
  std::memcpy(out.data() + sizeof(r.slab_id), &r.bytes, sizeof(r.bytes));
  return out;
}

// Empty when the payload is not a slab record.
inline std::optional<SlabRecord> DecodeSlab(absl::string_view payload) {
  SlabRecord r;
  if (payload.size() != sizeof(r.slab_id) + sizeof(r.bytes)) {
    return std::nullopt;
  }
  std::memcpy(&r.slab_id, payload.data(), sizeof(r.slab_id));
  std::memcpy(&r.bytes, payload.data() + sizeof(r.slab_id), sizeof(r.bytes));
  if (r.bytes <= 0) return std::nullopt;
  return r;
}

inline std::string SideSocketPath(absl::string_view grpc_socket_path) {
  return std::string(grpc_socket_path) + kSocketSuffix;
}

}  // namespace deltad::common::side

#endif  // DELTAD_COMMON_SIDE_PROTOCOL_H_
