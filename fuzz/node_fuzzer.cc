// Drives a real daemon::Node over the simulated backend with a sequence of
// requests decoded from the input, and checks after each one what must hold
// whatever the requests were: budgets, chunks and the host pool add up, and
// nothing outlives the processes that held it.
//
// Input: records of [op, selector, length, length bytes]. The bytes are the
// op's request protobuf (skipped when they do not parse) or its raw
// arguments. The selector picks a token or id from what earlier ops
// created, a corrupted one, or a forged one, so that both authorised and
// refused calls are exercised.
#include <sys/types.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "daemon/backend/sim_backend.h"
#include "daemon/host_pool.h"
#include "daemon/metrics.h"
#include "daemon/metrics_observer.h"
#include "daemon/node.h"
#include "deltad/v1/memory_manager.pb.h"
#include "fuzz/fuzz_target.h"
#include "google/protobuf/stubs/logging.h"

namespace deltad::fuzz {
namespace {

using daemon::Node;
using daemon::OrdersBySession;

constexpr int64_t kKiB = 1024;
constexpr int64_t kMiB = 1024 * kKiB;
// Small enough that every limit is within reach of a short input: three
// sessions' guaranteed minimum fills a GPU, a fourth session hits the
// per-GPU limit, two sessions' default quota empties the host pool, and a
// GPU holds a few dozen chunks.
constexpr int kGpus = 2;
constexpr int64_t kGpuMemory = 4 * kMiB;
constexpr int64_t kChunk = 64 * kKiB;
constexpr int64_t kSlab = 64 * kKiB;
constexpr int64_t kPoolBytes = 4 * kSlab;
constexpr int kMaxSessionsPerGpu = 4;
constexpr size_t kMaxOps = 64;

enum Op : uint8_t {
  kRegisterPeer,
  kPeerGone,
  kOpenSession,
  kCloseSession,
  kApply,
  kRelease,
  kGrantChunks,
  kReturnChunks,
  kHostSlabs,
  kListTensors,
  kStatus,
  kSetReachable,
  kUndeliverable,
  kOpCount,
};

daemon::NodeOptions Options() {
  daemon::NodeOptions o;
  o.min_session_bytes = kMiB;
  o.default_host_quota_bytes = 2 * kSlab;
  o.max_sessions_per_gpu = kMaxSessionsPerGpu;
  o.side_socket_path = "/fuzz.sock.fds";
  o.policy.max_tensors_per_session = 64;
  o.policy.max_batch_events = 16;
  return o;
}

daemon::SimBackendOptions BackendOptions() {
  daemon::SimBackendOptions o;
  o.gpus = kGpus;
  o.memory_bytes = kGpuMemory;
  o.chunk_bytes = kChunk;
  return o;
}

// Metrics only count; made once, since registering the families costs more
// than a whole input and nothing the node decides depends on them.
daemon::Metrics* SharedMetrics() {
  static daemon::Metrics* metrics = [] {
    std::vector<daemon::GpuLabel> labels;
    for (int g = 0; g < kGpus; ++g) {
      labels.push_back({g, "GPU-fuzz-" + std::to_string(g), kGpuMemory});
    }
    auto m = daemon::Metrics::Create(labels, "fuzz", "sim");
    DELTAD_FUZZ_CHECK(m.ok());
    return m->release();
  }();
  return metrics;
}

// DELTAD_FUZZ_VERBOSE=1 prints each call's outcome, to read a reproducer.
bool Verbose() {
  static const bool verbose = std::getenv("DELTAD_FUZZ_VERBOSE") != nullptr;
  return verbose;
}

struct Session {
  std::string token;
  uint64_t id = 0;
  size_t peer = 0;  // index in Harness::peers
};

class Harness {
 public:
  bool Init() {
    auto backend = daemon::SimBackend::Create(BackendOptions());
    DELTAD_FUZZ_CHECK(backend.ok());
    backend_ = std::move(*backend);
    auto pool = daemon::HostPool::Create(kPoolBytes, kSlab);
    // Out of descriptors, say: nothing to learn from this input.
    if (!pool.ok()) return false;
    pool_ = std::move(*pool);
    auto node = Node::Create(
        *backend_, *pool_,
        std::make_unique<daemon::MetricsObserver>(*SharedMetrics()), Options());
    DELTAD_FUZZ_CHECK(node.ok());
    node_ = std::move(*node);
    return true;
  }

  void Run(const uint8_t* data, size_t size) {
    size_t ops = 0;
    while (size >= 3 && ops++ < kMaxOps) {
      const uint8_t op = data[0] % kOpCount;
      const uint8_t sel = data[1];
      const size_t len = std::min<size_t>(data[2], size - 3);
      const std::string arg(reinterpret_cast<const char*>(data + 3), len);
      data += 3 + len;
      size -= 3 + len;
      const absl::Status s = Do(static_cast<Op>(op), sel, arg);
      if (Verbose()) {
        std::fprintf(stderr, "op %d sel %d len %zu: %s\n", op, sel, len,
                     s.ToString().c_str());
      }
      CheckInvariants();
    }
    // Every process goes away: all it held must come back.
    for (const std::string& peer : peers_) CheckOrders(node_->PeerGone(peer));
    CheckInvariants();
    const v1::NodeStatusResponse s = node_->Status();
    DELTAD_FUZZ_CHECK(s.sessions_size() == 0);
    DELTAD_FUZZ_CHECK(s.host_pool_granted_bytes() == 0);
    for (const v1::GpuStatus& g : s.gpus()) {
      DELTAD_FUZZ_CHECK(g.sessions() == 0);
      DELTAD_FUZZ_CHECK(g.chunk_bytes() == 0);
      DELTAD_FUZZ_CHECK(g.used_bytes() == 0);
    }
  }

 private:
  // A real token by index, one with a flipped bit, or a forged one.
  static std::string Pick(const std::vector<std::string>& real, uint8_t sel) {
    if (sel < 0xC0 && !real.empty()) return real[sel % real.size()];
    if (sel < 0xE0 && !real.empty()) {
      std::string t = real[sel % real.size()];
      if (!t.empty()) t[sel % t.size()] ^= 1;
      return t;
    }
    switch (sel % 3) {
      case 0:
        return "";
      case 1:
        return "forged";
      default:
        return std::string(32, static_cast<char>(sel));
    }
  }

  std::vector<std::string> SessionTokens() const {
    std::vector<std::string> t;
    for (const Session& s : sessions_) t.push_back(s.token);
    return t;
  }

  uint64_t PickId(uint8_t sel) const {
    if (sel < 0xE0 && !sessions_.empty()) {
      return sessions_[sel % sessions_.size()].id;
    }
    return sel == 0xFF ? ~uint64_t{0} : sel & 0x1F;
  }

  // The session token by `sel` and, by the argument's first byte, its own
  // process's peer token (below 0x80) or any other.
  std::pair<std::string, std::string> SessionAndPeer(uint8_t sel,
                                                     const std::string& arg) {
    const std::string token = Pick(SessionTokens(), sel);
    const uint8_t peer_sel = arg.empty() ? 0 : static_cast<uint8_t>(arg[0]);
    if (peer_sel < 0x80 && !sessions_.empty() && sel < 0xC0) {
      return {token, peers_[sessions_[sel % sessions_.size()].peer]};
    }
    return {token, Pick(peers_, peer_sel)};
  }

  // The outcome of the call, for --verbose replays.
  absl::Status Do(Op op, uint8_t sel, const std::string& arg) {
    switch (op) {
      case kRegisterPeer: {
        daemon::PeerIdentity who;
        who.pid = 1000 + sel;
        who.uid = sel;
        auto token = node_->registry().RegisterPeer(who);
        if (!token.ok()) return token.status();
        peers_.push_back(std::move(*token));
        return absl::OkStatus();
      }
      case kPeerGone:
        // The token stays listed: later calls with it must be refused.
        CheckOrders(node_->PeerGone(Pick(peers_, sel)));
        return absl::OkStatus();
      case kOpenSession: {
        v1::OpenSessionRequest r;
        if (!r.ParseFromString(arg)) return Unparsed();
        const std::string peer = Pick(peers_, sel);
        auto opened = node_->OpenSession(peer, r);
        if (!opened.ok()) return opened.status();
        CheckOrders(opened->others);
        DELTAD_FUZZ_CHECK(opened->response.granted_budget_bytes() >= 0);
        int64_t slab_bytes = 0;
        for (const daemon::Slab& s : opened->slabs) slab_bytes += s.bytes;
        DELTAD_FUZZ_CHECK(slab_bytes == opened->response.host_quota_bytes());
        // Only a live peer token opens a session, never a forged one.
        const auto it = std::find(peers_.begin(), peers_.end(), peer);
        DELTAD_FUZZ_CHECK(it != peers_.end());
        sessions_.push_back({opened->response.session_token(),
                             opened->response.session_id(),
                             static_cast<size_t>(it - peers_.begin())});
        return absl::OkStatus();
      }
      case kCloseSession: {
        auto others = node_->CloseSession(Pick(SessionTokens(), sel));
        if (others.ok()) CheckOrders(*others);
        return others.status();
      }
      case kApply: {
        v1::EventBatch batch;
        if (!batch.ParseFromString(arg)) return Unparsed();
        auto orders = node_->Apply(Pick(SessionTokens(), sel), batch);
        if (orders.ok()) CheckOrders(*orders);
        return orders.status();
      }
      case kRelease: {
        v1::ReleaseRequest r;
        if (!r.ParseFromString(arg)) return Unparsed();
        r.set_session_token(Pick(SessionTokens(), sel));
        auto released = node_->Release(r);
        if (!released.ok()) return released.status();
        int64_t bytes = 0;
        for (const v1::ReleaseOrder& o : released->response.release()) {
          bytes += o.bytes();
        }
        DELTAD_FUZZ_CHECK(bytes == released->response.bytes());
        CheckOrders(released->others);
        return absl::OkStatus();
      }
      case kGrantChunks: {
        const auto [token, peer] = SessionAndPeer(sel, arg);
        // In chunks (the usual request) from the second byte, or any
        // 8-byte count.
        int64_t target = 0;
        if (arg.size() >= 9) {
          std::memcpy(&target, arg.data() + 1, sizeof(target));
        } else if (arg.size() >= 2) {
          target = static_cast<uint8_t>(arg[1]) * kChunk / 2;
        }
        auto granted = node_->GrantChunks(token, peer, target);
        if (!granted.ok()) return granted.status();
        for (const common::side::Grant& g : granted->chunks) {
          DELTAD_FUZZ_CHECK(g.bytes > 0 && g.fd.valid());
          chunks_.push_back(g.id);
        }
        CheckOrders(granted->others);
        return absl::OkStatus();
      }
      case kReturnChunks: {
        const auto [token, peer] = SessionAndPeer(sel, arg);
        // Each further byte: a chunk granted before, or a made-up id.
        std::vector<uint64_t> ids;
        for (size_t i = 1; i < arg.size(); ++i) {
          const auto b = static_cast<uint8_t>(arg[i]);
          ids.push_back(b < 0xE0 && !chunks_.empty()
                            ? chunks_[b % chunks_.size()]
                            : uint64_t{b} << (b % 8));
        }
        return node_->ReturnChunks(token, peer, ids);
      }
      case kHostSlabs: {
        const auto [token, peer] = SessionAndPeer(sel, arg);
        auto slabs = node_->HostSlabs(token, peer);
        if (!slabs.ok()) return slabs.status();
        for (const common::side::Grant& g : *slabs) {
          DELTAD_FUZZ_CHECK(g.bytes == kSlab && g.fd.valid());
        }
        return absl::OkStatus();
      }
      case kListTensors: {
        v1::ListTensorsRequest r;
        if (!r.ParseFromString(arg)) return Unparsed();
        if (sel < 0xC0) r.set_session_id(PickId(sel));
        auto listed = node_->ListTensors(r);
        if (!listed.ok()) return listed.status();
        const uint32_t limit =
            r.limit() == 0 ? Node::kDefaultListTensors : r.limit();
        DELTAD_FUZZ_CHECK(listed->tensors_size() <= static_cast<int>(limit));
        return absl::OkStatus();
      }
      case kStatus:
        (void)node_->Status();
        return absl::OkStatus();
      case kSetReachable:
        node_->SetReachable(PickId(sel), !arg.empty() && (arg[0] & 1));
        return absl::OkStatus();
      case kUndeliverable: {
        v1::Orders orders;
        if (!orders.ParseFromString(arg)) return Unparsed();
        node_->Undeliverable(PickId(sel), orders);
        return absl::OkStatus();
      }
      case kOpCount:
        break;
    }
    return absl::OkStatus();
  }

  static absl::Status Unparsed() {
    return absl::InvalidArgumentError("(fuzz) the bytes are not the request");
  }

  // Orders go to live sessions only: one that is gone has no one to carry
  // them out.
  void CheckOrders(const OrdersBySession& orders) const {
    if (orders.empty()) return;
    const std::vector<daemon::SessionInfo> live = node_->registry().List();
    for (const auto& [id, o] : orders) {
      bool found = false;
      for (const daemon::SessionInfo& s : live) found |= s.id == id;
      DELTAD_FUZZ_CHECK(found);
      for (const v1::ReleaseOrder& r : o.release()) {
        DELTAD_FUZZ_CHECK(r.bytes() >= 0);
      }
      DELTAD_FUZZ_CHECK(o.new_budget_bytes() >= 0);
    }
  }

  void CheckInvariants() const {
    const v1::NodeStatusResponse s = node_->Status();
    DELTAD_FUZZ_CHECK(s.gpus_size() == kGpus);
    DELTAD_FUZZ_CHECK(static_cast<size_t>(s.sessions_size()) ==
                      node_->registry().sessions());
    for (const v1::GpuStatus& g : s.gpus()) {
      int64_t budgets = 0;
      int64_t chunks = 0;
      int64_t device = 0;
      uint32_t sessions = 0;
      for (const v1::SessionStatus& session : s.sessions()) {
        if (session.gpu() != g.gpu()) continue;
        ++sessions;
        DELTAD_FUZZ_CHECK(session.budget_bytes() >= 0);
        DELTAD_FUZZ_CHECK(session.device_bytes() >= 0);
        DELTAD_FUZZ_CHECK(session.host_bytes() >= 0);
        DELTAD_FUZZ_CHECK(session.chunk_bytes() >= 0);
        budgets += session.budget_bytes();
        chunks += session.chunk_bytes();
        device += session.device_bytes();
      }
      DELTAD_FUZZ_CHECK(g.sessions() == sessions);
      DELTAD_FUZZ_CHECK(sessions <= kMaxSessionsPerGpu);
      // The arbiter hands out the GPU's budget and never more.
      DELTAD_FUZZ_CHECK(budgets <= g.budget_bytes());
      DELTAD_FUZZ_CHECK(g.budget_bytes() <= g.memory_bytes());
      // Every chunk is some session's, and the GPU has only so much.
      DELTAD_FUZZ_CHECK(chunks == g.chunk_bytes());
      DELTAD_FUZZ_CHECK(g.chunk_bytes() <= g.memory_bytes());
      DELTAD_FUZZ_CHECK(device == g.used_bytes());
    }
    DELTAD_FUZZ_CHECK(s.host_pool_bytes() == kPoolBytes);
    DELTAD_FUZZ_CHECK(s.host_pool_granted_bytes() >= 0);
    DELTAD_FUZZ_CHECK(s.host_pool_granted_bytes() <= s.host_pool_bytes());
  }

  // Declared in this order so that the node goes first, then the pool and
  // the backend it uses.
  std::unique_ptr<daemon::SimBackend> backend_;
  std::unique_ptr<daemon::HostPool> pool_;
  std::unique_ptr<Node> node_;
  std::vector<std::string> peers_;
  std::vector<Session> sessions_;
  std::vector<uint64_t> chunks_;  // ids ever granted, returned or not
};

// Builds inputs record by record, for the seeds.
class Script {
 public:
  Script& Add(Op op, uint8_t sel, const std::string& arg = {}) {
    out_ += static_cast<char>(op);
    out_ += static_cast<char>(sel);
    out_ += static_cast<char>(std::min<size_t>(arg.size(), 255));
    out_ += arg.substr(0, 255);
    return *this;
  }
  Script& Add(Op op, uint8_t sel, const google::protobuf::Message& m) {
    return Add(op, sel, m.SerializeAsString());
  }
  std::string str() const { return out_; }

 private:
  std::string out_;
};

v1::OpenSessionRequest OpenRequest(int gpu, int64_t budget, int64_t host,
                                   uint32_t priority) {
  v1::OpenSessionRequest r;
  r.set_gpu(gpu);
  r.set_requested_budget_bytes(budget);
  r.set_requested_host_bytes(host);
  r.set_priority(priority);
  r.set_label("seed");
  return r;
}

v1::EventBatch Created(uint64_t first, int count, int64_t bytes) {
  v1::EventBatch b;
  for (int i = 0; i < count; ++i) {
    v1::TensorCreated* c = b.add_created();
    c->set_tensor_id(first + static_cast<uint64_t>(i));
    c->set_bytes(bytes);
    c->set_compute_cost_ns(1000 * (i + 1));
    if (i > 0) c->add_parent_ids(first + static_cast<uint64_t>(i) - 1);
    c->set_stable_key(first + static_cast<uint64_t>(i));
  }
  b.set_device_bytes_in_use(count * bytes);
  return b;
}

v1::EventBatch Events(
    std::vector<std::pair<v1::TensorEvent::Kind, uint64_t>> events) {
  v1::EventBatch b;
  int64_t at = 1000;
  for (const auto& [kind, id] : events) {
    v1::TensorEvent* e = b.add_events();
    e->set_kind(kind);
    e->set_tensor_id(id);
    e->set_at_ns(at += 1000);
  }
  return b;
}

}  // namespace

std::vector<std::pair<std::string, std::string>> Seeds() {
  using E = v1::TensorEvent;
  std::vector<std::pair<std::string, std::string>> seeds;
  v1::ReleaseRequest release;
  release.set_bytes(kMiB);
  *release.mutable_batch() = Events({{E::ACCESSED, 1}});
  v1::ListTensorsRequest list;
  list.set_limit(3);
  v1::Orders orders;
  v1::ReleaseOrder* order = orders.add_release();
  order->set_tensor_id(2);
  order->set_action(v1::ReleaseOrder::OFFLOAD);
  order->set_bytes(512 * kKiB);
  orders.add_prefetch_tensor_ids(1);

  // One session through every call, then closed.
  seeds.emplace_back("seed_lifecycle",
                     Script()
                         .Add(kRegisterPeer, 1)
                         .Add(kOpenSession, 0, OpenRequest(0, 0, 2 * kSlab, 1))
                         .Add(kSetReachable, 0, "\x01")
                         .Add(kApply, 0, Created(1, 6, 512 * kKiB))
                         .Add(kApply, 0,
                              Events({{E::ACCESSED, 1},
                                      {E::OFFLOADED, 2},
                                      {E::RELOADED, 2},
                                      {E::EVICTED, 3},
                                      {E::RECOMPUTED, 3},
                                      {E::RELEASE_FAILED, 4},
                                      {E::FREED, 5}}))
                         .Add(kRelease, 0, release)
                         .Add(kGrantChunks, 0, std::string("\x00\x20", 2))
                         .Add(kReturnChunks, 0, std::string("\x00\x00\x01", 3))
                         .Add(kHostSlabs, 0, std::string(1, '\0'))
                         .Add(kListTensors, 0, list)
                         .Add(kStatus, 0)
                         .Add(kUndeliverable, 0, orders)
                         .Add(kSetReachable, 0, std::string(1, '\0'))
                         .Add(kCloseSession, 0)
                         .Add(kPeerGone, 0)
                         .str());
  // Two processes share GPU 0: budgets split, the second's creations make
  // room at the first's expense, chunks run short.
  seeds.emplace_back(
      "seed_contention",
      Script()
          .Add(kRegisterPeer, 1)
          .Add(kRegisterPeer, 2)
          .Add(kOpenSession, 0, OpenRequest(0, 0, 0, 1))
          .Add(kSetReachable, 0, "\x01")
          .Add(kApply, 0, Created(1, 6, 512 * kKiB))
          .Add(kGrantChunks, 0, std::string("\x00\x60", 2))
          .Add(kOpenSession, 1, OpenRequest(0, 2 * kMiB, kSlab, 5))
          .Add(kSetReachable, 1, "\x01")
          .Add(kApply, 1, Created(100, 4, 512 * kKiB))
          .Add(kRelease, 1, release)
          .Add(kGrantChunks, 1, std::string("\x00\x40", 2))
          .Add(kReturnChunks, 0, std::string("\x00\x01\x02\x03", 4))
          .Add(kPeerGone, 0)
          .Add(kApply, 1, Events({{E::ACCESSED, 100}, {E::FREED, 101}}))
          .str());
  // Past every limit: sessions per GPU, guaranteed minimums, the host pool,
  // tensors per session, events per batch.
  Script limits;
  for (uint8_t p = 0; p < 6; ++p) limits.Add(kRegisterPeer, p);
  for (uint8_t p = 0; p < 6; ++p) {
    limits.Add(kOpenSession, p, OpenRequest(1, 256 * kKiB, 3 * kSlab, p));
  }
  // Batches of creations small enough for one record each.
  for (uint64_t first = 1; first < 80; first += 10) {
    limits.Add(kApply, 0, Created(first, 10, kChunk));
  }
  limits.Add(kGrantChunks, 1,
             std::string("\x00\xff\xff\xff\xff\xff\xff\xff\x7f", 9));
  seeds.emplace_back("seed_limits", limits.str());
  // Refused calls: forged and corrupted tokens, another process's session,
  // unknown ids, bad requests.
  seeds.emplace_back("seed_refused",
                     Script()
                         .Add(kOpenSession, 0xE1, OpenRequest(0, 0, 0, 1))
                         .Add(kRegisterPeer, 1)
                         .Add(kRegisterPeer, 2)
                         .Add(kOpenSession, 0, OpenRequest(7, 0, 0, 1))
                         .Add(kOpenSession, 0, OpenRequest(0, -1, 0, 1))
                         .Add(kOpenSession, 0, OpenRequest(0, 0, 0, 101))
                         .Add(kOpenSession, 0, OpenRequest(0, 0, 0, 1))
                         .Add(kOpenSession, 0, OpenRequest(0, 0, 0, 1))
                         .Add(kApply, 0xC3, Created(1, 1, kMiB))
                         .Add(kHostSlabs, 0, "\x81")
                         .Add(kGrantChunks, 0, "\xFF\x10")
                         .Add(kReturnChunks, 0, std::string("\x00\xF0\xF1", 3))
                         .Add(kListTensors, 0xF0, list)
                         .Add(kUndeliverable, 0xFF, orders)
                         .Add(kCloseSession, 0xE2)
                         .Add(kCloseSession, 0)
                         .Add(kCloseSession, 0)
                         .str());
  return seeds;
}

}  // namespace deltad::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Protobuf logs every string that is not UTF-8; parsing fails anyway.
  static const bool quiet = [] {
    google::protobuf::SetLogHandler(nullptr);
    return true;
  }();
  (void)quiet;
  (void)deltad::fuzz::SharedMetrics();  // made once, before counting
  const int fds = deltad::fuzz::OpenFds();
  {
    deltad::fuzz::Harness h;
    if (h.Init()) h.Run(data, size);
  }
  DELTAD_FUZZ_CHECK(deltad::fuzz::OpenFds() == fds);
  return 0;
}
