// The side socket from both ends (common/side_protocol.h).
//
// First byte even: the rest is the byte stream a process sends to the
// daemon. It is read back with RecvFds as the daemon reads it, each message
// is decoded, checked to encode back to the same bytes, and answered the
// way daemon/side_channel.cc answers it, against a real Node that has one
// process with a session on each GPU. A session token "S0" or "S1" in a
// message stands for that session's real token, so that the authorised
// paths are reachable.
//
// First byte odd: the rest is [tag, flags, length, payload] records that
// the daemon might send, each with a descriptor when flags bit 0 is set,
// read by ReceiveGrants as the client library reads an answer.
#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/side_protocol.h"
#include "common/unix_socket.h"
#include "daemon/backend/sim_backend.h"
#include "daemon/host_pool.h"
#include "daemon/node.h"
#include "fuzz/fuzz_target.h"

namespace deltad::fuzz {
namespace {

namespace side = common::side;

constexpr int64_t kKiB = 1024;
constexpr int64_t kChunk = 64 * kKiB;
constexpr int64_t kSlab = 64 * kKiB;
constexpr size_t kMaxMessages = 64;

// Both ends of a connection whose sending side is closed once the input is
// written, so that reading past it ends instead of blocking.
struct Pair {
  common::UniqueFd writer;
  common::UniqueFd reader;
};

std::optional<Pair> Connected() {
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) {
    return std::nullopt;
  }
  Pair p;
  p.writer.reset(fds[0]);
  p.reader.reset(fds[1]);
  return p;
}

void WriteAll(int fd, const uint8_t* data, size_t size) {
  while (size > 0) {
    const ssize_t n = ::send(fd, data, size, MSG_NOSIGNAL);
    if (n <= 0) return;
    data += n;
    size -= static_cast<size_t>(n);
  }
}

// A descriptor to attach to the daemon's messages; any open file will do.
int AnyFd() {
  static const int fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  return fd;
}

void CheckDecoders(const std::string& payload) {
  if (auto r = side::DecodeRecord(payload)) {
    DELTAD_FUZZ_CHECK(r->bytes > 0);
    DELTAD_FUZZ_CHECK(side::EncodeRecord(*r) == payload);
  }
  if (auto w = side::DecodeChunksWanted(payload)) {
    DELTAD_FUZZ_CHECK(w->target_bytes >= 0 && !w->session_token.empty());
    DELTAD_FUZZ_CHECK(side::EncodeChunksWanted(*w) == payload);
  }
  if (auto r = side::DecodeChunksReturned(payload)) {
    DELTAD_FUZZ_CHECK(!r->session_token.empty());
    DELTAD_FUZZ_CHECK(side::EncodeChunksReturned(*r) == payload);
  }
  // The sender splits returns by this count: a message so built must fit.
  const size_t most = side::MaxReturnedPerMessage(payload.size());
  if (most > 0) {
    side::ChunksReturned full;
    full.session_token = payload;
    full.chunk_ids.assign(most, 1);
    DELTAD_FUZZ_CHECK(side::EncodeChunksReturned(full).size() <=
                      side::kMaxMessageBytes);
  }
}

class Daemon {
 public:
  bool Init() {
    daemon::SimBackendOptions sim;
    sim.gpus = 2;
    sim.memory_bytes = 32 * kChunk;
    sim.chunk_bytes = kChunk;
    auto backend = daemon::SimBackend::Create(sim);
    DELTAD_FUZZ_CHECK(backend.ok());
    backend_ = std::move(*backend);
    auto pool = daemon::HostPool::Create(4 * kSlab, kSlab);
    if (!pool.ok()) return false;  // out of descriptors
    pool_ = std::move(*pool);
    daemon::NodeOptions options;
    options.min_session_bytes = 4 * kChunk;
    options.default_host_quota_bytes = 2 * kSlab;
    auto node = daemon::Node::Create(*backend_, *pool_, nullptr, options);
    DELTAD_FUZZ_CHECK(node.ok());
    node_ = std::move(*node);
    auto peer = node_->registry().RegisterPeer({1234, 1000, 1000});
    DELTAD_FUZZ_CHECK(peer.ok());
    peer_ = std::move(*peer);
    for (int gpu = 0; gpu < 2; ++gpu) {
      v1::OpenSessionRequest r;
      r.set_gpu(gpu);
      auto opened = node_->OpenSession(peer_, r);
      DELTAD_FUZZ_CHECK(opened.ok());
      tokens_[gpu] = opened->response.session_token();
    }
    return true;
  }

  // As SideChannel::Answer; false where it would close the connection.
  bool Answer(const common::ReceivedFds& message) {
    switch (message.tag) {
      case side::kSlabsWanted: {
        auto slabs = node_->HostSlabs(Real(message.payload), peer_);
        if (!slabs.ok()) return true;
        for (const side::Grant& slab : *slabs) {
          DELTAD_FUZZ_CHECK(slab.fd.valid() && slab.bytes == kSlab);
        }
        return true;
      }
      case side::kChunksWanted: {
        auto wanted = side::DecodeChunksWanted(message.payload);
        if (!wanted) return true;
        auto chunks = node_->GrantChunks(Real(wanted->session_token), peer_,
                                         wanted->target_bytes);
        if (!chunks.ok()) return true;
        for (const side::Grant& chunk : chunks->chunks) {
          DELTAD_FUZZ_CHECK(chunk.fd.valid() && chunk.bytes == kChunk);
        }
        return true;
      }
      case side::kChunksReturned: {
        auto returned = side::DecodeChunksReturned(message.payload);
        if (!returned) return true;
        (void)node_->ReturnChunks(Real(returned->session_token), peer_,
                                  returned->chunk_ids);
        return true;
      }
      default:
        return false;
    }
  }

  // The process goes away: everything it held comes back.
  void Finish() {
    (void)node_->PeerGone(peer_);
    const v1::NodeStatusResponse s = node_->Status();
    DELTAD_FUZZ_CHECK(s.sessions_size() == 0);
    DELTAD_FUZZ_CHECK(s.host_pool_granted_bytes() == 0);
    for (const v1::GpuStatus& g : s.gpus()) {
      DELTAD_FUZZ_CHECK(g.chunk_bytes() == 0);
    }
  }

  void CheckChunks() const {
    const v1::NodeStatusResponse s = node_->Status();
    for (const v1::GpuStatus& g : s.gpus()) {
      int64_t held = 0;
      for (const v1::SessionStatus& session : s.sessions()) {
        if (session.gpu() == g.gpu()) held += session.chunk_bytes();
      }
      DELTAD_FUZZ_CHECK(held == g.chunk_bytes());
      DELTAD_FUZZ_CHECK(g.chunk_bytes() <= g.memory_bytes());
    }
  }

 private:
  std::string Real(const std::string& token) const {
    if (token == "S0") return tokens_[0];
    if (token == "S1") return tokens_[1];
    return token;
  }

  std::unique_ptr<daemon::SimBackend> backend_;
  std::unique_ptr<daemon::HostPool> pool_;
  std::unique_ptr<daemon::Node> node_;
  std::string peer_;
  std::string tokens_[2];
};

void FromProcess(const uint8_t* data, size_t size) {
  auto pair = Connected();
  if (!pair) return;
  WriteAll(pair->writer.get(), data, size);
  ::shutdown(pair->writer.get(), SHUT_WR);
  Daemon d;
  if (!d.Init()) return;
  for (size_t i = 0; i < kMaxMessages; ++i) {
    auto message =
        common::RecvFds(pair->reader.get(), 0, side::kMaxMessageBytes);
    if (!message.ok()) break;
    DELTAD_FUZZ_CHECK(message->fds.empty());
    DELTAD_FUZZ_CHECK(message->payload.size() <= side::kMaxMessageBytes);
    CheckDecoders(message->payload);
    const bool go_on = d.Answer(*message);
    d.CheckChunks();
    if (!go_on) break;
  }
  d.Finish();
}

void FromDaemon(const uint8_t* data, size_t size, bool chunks) {
  auto pair = Connected();
  if (!pair) return;
  const int fd = AnyFd();
  for (size_t i = 0; size >= 3 && i < kMaxMessages; ++i) {
    const uint64_t tag = data[0];
    const bool with_fd = (data[1] & 1) != 0 && fd >= 0;
    const size_t len = std::min<size_t>(data[2], size - 3);
    const std::string payload(reinterpret_cast<const char*>(data + 3), len);
    data += 3 + len;
    size -= 3 + len;
    if (!common::SendFds(
             pair->writer.get(), tag,
             with_fd ? absl::Span<const int>(&fd, 1) : absl::Span<const int>(),
             payload)
             .ok()) {
      break;
    }
  }
  ::shutdown(pair->writer.get(), SHUT_WR);
  auto grants = chunks ? side::ReceiveGrants(pair->reader.get(), side::kChunk,
                                             side::kChunksDone)
                       : side::ReceiveGrants(pair->reader.get(), side::kSlab,
                                             side::kSlabsDone);
  if (!grants.ok()) return;
  for (const side::Grant& g : *grants) {
    DELTAD_FUZZ_CHECK(g.fd.valid() && g.bytes > 0);
  }
}

std::string Message(uint64_t tag, const std::string& payload) {
  std::string out(common::kHeaderBytes, '\0');
  const auto len = static_cast<uint32_t>(payload.size());
  std::memcpy(out.data(), &tag, sizeof(tag));
  std::memcpy(out.data() + sizeof(tag), &len, sizeof(len));
  return out + payload;
}

std::string Record(uint8_t tag, bool with_fd, const std::string& payload) {
  std::string out;
  out += static_cast<char>(tag);
  out += static_cast<char>(with_fd ? 1 : 0);
  out += static_cast<char>(payload.size());
  return out + payload;
}

}  // namespace

std::vector<std::pair<std::string, std::string>> Seeds() {
  std::vector<std::pair<std::string, std::string>> seeds;
  const std::string process(1, '\0');
  seeds.emplace_back("seed_slabs_wanted",
                     process + Message(side::kSlabsWanted, "S0") +
                         Message(side::kSlabsWanted, "S1") +
                         Message(side::kSlabsWanted, "forged"));
  side::ChunksReturned returned{"S0", {1, 2, 3}};
  side::ChunksReturned forged{"forged", {4}};
  seeds.emplace_back(
      "seed_chunks",
      process +
          Message(side::kChunksWanted,
                  side::EncodeChunksWanted({"S0", 6 * kChunk})) +
          Message(side::kChunksWanted,
                  side::EncodeChunksWanted({"S1", 40 * kChunk})) +
          Message(side::kChunksReturned, side::EncodeChunksReturned(returned)) +
          Message(side::kChunksReturned, side::EncodeChunksReturned(forged)) +
          Message(side::kChunksWanted, side::EncodeChunksWanted({"S0", 0})));
  seeds.emplace_back("seed_malformed",
                     process + Message(side::kChunksWanted, "S0") +
                         Message(side::kChunksReturned, "\x02") +
                         Message(side::kChunk, "") + Message(99, "x"));
  const std::string slab = side::EncodeRecord({0, kSlab});
  seeds.emplace_back("seed_receive_slabs",
                     std::string(1, '\1') + Record(side::kSlab, true, slab) +
                         Record(side::kSlab, true, side::EncodeRecord({1, 8})) +
                         Record(side::kSlabsDone, false, ""));
  seeds.emplace_back(
      "seed_receive_chunks",
      std::string(1, '\3') +
          Record(side::kChunk, true, side::EncodeRecord({7, kChunk})) +
          Record(side::kChunksDone, false, ""));
  seeds.emplace_back("seed_receive_error",
                     std::string(1, '\1') + Record(side::kSlab, false, slab) +
                         Record(side::kError, false, "no such session"));
  return seeds;
}

}  // namespace deltad::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t mode = data[0];
  (void)deltad::fuzz::AnyFd();  // opened once, before counting
  const int fds = deltad::fuzz::OpenFds();
  if (mode % 2 == 0) {
    deltad::fuzz::FromProcess(data + 1, size - 1);
  } else {
    deltad::fuzz::FromDaemon(data + 1, size - 1, (mode & 2) != 0);
  }
  DELTAD_FUZZ_CHECK(deltad::fuzz::OpenFds() == fds);
  return 0;
}
