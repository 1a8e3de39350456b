#ifndef DELTAD_COMMON_SIDE_PROTOCOL_H_
#define DELTAD_COMMON_SIDE_PROTOCOL_H_

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/unix_socket.h"

// The side socket: the Unix socket beside the gRPC socket (its path plus
// ".fds") over which a process proves who it is and receives file
// descriptors, neither of which gRPC can do. Each message is one SendFds /
// RecvFds message (common/unix_socket.h): a tag, a small payload, and
// descriptors.
//
//   daemon  -> process  kPeerToken   payload: the peer token, sent once,
//                                    right after the connection is accepted
//   process -> daemon   kSlabsWanted payload: a session token
//   daemon  -> process  kSlab        payload: Record; one descriptor
//                                    (repeated, one message per slab)
//   daemon  -> process  kSlabsDone   payload: empty; the list is complete
//   daemon  -> process  kError       payload: what was wrong (text)
//   process -> daemon   kChunksWanted payload: ChunksWanted (the session
//                                    and how many device bytes it wants to
//                                    hold in chunks, capped by its budget)
//   daemon  -> process  kChunk       payload: Record;    one descriptor
//                                    (repeated, one message per new chunk)
//   daemon  -> process  kChunksDone  payload: empty; the grant is complete,
//                                    or the return below was accepted
//   process -> daemon   kChunksReturned payload: ChunksReturned (chunks the
//                                    process has unmapped); answered with
//                                    kChunksDone or kError
//
// A process sends one request at a time and reads its whole answer.
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
  kChunksWanted = 6,
  kChunk = 7,
  kChunksDone = 8,
  kChunksReturned = 9,
};

// The largest payload either side sends; tokens and slab records are far
// below it.
inline constexpr size_t kMaxMessageBytes = 4096;

// One host slab (kSlab) or device chunk (kChunk); its descriptor rides
// along.
struct Record {
  uint64_t id = 0;
  int64_t bytes = 0;
};

inline std::string EncodeRecord(const Record& r) {
  std::string out(sizeof(r.id) + sizeof(r.bytes), '\0');
  std::memcpy(out.data(), &r.id, sizeof(r.id));
  std::memcpy(out.data() + sizeof(r.id), &r.bytes, sizeof(r.bytes));
  return out;
}

// Empty when the payload is not a record.
inline std::optional<Record> DecodeRecord(absl::string_view payload) {
  Record r;
  if (payload.size() != sizeof(r.id) + sizeof(r.bytes)) return std::nullopt;
  std::memcpy(&r.id, payload.data(), sizeof(r.id));
  std::memcpy(&r.bytes, payload.data() + sizeof(r.id), sizeof(r.bytes));
  if (r.bytes <= 0) return std::nullopt;
  return r;
}

struct ChunksWanted {
  std::string session_token;
  int64_t target_bytes = 0;
};

inline std::string EncodeChunksWanted(const ChunksWanted& w) {
  std::string out(sizeof(w.target_bytes), '\0');
  std::memcpy(out.data(), &w.target_bytes, sizeof(w.target_bytes));
  out += w.session_token;
  return out;
}

inline std::optional<ChunksWanted> DecodeChunksWanted(
    absl::string_view payload) {
  ChunksWanted w;
  if (payload.size() <= sizeof(w.target_bytes)) return std::nullopt;
  std::memcpy(&w.target_bytes, payload.data(), sizeof(w.target_bytes));
  if (w.target_bytes < 0) return std::nullopt;
  w.session_token = std::string(payload.substr(sizeof(w.target_bytes)));
  return w;
}

struct ChunksReturned {
  std::string session_token;
  std::vector<uint64_t> chunk_ids;
};

// How many ids fit one message beside a token of `token_bytes`.
inline size_t MaxReturnedPerMessage(size_t token_bytes) {
  const size_t room = kMaxMessageBytes - sizeof(uint32_t) - token_bytes;
  return token_bytes + sizeof(uint32_t) >= kMaxMessageBytes
             ? 0
             : room / sizeof(uint64_t);
}

inline std::string EncodeChunksReturned(const ChunksReturned& r) {
  const uint32_t token_bytes = static_cast<uint32_t>(r.session_token.size());
  std::string out(sizeof(token_bytes), '\0');
  std::memcpy(out.data(), &token_bytes, sizeof(token_bytes));
  out += r.session_token;
  const size_t at = out.size();
  out.resize(at + r.chunk_ids.size() * sizeof(uint64_t));
  if (!r.chunk_ids.empty()) {
    std::memcpy(out.data() + at, r.chunk_ids.data(),
                r.chunk_ids.size() * sizeof(uint64_t));
  }
  return out;
}

inline std::optional<ChunksReturned> DecodeChunksReturned(
    absl::string_view payload) {
  uint32_t token_bytes = 0;
  if (payload.size() < sizeof(token_bytes)) return std::nullopt;
  std::memcpy(&token_bytes, payload.data(), sizeof(token_bytes));
  payload.remove_prefix(sizeof(token_bytes));
  if (token_bytes == 0 || token_bytes > payload.size()) return std::nullopt;
  ChunksReturned r;
  r.session_token = std::string(payload.substr(0, token_bytes));
  payload.remove_prefix(token_bytes);
  if (payload.size() % sizeof(uint64_t) != 0) return std::nullopt;
  r.chunk_ids.resize(payload.size() / sizeof(uint64_t));
  if (!r.chunk_ids.empty()) {
    std::memcpy(r.chunk_ids.data(), payload.data(), payload.size());
  }
  return r;
}

// A host slab or a device chunk with a descriptor of its own: as the
// daemon sends it (a duplicate, so that a concurrent release cannot turn it
// into another file's number) and as the process receives it.
struct Grant {
  uint64_t id = 0;
  int64_t bytes = 0;
  UniqueFd fd;
};

// The answer to kSlabsWanted or kChunksWanted: `item` messages (a record
// and one descriptor each) until `done`. A kError answer is
// FAILED_PRECONDITION with the daemon's text; anything else INTERNAL; a
// failed read (the socket's receive timeout, a closed connection) is
// UNAVAILABLE.
absl::StatusOr<std::vector<Grant>> ReceiveGrants(int socket, Tag item,
                                                 Tag done);

inline std::string SideSocketPath(absl::string_view grpc_socket_path) {
  return std::string(grpc_socket_path) + kSocketSuffix;
}

}  // namespace deltad::common::side

#endif  // DELTAD_COMMON_SIDE_PROTOCOL_H_
