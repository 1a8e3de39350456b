// rpc_bench's clients: a Session stream as a client holds it, the simulated
// processes and their sessions, the batches they stream, and the ingest.
#ifndef DELTAD_BENCH_RPC_BENCH_STREAM_H_
#define DELTAD_BENCH_RPC_BENCH_STREAM_H_

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/rpc_bench_util.h"
#include "deltad/v1/memory_manager.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace deltad::bench {

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
  // Its own connection, as the client library opens one per session: a
  // connection carries limits.max_concurrent_streams calls at once.
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::MemoryManager::Stub> stub;
  std::unique_ptr<Stream> stream;
};

// A simulated training process: its own channel for its unary calls (so
// its own connection on the socket, as a real process has) and one session
// per GPU.
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
inline std::vector<int64_t> DrawSizes(int n, int64_t share,
                                      std::mt19937_64& rng) {
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
inline std::vector<v1::SessionMessage> CreationBatches(const Session& s,
                                                       int batch,
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
inline std::vector<v1::SessionMessage> EventBatches(
    const Session& s, int batch, int rounds, v1::TensorEvent::Kind kind) {
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

inline std::vector<v1::SessionMessage> AccessBatches(const Session& s,
                                                     int batch, int rounds) {
  return EventBatches(s, batch, rounds, v1::TensorEvent::ACCESSED);
}

// The end of training: every tensor FREED, newest first as a backward pass
// drops them, so each leaves the table at once (its children are gone).
inline std::vector<v1::SessionMessage> FreeBatches(const Session& s,
                                                   int batch) {
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
inline IngestResult Ingest(
    std::vector<Process>& processes,
    std::vector<std::vector<v1::SessionMessage>>& by_session,
    const std::vector<Session*>& order, int64_t entries, int* fences) {
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

inline v1::NodeStatusResponse Status(v1::MemoryManager::Stub& stub) {
  grpc::ClientContext context;
  v1::NodeStatusResponse status;
  const grpc::Status s = stub.NodeStatus(&context, {}, &status);
  if (!s.ok()) Die(absl::StrCat("NodeStatus: ", s.error_message()));
  return status;
}

}  // namespace deltad::bench

#endif  // DELTAD_BENCH_RPC_BENCH_STREAM_H_
