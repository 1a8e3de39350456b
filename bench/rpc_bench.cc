// rpc_bench: the daemon's RPC paths on a full node, over its Unix socket.
//
// A deltad Server runs in this process (sim backend, 8 GPUs of 80 GiB); the
// clients are gRPC stubs over the same Unix socket a training process uses.
// With every GPU carrying its sessions, each tracking its tensors, it times
//  (a) ingest: TensorCreated, then ACCESSED events streamed in batches on
//      the Session streams, counted from the first Write until the daemon
//      has applied the last batch of every stream;
//  (b) the synchronous release decision (Release RPC), for one tensor and
//      for --release_bytes, beside an empty RPC on the same channel and
//      beside Node::Release called in-process;
// and last, ingest again: every tensor FREED, before the sessions close.
// The targets of the issue are printed as met or MISSED; --update_doc=FILE
// rewrites this benchmark's section of docs/BENCHMARKS.md.
//
// One process may hold one session per GPU, and a session is bound to the
// process behind its peer token. The sessions of the simulated processes are
// opened with peer tokens registered in-process (SessionRegistry::RegisterPeer
// with made-up pids), not through the side socket: every other call goes over
// the socket as a real client's would.

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/report.h"
#include "daemon/config.h"
#include "daemon/library_log.h"
#include "daemon/server.h"
#include "deltad/v1/memory_manager.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"

ABSL_FLAG(int, gpus, 8, "simulated GPUs, 80 GiB each");
ABSL_FLAG(int, sessions_per_gpu, 8,
          "sessions on each GPU, one per simulated training process");
ABSL_FLAG(int, tensors, 100000, "tensors each session tracks");
ABSL_FLAG(int, calls, 2000,
          "timed Release calls (and as many empty RPCs beside them)");
ABSL_FLAG(int, batch, 4096, "entries per EventBatch on the Session streams");
ABSL_FLAG(int, access_rounds, 1,
          "ACCESSED events streamed per tracked tensor in the ingest phase");
ABSL_FLAG(int64_t, release_bytes, int64_t{1} << 20,
          "bytes beyond the GPU's free bytes that the second set of timed "
          "Release calls asks room for");
ABSL_FLAG(bool, free_before_close, true,
          "free every tensor (FREED, newest first) before closing the "
          "sessions; false closes them holding their tensors");
ABSL_FLAG(std::string, update_doc, "",
          "rewrite the rpc_bench section of this Markdown file");

namespace deltad::bench {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kGiB = int64_t{1} << 30;
// Above Linux's PID_MAX_LIMIT, so no real process can share these pids.
constexpr pid_t kFakePidBase = pid_t{1} << 22;
// A tensor id no session ever creates: a batch that accesses it is refused,
// and the refusal coming back on the stream says that every batch written
// before it has been applied (a stream's batches are applied in order).
constexpr uint64_t kFenceId = std::numeric_limits<uint64_t>::max();
constexpr int kWarmupCalls = 200;

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

double Micros(Clock::duration d) {
  return std::chrono::duration<double, std::micro>(d).count();
}

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             Clock::now().time_since_epoch())
      .count();
}

// User plus system CPU time of the whole process (daemon and clients alike).
double CpuSeconds() {
  rusage r{};
  getrusage(RUSAGE_SELF, &r);
  return static_cast<double>(r.ru_utime.tv_sec + r.ru_stime.tv_sec) +
         static_cast<double>(r.ru_utime.tv_usec + r.ru_stime.tv_usec) / 1e6;
}

// Progress on stderr, with the seconds since the start: a run takes a minute
// or two, and where the time goes is worth seeing.
const Clock::time_point kStart = Clock::now();

void Note(const std::string& what) {
  std::fprintf(stderr, "rpc_bench [%6.1f s]: %s\n",
               Seconds(Clock::now() - kStart), what.c_str());
}

// The temporary directory of the daemon's sockets, removed on the way out
// whichever way the run ends.
std::string& TempDir() {
  static auto* dir = new std::string();
  return *dir;
}

[[noreturn]] void Die(const std::string& why) {
  std::fprintf(stderr, "rpc_bench: %s\n", why.c_str());
  if (!TempDir().empty()) {
    std::error_code ignored;
    std::filesystem::remove_all(TempDir(), ignored);
  }
  std::exit(1);
}

// One Session stream as a client holds it: one writer at a time (gRPC
// allows no more), and a reader that carries out the orders that arrive, as
// the client library's executor would, so that the daemon's view stays the
// process's.
class Stream {
 public:
  Stream(v1::MemoryManager::Stub& stub, const std::string& token) {
    stream_ = stub.Session(&context_);
    v1::SessionMessage hello;
    hello.set_session_token(token);
    if (!stream_->Write(hello)) Die("the Session stream closed at once");
    reader_ = std::thread([this] { ReadLoop(); });
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  bool Write(const v1::SessionMessage& message) {
    std::lock_guard<std::mutex> lock(write_mu_);
    return stream_->Write(message);
  }

  void WriteFence() {
    v1::SessionMessage fence;
    v1::TensorEvent* e = fence.mutable_batch()->add_events();
    e->set_kind(v1::TensorEvent::ACCESSED);
    e->set_tensor_id(kFenceId);
    if (!Write(fence)) Die("a Session stream closed during the run");
  }

  // Waits until `n` fences in all have come back; dies on any other
  // refusal, which would mean that batches were not applied.
  void WaitFences(int n) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return fences_ >= n || !error_.empty() || ended_; });
    if (!error_.empty()) Die(absl::StrCat("a batch was refused: ", error_));
    if (fences_ < n) Die("the daemon ended a Session stream during the run");
  }

  int64_t orders_carried_out() {
    std::lock_guard<std::mutex> lock(mu_);
    return orders_;
  }

  void Close() {
    {
      std::lock_guard<std::mutex> lock(write_mu_);
      stream_->WritesDone();
    }
    reader_.join();
    (void)stream_->Finish();
  }

 private:
  void ReadLoop() {
    const std::string fence_marker = absl::StrCat("tensor ", kFenceId);
    v1::Orders orders;
    while (stream_->Read(&orders)) {
      if (!orders.rejected_batch().empty()) {
        std::lock_guard<std::mutex> lock(mu_);
        if (absl::StrContains(orders.rejected_batch(), fence_marker)) {
          ++fences_;
        } else if (error_.empty()) {
          error_ = orders.rejected_batch();
        }
        cv_.notify_all();
        continue;
      }
      if (orders.release_size() == 0 && orders.prefetch_tensor_ids_size() == 0)
        continue;  // budget changes: nothing to carry out
      v1::SessionMessage done;
      v1::EventBatch* batch = done.mutable_batch();
      for (const v1::ReleaseOrder& o : orders.release()) {
        v1::TensorEvent* e = batch->add_events();
        e->set_kind(o.action() == v1::ReleaseOrder::OFFLOAD
                        ? v1::TensorEvent::OFFLOADED
                        : v1::TensorEvent::EVICTED);
        e->set_tensor_id(o.tensor_id());
        e->set_at_ns(NowNs());
      }
      for (uint64_t id : orders.prefetch_tensor_ids()) {
        v1::TensorEvent* e = batch->add_events();
        e->set_kind(v1::TensorEvent::RELOADED);
        e->set_tensor_id(id);
        e->set_at_ns(NowNs());
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        orders_ += orders.release_size() + orders.prefetch_tensor_ids_size();
      }
      if (!Write(done)) break;
    }
    std::lock_guard<std::mutex> lock(mu_);
    ended_ = true;
    cv_.notify_all();
  }

  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SessionMessage, v1::Orders>>
      stream_;
  std::mutex write_mu_;
  std::mutex mu_;
  std::condition_variable cv_;
  int fences_ = 0;
  bool ended_ = false;  // the daemon's side of the stream is done
  int64_t orders_ = 0;
  std::string error_;
  std::thread reader_;
};

struct Session {
  size_t index = 0;  // in opening order, which is also session id - 1
  int process = 0;
  int gpu = 0;
  std::string token;
  int64_t budget = 0;
  std::vector<int64_t> sizes;  // of tensor i + 1
  std::unique_ptr<Stream> stream;
};

// A simulated training process: its own channel (so its own connection on
// the socket, as a real process has) and one session per GPU.
struct Process {
  std::string peer_token;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::MemoryManager::Stub> stub;
  std::vector<Session*> sessions;  // by GPU
};

// Sizes log-uniform over 1 KiB..256 KiB (mean 47 KiB), so 100k tensors are
// about half of a 9 GiB share: the table is full of tensors, the GPU below
// its high watermark, and no early offload disturbs the ingest. Scaled down
// for settings where they would not fit the same way.
std::vector<int64_t> DrawSizes(int n, int64_t share, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> log_size(10, 18);
  std::vector<int64_t> sizes(n);
  double total = 0;
  for (int64_t& s : sizes) {
    s = static_cast<int64_t>(std::exp2(log_size(rng)));
    total += static_cast<double>(s);
  }
  const double limit = 0.5 * static_cast<double>(share);
  if (total > limit) {
    for (int64_t& s : sizes) {
      s = std::max<int64_t>(
          512, static_cast<int64_t>(static_cast<double>(s) * limit / total));
    }
  }
  return sizes;
}

// The creations of one session, in batches: a chain of activations (each
// reads the one before), every tenth with a skip connection from up to a
// thousand tensors back, the first an input that cannot be recomputed.
std::vector<v1::SessionMessage> CreationBatches(const Session& s, int batch,
                                                std::mt19937_64& rng) {
  std::uniform_real_distribution<double> log_cost(4, 7);  // 10 us..10 ms
  const int n = static_cast<int>(s.sizes.size());
  std::vector<v1::SessionMessage> out;
  int64_t held = 0;
  for (int first = 1; first <= n; first += batch) {
    v1::SessionMessage m;
    v1::EventBatch* b = m.mutable_batch();
    for (int i = first; i < first + batch && i <= n; ++i) {
      v1::TensorCreated* c = b->add_created();
      c->set_tensor_id(static_cast<uint64_t>(i));
      c->set_bytes(s.sizes[i - 1]);
      c->set_compute_cost_ns(static_cast<int64_t>(std::pow(10, log_cost(rng))));
      c->set_stable_key(static_cast<uint64_t>(i));
      if (i == 1) {
        c->mutable_flags()->set_uncomputable(true);
      } else {
        c->add_parent_ids(static_cast<uint64_t>(i - 1));
        if (i % 10 == 0 && i > 2) {
          std::uniform_int_distribution<int> back(std::max(1, i - 1000), i - 2);
          c->add_parent_ids(static_cast<uint64_t>(back(rng)));
        }
      }
      held += s.sizes[i - 1];
    }
    b->set_device_bytes_in_use(held);
    out.push_back(std::move(m));
  }
  return out;
}

// One ACCESSED per tensor and round, newest first, as a backward pass reads
// them.
// Events of one kind for every tracked tensor, newest first, `rounds`
// times, in batches of `batch`.
std::vector<v1::SessionMessage> EventBatches(const Session& s, int batch,
                                             int rounds,
                                             v1::TensorEvent::Kind kind) {
  const int n = static_cast<int>(s.sizes.size());
  std::vector<v1::SessionMessage> out;
  int64_t at = NowNs();
  v1::SessionMessage m;
  for (int r = 0; r < rounds; ++r) {
    for (int i = n; i >= 1; --i) {
      v1::TensorEvent* e = m.mutable_batch()->add_events();
      e->set_kind(kind);
      e->set_tensor_id(static_cast<uint64_t>(i));
      e->set_at_ns(at += 1000);
      if (m.batch().events_size() == batch) {
        out.push_back(std::move(m));
        m = v1::SessionMessage();
      }
    }
  }
  if (m.has_batch()) out.push_back(std::move(m));
  return out;
}

std::vector<v1::SessionMessage> AccessBatches(const Session& s, int batch,
                                              int rounds) {
  return EventBatches(s, batch, rounds, v1::TensorEvent::ACCESSED);
}

// The end of training: every tensor FREED, newest first as a backward pass
// drops them, so each leaves the table at once (its children are gone).
std::vector<v1::SessionMessage> FreeBatches(const Session& s, int batch) {
  return EventBatches(s, batch, 1, v1::TensorEvent::FREED);
}

struct IngestResult {
  int64_t events = 0;
  double seconds = 0;
  double cpu_seconds = 0;
  double per_second() const { return static_cast<double>(events) / seconds; }
};

// Streams every session's batches, one writer thread per process (each
// starting at a different GPU, so the writers do not queue on the same GPU's
// lock), then a fence per stream; done when every fence is back.
IngestResult Ingest(std::vector<Process>& processes,
                    std::vector<std::vector<v1::SessionMessage>>& by_session,
                    const std::vector<Session*>& order, int64_t entries,
                    int* fences) {
  const double cpu_start = CpuSeconds();
  const auto start = Clock::now();
  std::vector<std::thread> writers;
  for (size_t p = 0; p < processes.size(); ++p) {
    writers.emplace_back([&, p] {
      const auto& sessions = processes[p].sessions;
      const size_t g0 = p % sessions.size();
      size_t most = 0;
      for (const Session* s : sessions) {
        most = std::max(most, by_session[s->index].size());
      }
      for (size_t k = 0; k < most; ++k) {
        for (size_t j = 0; j < sessions.size(); ++j) {
          Session* s = sessions[(g0 + j) % sessions.size()];
          const auto& mine = by_session[s->index];
          if (k < mine.size() && !s->stream->Write(mine[k])) {
            Die("a Session stream closed during the ingest");
          }
        }
      }
      for (Session* s : sessions) s->stream->WriteFence();
    });
  }
  for (std::thread& t : writers) t.join();
  ++*fences;
  for (Session* s : order) s->stream->WaitFences(*fences);
  IngestResult r;
  r.seconds = Seconds(Clock::now() - start);
  r.cpu_seconds = CpuSeconds() - cpu_start;
  r.events = entries;
  return r;
}

v1::NodeStatusResponse Status(v1::MemoryManager::Stub& stub) {
  grpc::ClientContext context;
  v1::NodeStatusResponse status;
  const grpc::Status s = stub.NodeStatus(&context, {}, &status);
  if (!s.ok()) Die(absl::StrCat("NodeStatus: ", s.error_message()));
  return status;
}

// The empty RPC: grpc.health.v1.Health/Check for the server as a whole
// (service ""), which the daemon serves with gRPC's default health service:
// no daemon code runs, and the request and response are a few bytes. Its
// generated stub takes the same blocking unary path as Release's.
class HealthCheck {
 public:
  explicit HealthCheck(const std::shared_ptr<grpc::Channel>& channel)
      : stub_(grpc::health::v1::Health::NewStub(channel)) {}

  // Whether the daemon answers SERVING; dies when the call fails.
  bool Call() {
    grpc::health::v1::HealthCheckRequest request;
    grpc::health::v1::HealthCheckResponse response;
    grpc::ClientContext context;
    const grpc::Status s = stub_->Check(&context, request, &response);
    if (!s.ok()) Die(absl::StrCat("health check: ", s.error_message()));
    return response.status() == grpc::health::v1::HealthCheckResponse::SERVING;
  }

 private:
  std::unique_ptr<grpc::health::v1::Health::Stub> stub_;
};

struct ReleaseResult {
  std::vector<double> release_us;
  std::vector<double> empty_us;  // over RPC only
  int64_t victims = 0;
  int64_t offloads = 0;
};

// The events that carry out a release and then bring the tensor back
// (reload or recompute), so that the next decision sees the same table.
void AddRestore(const v1::ReleaseOrder& o, v1::EventBatch* batch) {
  const bool offload = o.action() == v1::ReleaseOrder::OFFLOAD;
  v1::TensorEvent* done = batch->add_events();
  done->set_kind(offload ? v1::TensorEvent::OFFLOADED
                         : v1::TensorEvent::EVICTED);
  done->set_tensor_id(o.tensor_id());
  done->set_at_ns(NowNs());
  v1::TensorEvent* back = batch->add_events();
  back->set_kind(offload ? v1::TensorEvent::RELOADED
                         : v1::TensorEvent::RECOMPUTED);
  back->set_tensor_id(o.tensor_id());
  back->set_at_ns(NowNs());
}

// Carries out and undoes the releases in `restore`, if any, with a Release of
// 1 byte: the GPU has room for a byte, so it applies the batch and orders
// nothing.
template <typename CallRelease>
void Restore(const Session& s, v1::ReleaseRequest& restore, CallRelease& call) {
  if (!restore.has_batch()) return;
  restore.set_session_token(s.token);
  restore.set_bytes(1);
  v1::ReleaseResponse response;
  const absl::Status st = call(restore, &response);
  if (!st.ok()) Die("restoring released tensors: " + st.ToString());
  if (response.release_size() != 0) Die("a 1-byte Release ordered releases");
  restore.Clear();
}

// Each step: an untimed Release of 1 byte whose batch carries out and undoes
// the last step's releases (the GPU has room for a byte, so it applies the
// batch and orders nothing); then, timed, the empty RPC (over RPC only) and
// a Release asking room for `ask` bytes, more than the GPU has free, so the
// policy must choose victims among the whole GPU's tensors.
template <typename CallRelease>
ReleaseResult TimeReleases(const Session& s, int64_t ask, int calls,
                           HealthCheck* empty, CallRelease call) {
  ReleaseResult r;
  v1::ReleaseRequest restore;
  for (int i = 0; i < kWarmupCalls + calls; ++i) {
    const bool timed = i >= kWarmupCalls;
    Restore(s, restore, call);
    if (empty != nullptr) {
      const auto t0 = Clock::now();
      (void)empty->Call();
      if (timed) r.empty_us.push_back(Micros(Clock::now() - t0));
    }
    v1::ReleaseRequest request;
    request.set_session_token(s.token);
    request.set_bytes(ask);
    v1::ReleaseResponse response;
    const auto t0 = Clock::now();
    const absl::Status st = call(request, &response);
    const auto t1 = Clock::now();
    if (!st.ok()) Die("Release: " + st.ToString());
    if (!response.room_available() || response.release_size() == 0) {
      Die("Release ordered nothing: the GPU's free bytes were misjudged");
    }
    if (timed) {
      r.release_us.push_back(Micros(t1 - t0));
      r.victims += response.release_size();
    }
    for (const v1::ReleaseOrder& o : response.release()) {
      if (timed && o.action() == v1::ReleaseOrder::OFFLOAD) ++r.offloads;
      AddRestore(o, restore.mutable_batch());
    }
  }
  Restore(s, restore, call);
  return r;
}

std::string LatencyRow(const std::string& what, const std::string& victims,
                       const Percentiles& p, double empty_p99,
                       const std::string& target, const std::string& verdict) {
  return absl::StrFormat("| %s | %s | %.1f | %.1f | %.1f | %.2fx | %s | %s |\n",
                         what, victims, p.p50, p.p99, p.mean, p.p99 / empty_p99,
                         target, verdict);
}

std::string IngestRow(const std::string& what, const IngestResult& r,
                      const std::string& target, const std::string& verdict) {
  return absl::StrFormat("| %s | %d | %.2f | %.0f | %.1f | %s | %s |\n", what,
                         r.events, r.seconds, r.per_second(), r.cpu_seconds,
                         target, verdict);
}

}  // namespace
}  // namespace deltad::bench

int main(int argc, char** argv) {
  using namespace deltad;
  using namespace deltad::bench;
  const std::string command = CommandLine("rpc_bench", argc, argv);
  absl::ParseCommandLine(argc, argv);
  const int gpus = absl::GetFlag(FLAGS_gpus);
  const int per_gpu = absl::GetFlag(FLAGS_sessions_per_gpu);
  const int tensors = absl::GetFlag(FLAGS_tensors);
  const int calls = absl::GetFlag(FLAGS_calls);
  const int batch = absl::GetFlag(FLAGS_batch);
  const int rounds = absl::GetFlag(FLAGS_access_rounds);
  const int64_t release_bytes = absl::GetFlag(FLAGS_release_bytes);
  if (gpus < 1 || per_gpu < 1 || tensors < 2 || calls < 1 || batch < 1 ||
      rounds < 1 || release_bytes < 1) {
    Die("--gpus, --sessions_per_gpu, --calls, --batch, --access_rounds and "
        "--release_bytes must be positive, --tensors at least 2");
  }
  const auto run_start = Clock::now();
  const double machine_busy_start = MachineBusySeconds();
  const double own_cpu_start = CpuSeconds();

  // --- The daemon, in this process.
  char dir_template[] = "/tmp/rpc_bench.XXXXXX";
  if (mkdtemp(dir_template) == nullptr) Die("cannot make a temporary dir");
  const std::string dir = dir_template;
  TempDir() = dir;
  v1::DaemonConfig config;
  config.set_socket_path(dir + "/deltad.sock");
  config.set_metrics_address("127.0.0.1:0");
  config.set_backend("sim");
  config.mutable_sim()->set_gpus(gpus);
  config.mutable_sim()->set_memory_bytes(80 * kGiB);
  // memfd pages come on first touch: the pool costs no memory until used.
  constexpr int64_t kPool = 64 * kGiB;
  constexpr int64_t kSlab = 256 * kMiB;
  config.set_host_pool_bytes(kPool);
  config.set_host_slab_bytes(kSlab);
  // Every session gets a quota, so the Director may offload for any of them.
  config.set_default_host_quota_bytes(
      std::max(kSlab, kPool / (gpus * per_gpu) / kSlab * kSlab));
  config = daemon::WithDefaults(config);
  if (absl::Status s = daemon::ValidateConfig(config); !s.ok()) {
    Die(s.ToString());
  }
  auto server = daemon::Server::Start(config);
  if (!server.ok()) Die(server.status().ToString());

  // --- Processes, sessions, streams.
  const int n_sessions = gpus * per_gpu;
  std::vector<Session> sessions(static_cast<size_t>(n_sessions));
  std::vector<Process> processes(static_cast<size_t>(per_gpu));
  for (int p = 0; p < per_gpu; ++p) {
    daemon::PeerIdentity peer;
    peer.pid = kFakePidBase + p;
    peer.uid = getuid();
    peer.gid = getgid();
    auto token = (*server)->node().registry().RegisterPeer(peer);
    if (!token.ok()) Die(token.status().ToString());
    Process& proc = processes[p];
    proc.peer_token = *token;
    grpc::ChannelArguments args;
    // A connection of its own, as a separate process would have.
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetMaxSendMessageSize(
        static_cast<int>(config.limits().max_message_bytes()));
    proc.channel =
        grpc::CreateCustomChannel("unix:" + config.socket_path(),
                                  grpc::InsecureChannelCredentials(), args);
    proc.stub = v1::MemoryManager::NewStub(proc.channel);
  }
  std::vector<Session*> order;  // by session id - 1
  for (int p = 0; p < per_gpu; ++p) {
    for (int g = 0; g < gpus; ++g) {
      v1::OpenSessionRequest request;
      request.set_gpu(g);
      request.set_peer_token(processes[p].peer_token);
      request.set_label(absl::StrCat("rpc_bench process ", p, " gpu ", g));
      v1::OpenSessionResponse response;
      grpc::ClientContext context;
      const grpc::Status s =
          processes[p].stub->OpenSession(&context, request, &response);
      if (!s.ok()) Die(absl::StrCat("OpenSession: ", s.error_message()));
      Session& session = sessions[static_cast<size_t>(p * gpus + g)];
      session.index = order.size();
      session.process = p;
      session.gpu = g;
      session.token = response.session_token();
      if (response.session_id() != session.index + 1) {
        Die("session ids are not 1..n in opening order");
      }
      processes[p].sessions.push_back(&session);
      order.push_back(&session);
    }
  }
  const v1::NodeStatusResponse opened = Status(*processes[0].stub);
  const int64_t gpu_budget = opened.gpus(0).budget_bytes();
  for (const v1::SessionStatus& st : opened.sessions()) {
    sessions[static_cast<size_t>(st.session_id() - 1)].budget =
        st.budget_bytes();
  }
  for (Session& s : sessions) {
    s.stream = std::make_unique<Stream>(*processes[s.process].stub, s.token);
  }
  Note(absl::StrFormat(
      "%d GPUs x %d sessions open, %.1f GiB each; building %d tensors per "
      "session",
      gpus, per_gpu, static_cast<double>(sessions[0].budget) / kGiB, tensors));

  // --- (a) ingest.
  int fences = 0;
  std::vector<std::vector<v1::SessionMessage>> batches(sessions.size());
  int64_t total_bytes = 0;
  for (Session* s : order) {
    std::mt19937_64 rng(1000 + s->index);
    s->sizes = DrawSizes(tensors, s->budget, rng);
    for (int64_t b : s->sizes) total_bytes += b;
    batches[s->index] = CreationBatches(*s, batch, rng);
  }
  const int64_t created_events = int64_t{tensors} * n_sessions;
  Note(absl::StrCat("streaming ", created_events, " TensorCreated"));
  const IngestResult created =
      Ingest(processes, batches, order, created_events, &fences);
  for (auto& b : batches) std::vector<v1::SessionMessage>().swap(b);

  for (Session* s : order) {
    batches[s->index] = AccessBatches(*s, batch, rounds);
  }
  const int64_t access_events = created_events * rounds;
  Note(absl::StrCat("streaming ", access_events, " ACCESSED"));
  const IngestResult accessed =
      Ingest(processes, batches, order, access_events, &fences);
  for (auto& b : batches) std::vector<v1::SessionMessage>().swap(b);

  const v1::NodeStatusResponse filled = Status(*processes[0].stub);
  for (const v1::SessionStatus& st : filled.sessions()) {
    if (st.tensors() != static_cast<uint64_t>(tensors)) {
      Die(absl::StrCat("session ", st.session_id(), " tracks ", st.tensors(),
                       " tensors, not ", tensors));
    }
  }

  // --- (b) release decisions on GPU 0, by process 0's session there.
  Session& s0 = *processes[0].sessions[0];
  const int64_t used = filled.gpus(0).used_bytes();
  HealthCheck health(processes[0].channel);
  if (!health.Call()) {
    Die("the health service does not answer SERVING");
  }
  v1::MemoryManager::Stub& stub = *processes[0].stub;
  const auto over_socket = [&](const v1::ReleaseRequest& request,
                               v1::ReleaseResponse* response) {
    grpc::ClientContext context;
    const grpc::Status s = stub.Release(&context, request, response);
    return s.ok() ? absl::OkStatus()
                  : absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                                 s.error_message());
  };
  daemon::Node& node = (*server)->node();
  int64_t direct_others = 0;
  const auto in_process = [&](const v1::ReleaseRequest& request,
                              v1::ReleaseResponse* response) {
    auto released = node.Release(request);
    if (!released.ok()) return released.status();
    direct_others += static_cast<int64_t>(released->others.size());
    *response = std::move(released->response);
    return absl::OkStatus();
  };
  // Room for one byte more than the GPU has free: the policy picks exactly
  // one tensor, one decision. Then --release_bytes more: as many decisions
  // as it takes tensors to cover them, as for a real allocation.
  struct Case {
    std::string name;
    int64_t extra = 0;  // bytes asked beyond the GPU's free bytes
    ReleaseResult rpc;
    ReleaseResult direct;
  };
  std::vector<Case> cases(2);
  cases[0].name = "1 byte";
  cases[0].extra = 1;
  cases[1].name = absl::StrCat(release_bytes / 1024, " KiB");
  cases[1].extra = release_bytes;
  std::vector<double> empty_all;
  for (Case& c : cases) {
    const int64_t ask = gpu_budget - used + c.extra;
    if (ask > gpu_budget) Die("--release_bytes is more than GPU 0 holds");
    Note(absl::StrCat(calls, " Release calls over the socket, room for ",
                      c.name, " more than free"));
    c.rpc = TimeReleases(s0, ask, calls, &health, over_socket);
    Note(absl::StrCat(calls, " Node::Release calls in-process, room for ",
                      c.name, " more than free"));
    c.direct = TimeReleases(s0, ask, calls, nullptr, in_process);
    empty_all.insert(empty_all.end(), c.rpc.empty_us.begin(),
                     c.rpc.empty_us.end());
  }
  // Every release was undone: the table must be as the ingest left it.
  const v1::NodeStatusResponse after = Status(*processes[0].stub);
  if (after.gpus(0).used_bytes() != used) {
    Die(absl::StrCat("GPU 0 holds ", after.gpus(0).used_bytes(),
                     " bytes after the release phase, not ", used));
  }

  // Freed before closing, as a training process does, which measures the
  // ingest of FREED. --free_before_close=false closes the sessions holding
  // all their tensors instead, as when processes die: the "closing" step
  // then times the reclaim (TensorTable::RemoveSession, in bulk).
  IngestResult freed;
  if (absl::GetFlag(FLAGS_free_before_close)) {
    for (Session* s : order) batches[s->index] = FreeBatches(*s, batch);
    Note(absl::StrCat("streaming ", created_events, " FREED"));
    freed = Ingest(processes, batches, order, created_events, &fences);
    for (auto& b : batches) std::vector<v1::SessionMessage>().swap(b);
    const v1::NodeStatusResponse emptied = Status(*processes[0].stub);
    for (const v1::SessionStatus& st : emptied.sessions()) {
      if (st.tensors() != 0) {
        Die(absl::StrCat("session ", st.session_id(), " still tracks ",
                         st.tensors(), " tensors after freeing them all"));
      }
    }
  }

  int64_t stream_orders = 0;
  for (Session& s : sessions) stream_orders += s.stream->orders_carried_out();

  const Percentiles empty_p = Summarise(empty_all);
  bool latency_met = true;
  for (const Case& c : cases) {
    latency_met =
        latency_met && Summarise(c.rpc.release_us).p99 <= 2 * empty_p.p99;
  }
  const bool ingest_met = accessed.per_second() >= 1e6;
  const double run_s = Seconds(Clock::now() - run_start);
  const double cores = std::thread::hardware_concurrency();
  const double others_cpu =
      std::max(0.0, (MachineBusySeconds() - machine_busy_start) -
                        (CpuSeconds() - own_cpu_start));

  // --- Report.
  std::ostringstream md;
  md << "## rpc_bench: release decision and event ingest over the socket\n\n"
     << "Command: `" << command << "`  \n"
     << "Machine: " << CpuModel() << ", " << std::thread::hardware_concurrency()
     << " cores; other processes used "
     << absl::StrFormat("%.1f of the %.0f", others_cpu, cores * run_s)
     << " CPU seconds (cores x wall time) of the run  \nDate: " << Today()
     << "\n\n"
     << "One process runs the daemon (`Server`, sim backend, " << gpus
     << " GPUs of 80 GiB, budget "
     << absl::StrFormat("%.1f", 1.0 * gpu_budget / kGiB)
     << " GiB each) and the clients: " << per_gpu
     << " simulated training processes, each with its own gRPC channel on the "
        "Unix socket and one session per GPU, so "
     << n_sessions << " sessions of "
     << absl::StrFormat("%.1f", 1.0 * sessions[0].budget / kGiB)
     << " GiB, each tracking " << tensors << " tensors ("
     << absl::StrFormat("%.1f", 1.0 * total_bytes / n_sessions / kGiB)
     << " GiB per session: sizes log-uniform 1 KiB..256 KiB, a chain of "
        "parents with a skip link every tenth tensor). Their peer tokens are "
        "registered in-process (`SessionRegistry::RegisterPeer` with made-up "
        "pids) instead of over the side socket; every call below goes over "
        "the socket.\n\n"
     << "**Release decision.** Process 0's session on GPU 0 calls `Release` "
        "asking room for the GPU's free bytes plus 1 byte, so that the "
        "policy (`delta_cost`, sampled search) must pick one tensor among the "
        "GPU's "
     << per_gpu * tensors << ", and then plus " << cases[1].name
     << ", as many tensors as cover it ("
     << absl::StrFormat("%.0f%%",
                        100.0 * cases[1].rpc.offloads /
                            std::max<int64_t>(1, cases[1].rpc.victims))
     << " of them offloads, the rest evictions). Between timed calls an "
        "untimed 1-byte `Release` reports them carried out and back "
        "(OFFLOADED+RELOADED or EVICTED+RECOMPUTED), so every call sees the "
        "same table. The empty RPC is `grpc.health.v1.Health/Check` (gRPC's "
        "default health service, empty request: no daemon code runs) on the "
        "same channel, timed alternately with each `Release`. "
        "`Node::Release` in-process is the same request without gRPC: the "
        "decision itself. "
     << calls << " calls each after " << kWarmupCalls << " warm-up calls.\n\n"
     << "| call | tensors per call | p50 (us) | p99 (us) | mean (us) | "
        "p99 / empty p99 | target | result |\n"
     << "|---|---:|---:|---:|---:|---:|---|---|\n"
     << LatencyRow("empty RPC (Health/Check)", "-", empty_p, empty_p.p99, "-",
                   "-");
  for (const Case& c : cases) {
    const Percentiles p = Summarise(c.rpc.release_us);
    md << LatencyRow(absl::StrCat("Release over the socket, free + ", c.name),
                     absl::StrFormat("%.1f", 1.0 * c.rpc.victims / calls), p,
                     empty_p.p99, "p99 <= 2x empty p99",
                     Verdict(p.p99 <= 2 * empty_p.p99));
  }
  for (const Case& c : cases) {
    md << LatencyRow(absl::StrCat("Node::Release in-process, free + ", c.name),
                     absl::StrFormat("%.1f", 1.0 * c.direct.victims / calls),
                     Summarise(c.direct.release_us), empty_p.p99, "-", "-");
  }
  md << "\n"
     << "**Ingest.** All " << n_sessions
     << " Session streams at once, one writer thread per process, batches "
        "of "
     << batch
     << " entries built before the clock starts; timed from the first "
        "Write until each stream has answered a final fence batch (one the "
        "daemon refuses, so its answer on the stream says that every batch "
        "before it was applied). CPU is the whole process's, daemon and "
        "clients together.\n\n"
     << "| events | count | seconds | events/s | CPU s | target | result |\n"
     << "|---|---:|---:|---:|---:|---|---|\n"
     << IngestRow("TensorCreated", created, "-", "-")
     << IngestRow("ACCESSED", accessed, ">= 1000000/s", Verdict(ingest_met))
     << (freed.events > 0 ? IngestRow("FREED, newest first", freed, "-", "-")
                          : "")
     << "\n"
     << "Orders that came on the streams during the run (carried out by the "
        "clients' reader threads): "
     << stream_orders
     << "; orders for other sessions from the in-process Node::Release "
        "calls: "
     << direct_others
     << ". gRPC log lines routed through the daemon, "
        "written or not (gRPC is told to log at debug severity so that the "
        "daemon sees the GOAWAYs it sends to ping floods; each line costs a "
        "formatted message): "
     << daemon::GrpcLogLinesRouted() << " in the whole run. Whole run "
     << absl::StrFormat("%.0f", run_s) << " s.\n\n";
  const std::string doc = absl::GetFlag(FLAGS_update_doc);
  if (!PrintReport(md.str(), doc, "rpc_bench")) {
    Die(absl::StrCat("could not write ", doc));
  }
  if (!doc.empty()) Note(absl::StrCat("updated ", doc));

  Note(absl::StrCat("closing ", n_sessions, " sessions"));
  for (Session& s : sessions) s.stream->Close();
  (*server)->Shutdown();
  server->reset();
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
  Note("done");
  return 0;
}
