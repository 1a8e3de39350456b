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
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
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
#include "bench/rpc_bench_release.h"
#include "bench/rpc_bench_stream.h"
#include "bench/rpc_bench_util.h"
#include "daemon/config.h"
#include "daemon/library_log.h"
#include "daemon/server.h"
#include "deltad/v1/memory_manager.grpc.pb.h"
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

namespace {

// A connection of its own, as a separate process, or session, has.
std::shared_ptr<grpc::Channel> NewChannel(const deltad::v1::DaemonConfig& c) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetMaxSendMessageSize(static_cast<int>(c.limits().max_message_bytes()));
  return grpc::CreateCustomChannel("unix:" + c.socket_path(),
                                   grpc::InsecureChannelCredentials(), args);
}

}  // namespace

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
    proc.channel = NewChannel(config);
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
    s.channel = NewChannel(config);
    s.stub = v1::MemoryManager::NewStub(s.channel);
    s.stream = std::make_unique<Stream>(*s.stub, s.token);
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
        "Unix socket for its unary calls and one session per GPU, each "
        "session's stream on a channel of its own as the client library "
        "opens it, so "
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
