#include "client/grpc_daemon_link.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/monotonic_clock.h"
#include "common/protocol_version.h"
#include "common/side_protocol.h"

namespace deltad::client {

namespace side = common::side;

namespace {

std::chrono::system_clock::time_point Deadline(int ms) {
  return std::chrono::system_clock::now() + std::chrono::milliseconds(ms);
}

absl::Status FromGrpc(const grpc::Status& s, absl::string_view what) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat(what, ": ", s.error_message()));
}

// Bounds every blocking read on the side socket, so that a daemon that
// accepted but hangs cannot hang the training process.
void SetReceiveTimeout(int fd, int ms) {
  struct timeval tv;
  tv.tv_sec = ms / 1000;
  tv.tv_usec = (ms % 1000) * 1000;
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
}

// The GPU to open the session on: the one named, or the daemon's GPU with
// the device's UUID, or GPU 0 when the device has none (simulated).
absl::StatusOr<int> ResolveGpu(v1::MemoryManager::Stub& stub,
                               const LinkOptions& options) {
  if (options.gpu >= 0 || options.gpu_uuid.empty()) {
    return std::max(options.gpu, 0);
  }
  grpc::ClientContext context;
  context.set_deadline(Deadline(options.rpc_timeout_ms));
  v1::NodeStatusResponse status;
  if (grpc::Status s = stub.NodeStatus(&context, {}, &status); !s.ok()) {
    return FromGrpc(s, "NodeStatus");
  }
  for (const v1::GpuStatus& g : status.gpus()) {
    if (g.uuid() == options.gpu_uuid) return g.gpu();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "deltad manages no GPU ", options.gpu_uuid,
      " (this process's device); set the client's gpu to choose one"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<DaemonLink>> DaemonLink::Open(
    const LinkOptions& options, OrdersFn on_orders, LostFn on_lost) {
  return GrpcDaemonLink::Open(options, std::move(on_orders),
                              std::move(on_lost));
}

absl::StatusOr<std::unique_ptr<DaemonLink>> GrpcDaemonLink::Open(
    const LinkOptions& options, OrdersFn on_orders, LostFn on_lost) {
  std::unique_ptr<GrpcDaemonLink> link(new GrpcDaemonLink());
  link->options_ = options;
  link->on_orders_ = std::move(on_orders);
  link->on_lost_ = std::move(on_lost);

  auto side_fd = common::ConnectUnix(side::SideSocketPath(options.socket_path));
  if (!side_fd.ok()) return side_fd.status();
  link->side_ = std::move(*side_fd);
  SetReceiveTimeout(link->side_.get(), options.rpc_timeout_ms);
  auto hello = common::RecvFds(link->side_.get(), 0, side::kMaxMessageBytes);
  if (!hello.ok()) return hello.status();
  if (hello->tag != side::kPeerToken) {
    return absl::UnavailableError(
        absl::StrCat("deltad refused the connection: ", hello->payload));
  }

  grpc::ChannelArguments args;
  // The stream lives as long as the training; keepalives notice a daemon
  // that vanished without closing the socket.
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  // A connection of its own: gRPC would otherwise share one among a
  // process's sessions (one per GPU), whose Session streams then fill the
  // calls the daemon lets one connection carry (limits.
  // max_concurrent_streams), and a Release waits for another session's
  // stream to end.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  link->channel_ = grpc::CreateCustomChannel(
      "unix:" + options.socket_path, grpc::InsecureChannelCredentials(), args);
  link->stub_ = v1::MemoryManager::NewStub(link->channel_);

  auto gpu = ResolveGpu(*link->stub_, options);
  if (!gpu.ok()) return gpu.status();
  v1::OpenSessionRequest request;
  request.set_gpu(*gpu);
  link->gpu_ = *gpu;
  request.set_requested_budget_bytes(options.requested_budget_bytes);
  request.set_requested_host_bytes(options.requested_host_bytes);
  request.set_priority(options.priority);
  request.set_label(options.label);
  request.set_peer_token(hello->payload);
  request.set_min_budget_bytes(options.min_budget_bytes);
  request.set_client_version(DELTAD_VERSION);
  request.set_protocol_version(common::kProtocolVersion);
  grpc::ClientContext context;
  context.set_deadline(Deadline(options.rpc_timeout_ms));
  if (grpc::Status s =
          link->stub_->OpenSession(&context, request, &link->session_);
      !s.ok()) {
    return FromGrpc(s, "OpenSession");
  }
  if (const std::string mismatch = common::DaemonProtocolMismatch(
          DELTAD_VERSION, link->session_.daemon_version(),
          link->session_.protocol_version());
      !mismatch.empty()) {
    // The daemon opened a session it cannot serve this library in: close
    // it rather than misread each other.
    grpc::ClientContext close_context;
    close_context.set_deadline(Deadline(options.rpc_timeout_ms));
    v1::CloseSessionRequest close;
    close.set_session_token(link->session_.session_token());
    v1::CloseSessionResponse closed;
    (void)link->stub_->CloseSession(&close_context, close, &closed);
    return absl::FailedPreconditionError(mismatch);
  }

  // The slabs' descriptors come over the side socket.
  if (absl::Status s = common::SendFds(link->side_.get(), side::kSlabsWanted,
                                       {}, link->session_.session_token());
      !s.ok()) {
    return s;
  }
  auto slabs =
      side::ReceiveGrants(link->side_.get(), side::kSlab, side::kSlabsDone);
  if (!slabs.ok()) return slabs.status();
  link->slabs_ = std::move(*slabs);
  // The side socket stays open as the process's lifeline; chunk requests
  // reuse it, each bounded by the receive timeout set above.

  link->stream_ = link->stub_->Session(&link->stream_context_);
  v1::SessionMessage first;
  first.set_session_token(link->session_.session_token());
  // Heartbeat() runs on the session keeper's thread, never the training
  // one, so a process is silent only when it is stopped or stuck.
  first.set_heartbeats(true);
  link->last_write_ns_.store(common::MonotonicNs());
  if (!link->stream_->Write(first)) {
    return absl::UnavailableError("the session stream closed at once");
  }
  link->alive_.store(true);
  link->reader_ = std::thread([l = link.get()] { l->ReadOrders(); });
  return link;
}

absl::StatusOr<std::vector<side::Grant>> GrpcDaemonLink::FetchChunks(
    int64_t target_bytes) {
  std::lock_guard<std::mutex> lock(side_mu_);
  if (absl::Status s = common::SendFds(
          side_.get(), side::kChunksWanted, {},
          side::EncodeChunksWanted({session_.session_token(), target_bytes}));
      !s.ok()) {
    return absl::UnavailableError(
        absl::StrCat("asking deltad for chunks: ", s.message()));
  }
  return side::ReceiveGrants(side_.get(), side::kChunk, side::kChunksDone);
}

absl::Status GrpcDaemonLink::ReturnChunks(
    const std::vector<uint64_t>& chunk_ids) {
  const std::string& token = session_.session_token();
  const size_t per_message = side::MaxReturnedPerMessage(token.size());
  if (per_message == 0) {
    // Tokens are the daemon's and short; one this long fits no id at all.
    return absl::InternalError("the session token leaves no room for ids");
  }
  std::lock_guard<std::mutex> lock(side_mu_);
  for (size_t at = 0; at < chunk_ids.size(); at += per_message) {
    side::ChunksReturned returned{token, {}};
    const size_t end = std::min(chunk_ids.size(), at + per_message);
    returned.chunk_ids.assign(chunk_ids.begin() + at, chunk_ids.begin() + end);
    if (absl::Status s = common::SendFds(side_.get(), side::kChunksReturned, {},
                                         side::EncodeChunksReturned(returned));
        !s.ok()) {
      return absl::UnavailableError(
          absl::StrCat("returning chunks to deltad: ", s.message()));
    }
    auto answer = common::RecvFds(side_.get(), 0, side::kMaxMessageBytes);
    if (!answer.ok()) {
      return absl::UnavailableError(
          absl::StrCat("waiting for deltad to take chunks back: ",
                       answer.status().message()));
    }
    if (answer->tag != side::kChunksDone) {
      return absl::InternalError(
          absl::StrCat("deltad refused returned chunks: ", answer->payload));
    }
  }
  return absl::OkStatus();
}

GrpcDaemonLink::~GrpcDaemonLink() { Close(); }

std::vector<side::Grant> GrpcDaemonLink::TakeSlabs() {
  std::vector<side::Grant> out;
  out.swap(slabs_);
  return out;
}

void GrpcDaemonLink::ReadOrders() {
  v1::Orders orders;
  while (stream_->Read(&orders)) on_orders_(this, orders);
  const grpc::Status status = stream_->Finish();
  alive_.store(false);
  {
    std::lock_guard<std::mutex> lock(reader_mu_);
    reader_done_ = true;
  }
  reader_cv_.notify_all();
  if (closing_.load()) return;
  std::string why;
  {
    std::lock_guard<std::mutex> lock(cancel_mu_);
    why = cancelled_for_;
  }
  if (why.empty()) {
    why = status.ok() ? std::string("the session stream ended")
                      : absl::StrCat("the session stream ended: ",
                                     status.error_message());
  }
  on_lost_(this, why);
}

absl::Status GrpcDaemonLink::Send(const v1::EventBatch& batch) {
  if (!alive_.load()) return absl::UnavailableError("no daemon connection");
  v1::SessionMessage message;
  *message.mutable_batch() = batch;
  std::lock_guard<std::mutex> lock(write_mu_);
  write_since_ns_.store(common::MonotonicNs());
  const bool written = stream_->Write(message);
  write_since_ns_.store(0);
  last_write_ns_.store(common::MonotonicNs());
  if (!written) return absl::UnavailableError("the session stream is closed");
  return absl::OkStatus();
}

void GrpcDaemonLink::Heartbeat(int64_t unlisted_chunk_bytes) {
  if (!alive_.load()) return;
  const int64_t lease_ms = session_.lease_ms();
  const bool due =
      lease_ms > 0 &&
      common::MonotonicNs() - last_write_ns_.load() >= lease_ms * 1000000 / 4;
  const bool changed =
      unlisted_chunk_bytes >= 0 && unlisted_chunk_bytes != unlisted_sent_;
  if (!due && !changed) return;
  // A write under way says as much; one stuck is WriteStalled's to find.
  std::unique_lock<std::mutex> lock(write_mu_, std::try_to_lock);
  if (!lock.owns_lock()) return;
  v1::SessionMessage message;
  if (changed) message.set_unlisted_chunk_bytes(unlisted_chunk_bytes);
  write_since_ns_.store(common::MonotonicNs());
  const bool written = stream_->Write(message);
  write_since_ns_.store(0);
  last_write_ns_.store(common::MonotonicNs());
  if (written && changed) unlisted_sent_ = unlisted_chunk_bytes;
}

bool GrpcDaemonLink::WriteStalled(int64_t resumed_ns) const {
  const int64_t since = write_since_ns_.load();
  return since != 0 && common::MonotonicNs() - std::max(since, resumed_ns) >
                           int64_t{options_.rpc_timeout_ms} * 1000000;
}

void GrpcDaemonLink::Cancel(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(cancel_mu_);
    if (cancelled_for_.empty()) cancelled_for_ = why;
  }
  stream_context_.TryCancel();
}

absl::StatusOr<v1::ReleaseResponse> GrpcDaemonLink::Release(
    int64_t bytes, const v1::EventBatch& batch, uint64_t stream_batches_sent) {
  if (!alive_.load()) return absl::UnavailableError("no daemon connection");
  v1::ReleaseRequest request;
  request.set_session_token(session_.session_token());
  request.set_bytes(bytes);
  *request.mutable_batch() = batch;
  request.set_stream_batches_sent(stream_batches_sent);
  std::lock_guard<std::mutex> lock(release_mu_);
  const bool retries = session_.release_retries();
  if (retries) request.set_release_seq(++release_seq_);
  auto give_up = std::chrono::steady_clock::now() +
                 std::chrono::milliseconds(
                     retries ? std::max(0, options_.release_retry_ms) : 0);
  while (true) {
    v1::ReleaseResponse response;
    grpc::ClientContext context;
    context.set_deadline(Deadline(options_.rpc_timeout_ms));
    const auto tried = std::chrono::steady_clock::now();
    grpc::Status s = stub_->Release(&context, request, &response);
    if (s.ok()) return response;
    // A try that took far past its deadline: this process was stopped
    // meanwhile, and that time was not the daemon's to answer in.
    const auto took = std::chrono::steady_clock::now() - tried;
    const auto deadline = std::chrono::milliseconds(options_.rpc_timeout_ms);
    if (took > 2 * deadline) give_up += took - deadline;
    // Late, not lost: the same call again, which the daemon applies once.
    if (s.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED ||
        std::chrono::steady_clock::now() >= give_up || !alive_.load()) {
      return FromGrpc(s, "Release");
    }
    sent_again_.fetch_add(1);
  }
}

bool GrpcDaemonLink::SideClosedByDaemon() const {
  if (!side_.valid()) return true;
  pollfd p{side_.get(), POLLRDHUP, 0};
  if (::poll(&p, 1, 0) < 0) return false;
  return (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

void GrpcDaemonLink::Close() {
  std::lock_guard<std::mutex> close_lock(close_mu_);
  if (closed_) return;
  closed_ = true;
  closing_.store(true);
  // Ending the stream ends the session: the daemon applies every batch
  // written before it, then reclaims. A CloseSession call would race those
  // batches (they travel apart) and get them refused. A daemon that does
  // not end the stream in time is cut off.
  if (stream_ != nullptr) {
    {
      std::lock_guard<std::mutex> lock(write_mu_);
      stream_->WritesDone();
    }
    bool ended = false;
    if (reader_.joinable()) {
      std::unique_lock<std::mutex> lock(reader_mu_);
      ended = reader_cv_.wait_for(
          lock, std::chrono::milliseconds(options_.rpc_timeout_ms),
          [&] { return reader_done_; });
    }
    if (!ended) stream_context_.TryCancel();
  }
  if (reader_.joinable()) reader_.join();
  side_.reset();
  alive_.store(false);
}

}  // namespace deltad::client
