// The C API over client::Client; see deltad_client.h.
#include <memory>
#include <string>
#include <utility>

#include "client/capi_client.h"
#include "client/client.h"
#include "client/deltad_client.h"
#include "client/sim_chunk_device.h"
#include "client/sim_device.h"

namespace {

thread_local std::string last_error;

}  // namespace

namespace deltad::client::capi {

int Report(const absl::Status& status) {
  if (status.ok()) return 0;
  last_error = std::string(status.message());
  return static_cast<int>(status.code());
}

}  // namespace deltad::client::capi

namespace {

using deltad::client::capi::Report;

int InvalidArgument(const char* what) {
  return Report(absl::InvalidArgumentError(what));
}

}  // namespace

extern "C" {

void deltad_client_options_init(deltad_client_options* o) {
  if (o == nullptr) return;
  // The C++ API's defaults, so the two never drift apart; static, so the
  // strings outlive the call.
  static const deltad::client::ClientOptions kDefaults;
  *o = deltad_client_options{};
  o->socket_path = kDefaults.link.socket_path.c_str();
  o->gpu = kDefaults.link.gpu;
  o->priority = kDefaults.link.priority;
  o->use_daemon = kDefaults.use_daemon ? 1 : 0;
  o->fallback_budget_bytes = kDefaults.fallback_budget_bytes;
  o->fallback_host_bytes = kDefaults.fallback_host_bytes;
  o->device = "sim";
  o->sim_memory_bytes = int64_t{80} << 30;
  o->sim_d2h_bytes_per_second = 25e9;
  o->sim_h2d_bytes_per_second = 25e9;
  o->cuda_device = 0;
  o->admission_wait_ms = kDefaults.admission_wait_ms;
  o->require_session = kDefaults.require_session ? 1 : 0;
}

int deltad_client_connect(const deltad_client_options* o,
                          deltad_client** client) {
  if (o == nullptr || client == nullptr) {
    return InvalidArgument("options and client must not be NULL");
  }
  const std::string device_name = o->device == nullptr ? "sim" : o->device;
  std::unique_ptr<deltad::client::Device> device;
  deltad_client made;
  if (device_name == "sim") {
    device = std::make_unique<deltad::client::SimDevice>(
        o->sim_memory_bytes, o->sim_d2h_bytes_per_second,
        o->sim_h2d_bytes_per_second);
  } else if (device_name == "sim-chunks") {
    auto sim = deltad::client::SimChunkDevice::Create(
        o->sim_memory_bytes, o->sim_d2h_bytes_per_second,
        o->sim_h2d_bytes_per_second);
    if (!sim.ok()) return Report(sim.status());
    device = std::move(*sim);
  } else if (device_name == "cuda") {
#ifdef DELTAD_HAVE_CUDA
    auto cuda = deltad::client::CudaDevice::Create(o->cuda_device);
    if (!cuda.ok()) return Report(cuda.status());
    made.cuda = cuda->get();
    made.cuda_ordinal = o->cuda_device;
    device = std::move(*cuda);
#else
    return Report(absl::UnimplementedError(
        "this libdeltad_client was built without the CUDA toolkit: only the "
        "\"sim\" device"));
#endif
  } else {
    return Report(
        absl::InvalidArgumentError("unknown device \"" + device_name +
                                   "\" (\"sim\", \"sim-chunks\" or \"cuda\")"));
  }
  deltad::client::ClientOptions options;
  if (o->socket_path != nullptr) options.link.socket_path = o->socket_path;
  options.link.gpu = o->gpu;
  options.link.requested_budget_bytes = o->requested_budget_bytes;
  options.link.requested_host_bytes = o->requested_host_bytes;
  options.link.priority = o->priority;
  if (o->label != nullptr) options.link.label = o->label;
  options.use_daemon = o->use_daemon != 0;
  options.fallback_budget_bytes = o->fallback_budget_bytes;
  options.fallback_host_bytes = o->fallback_host_bytes;
  options.link.min_budget_bytes = o->min_budget_bytes;
  options.admission_wait_ms = o->admission_wait_ms;
  options.require_session = o->require_session != 0;
  auto impl =
      deltad::client::Client::Connect(std::move(options), std::move(device));
  if (!impl.ok()) return Report(impl.status());
  made.impl = std::move(*impl);
  *client = new deltad_client(std::move(made));
  return 0;
}

void deltad_iteration_done(deltad_client* client) {
  if (client != nullptr) client->impl->IterationDone();
}

void deltad_client_close(deltad_client* client) {
  if (client == nullptr) return;
  deltad::client::capi::ForgetAllocatorClient(client);
  delete client;
}

int deltad_track(deltad_client* client, const deltad_tensor_info* info,
                 deltad_recompute_fn recompute, void* user_data, void** out) {
  if (client == nullptr || info == nullptr || out == nullptr ||
      (info->num_parents > 0 && info->parents == nullptr)) {
    return InvalidArgument("client, info, out (and parents) must be set");
  }
  deltad::client::TensorInfo t;
  t.id = info->id;
  t.bytes = info->bytes;
  t.parents.assign(info->parents, info->parents + info->num_parents);
  t.compute_cost_ns = info->compute_cost_ns;
  t.evict_pinned = info->evict_pinned != 0;
  t.offload_pinned = info->offload_pinned != 0;
  t.uncomputable = info->uncomputable != 0;
  t.stable_key = info->stable_key;
  deltad::client::RecomputeFn fn;
  if (recompute != nullptr) {
    fn = [recompute, user_data](uint64_t id, void* dst) -> absl::Status {
      const int rc = recompute(user_data, id, dst);
      if (rc == 0) return absl::OkStatus();
      return absl::InternalError("the recompute callback returned " +
                                 std::to_string(rc));
    };
  }
  auto p = client->impl->Track(t, std::move(fn));
  if (!p.ok()) return Report(p.status());
  *out = *p;
  return 0;
}

int deltad_pin(deltad_client* client, uint64_t id, void** out) {
  if (client == nullptr || out == nullptr) {
    return InvalidArgument("client and out must not be NULL");
  }
  auto p = client->impl->Pin(id);
  if (!p.ok()) return Report(p.status());
  *out = *p;
  return 0;
}

void deltad_unpin(deltad_client* client, uint64_t id) {
  if (client != nullptr) client->impl->Unpin(id);
}

int deltad_free(deltad_client* client, uint64_t id) {
  if (client == nullptr) return InvalidArgument("client must not be NULL");
  return Report(client->impl->Free(id));
}

int deltad_stats(deltad_client* client, deltad_client_stats* stats) {
  if (client == nullptr || stats == nullptr) {
    return InvalidArgument("client and stats must not be NULL");
  }
  const deltad::client::ClientStats s = client->impl->Stats();
  stats->device_bytes = s.device_bytes;
  stats->peak_device_bytes = s.peak_device_bytes;
  stats->budget_bytes = s.budget_bytes;
  stats->host_bytes = s.host_bytes;
  stats->offloaded_bytes = s.offloaded_bytes;
  stats->reloaded_bytes = s.reloaded_bytes;
  stats->evictions = s.evictions;
  stats->recomputes = s.recomputes;
  stats->recompute_ns = s.recompute_ns;
  stats->stall_ns = s.stall_ns;
  stats->connected = s.connected ? 1 : 0;
  stats->prefetches = s.prefetches;
  return 0;
}

int deltad_session_stats(deltad_client* client,
                         deltad_client_session_stats* stats) {
  if (client == nullptr || stats == nullptr) {
    return InvalidArgument("client and stats must not be NULL");
  }
  const deltad::client::ClientStats s = client->impl->Stats();
  stats->connected = s.connected ? 1 : 0;
  stats->session_id = s.session_id;
  stats->reconnects = s.reconnects;
  stats->sessions_lost = s.sessions_lost;
  stats->attach_failures = s.attach_failures;
  return 0;
}

void deltad_prefetch(deltad_client* client, const uint64_t* ids, size_t n) {
  if (client == nullptr || ids == nullptr || n == 0) return;
  client->impl->Prefetch({ids, n});
}

int deltad_resident(deltad_client* client, uint64_t id) {
  return client != nullptr && client->impl->Resident(id) ? 1 : 0;
}

int deltad_set_compute_stream(deltad_client* client, void* stream) {
  if (client == nullptr) return InvalidArgument("client must not be NULL");
#ifdef DELTAD_HAVE_CUDA
  if (client->cuda != nullptr) {
    client->cuda->SetComputeStream(stream);
    return 0;
  }
#endif
  (void)stream;
  return Report(absl::FailedPreconditionError(
      "a compute stream is for the \"cuda\" device only"));
}

const char* deltad_last_error(void) { return last_error.c_str(); }

}  // extern "C"
