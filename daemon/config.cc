#include "daemon/config.h"

#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "daemon/request_limits.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"
#include "policies/filter.h"
#include "policies/heuristic.h"
#include "policies/watermarks.h"

namespace deltad::daemon {

namespace {

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kGiB = int64_t{1} << 30;
constexpr int64_t kPage = 4096;

class Collector : public google::protobuf::io::ErrorCollector {
 public:
  explicit Collector(absl::string_view source) : source_(source) {}
  void AddError(int line, google::protobuf::io::ColumnNumber column,
                const std::string& message) override {
    // The parser counts from zero; editors count from one.
    errors_.push_back(
        absl::StrCat(source_, ":", line + 1, ":", column + 1, ": ", message));
  }
  const std::vector<std::string>& errors() const { return errors_; }

 private:
  std::string source_;
  std::vector<std::string> errors_;
};

// host:port with a port in 0..65535 (0: any free port, for tests); the host
// may be a bracketed IPv6.
bool IsHostPort(absl::string_view address) {
  const auto colon = address.rfind(':');
  if (colon == absl::string_view::npos || colon == 0) return false;
  int port;
  return absl::SimpleAtoi(address.substr(colon + 1), &port) && port >= 0 &&
         port <= 65535;
}

absl::Status Invalid(absl::string_view field, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("config: ", field, " ", why));
}

// The limits whose defaults request_limits.h holds.
v1::LimitsConfig DefaultRequestLimits() {
  const RequestLimits d;
  v1::LimitsConfig l;
  l.set_max_label_bytes(d.max_label_bytes);
  l.set_max_status_sessions(d.max_status_sessions);
  l.set_max_queued_order_bytes(d.max_queued_order_bytes);
  l.set_max_sessions_per_uid(d.max_sessions_per_uid);
  l.set_max_side_connections_per_uid(d.max_side_connections_per_uid);
  l.set_max_grpc_connections_per_uid(d.max_grpc_connections_per_uid);
  l.set_grpc_memory_bytes(d.grpc_memory_bytes);
  l.set_grpc_max_threads(d.grpc_max_threads);
  l.set_max_concurrent_streams(d.max_concurrent_streams);
  l.set_settings_ack_ms(d.settings_ack_ms);
  l.set_min_ping_interval_ms(d.min_ping_interval_ms);
  l.set_max_ping_strikes(d.max_ping_strikes);
  l.set_keepalive_time_ms(d.keepalive_time_ms);
  l.set_keepalive_timeout_ms(d.keepalive_timeout_ms);
  l.set_malloc_arenas(d.malloc_arenas);
  return l;
}

}  // namespace

absl::StatusOr<v1::DaemonConfig> ParseConfig(absl::string_view text,
                                             absl::string_view source) {
  v1::DaemonConfig config;
  Collector errors(source);
  google::protobuf::TextFormat::Parser parser;
  parser.RecordErrorsTo(&errors);
  if (!parser.ParseFromString(std::string(text), &config)) {
    return absl::InvalidArgumentError(
        errors.errors().empty()
            ? absl::StrCat(source, ": not a valid configuration")
            : absl::StrJoin(errors.errors(), "\n"));
  }
  return config;
}

absl::StatusOr<v1::DaemonConfig> LoadConfigFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat("cannot read configuration file ", path));
  }
  std::stringstream text;
  text << in.rdbuf();
  return ParseConfig(text.str(), path);
}

v1::DaemonConfig WithDefaults(const v1::DaemonConfig& in) {
  v1::DaemonConfig c = in;
  if (!c.has_socket_path()) c.set_socket_path("/run/deltad/deltad.sock");
  if (!c.has_socket_mode()) c.set_socket_mode(0660);
  if (!c.has_tcp_address()) c.set_tcp_address("");
  if (!c.has_metrics_address()) c.set_metrics_address("127.0.0.1:9464");
  if (!c.has_backend()) c.set_backend("auto");
  v1::SimBackendConfig* sim = c.mutable_sim();
  if (!sim->has_gpus()) sim->set_gpus(8);
  if (!sim->has_memory_bytes()) sim->set_memory_bytes(80 * kGiB);
  if (!sim->has_chunk_bytes()) sim->set_chunk_bytes(2 * kMiB);
  if (!sim->has_d2h_bytes_per_second()) sim->set_d2h_bytes_per_second(25e9);
  if (!sim->has_h2d_bytes_per_second()) sim->set_h2d_bytes_per_second(25e9);
  v1::CudaBackendConfig* cuda = c.mutable_cuda();
  if (!cuda->has_chunk_bytes()) cuda->set_chunk_bytes(0);
  if (!cuda->has_measure_bandwidth()) cuda->set_measure_bandwidth(true);
  if (!c.has_gpu_share()) c.set_gpu_share(0.9);
  if (!c.has_min_session_bytes()) c.set_min_session_bytes(kGiB);
  if (!c.has_host_pool_bytes()) c.set_host_pool_bytes(64 * kGiB);
  if (!c.has_host_slab_bytes()) c.set_host_slab_bytes(256 * kMiB);
  if (!c.has_default_host_quota_bytes()) {
    c.set_default_host_quota_bytes(8 * kGiB);
  }
  if (!c.has_heuristic()) c.set_heuristic("delta_cost");
  if (!c.has_sampled_search()) c.set_sampled_search(true);
  if (!c.has_exact_search_below()) {
    c.set_exact_search_below(policy::kDefaultExactBelow);
  }
  if (!c.has_prefetch_replay_window()) c.set_prefetch_replay_window(0.25);
  if (!c.has_high_watermark()) {
    c.set_high_watermark(policy::Watermarks::kDefaultHigh);
  }
  if (!c.has_low_watermark())
    c.set_low_watermark(policy::Watermarks::kDefaultLow);
  v1::LimitsConfig* limits = c.mutable_limits();
  if (!limits->has_max_message_bytes()) {
    limits->set_max_message_bytes(RequestLimits().max_message_bytes);
  }
  if (!limits->has_max_batch_events()) limits->set_max_batch_events(65536);
  if (!limits->has_max_tensors_per_session()) {
    limits->set_max_tensors_per_session(int64_t{4} << 20);
  }
  if (!limits->has_max_sessions_per_gpu()) limits->set_max_sessions_per_gpu(64);
  if (!limits->has_max_recorded_accesses()) {
    limits->set_max_recorded_accesses(65536);
  }
  if (!limits->has_max_host_quota_bytes()) {
    limits->set_max_host_quota_bytes(64 * kGiB);
  }
  v1::LeaseConfig* lease = c.mutable_lease();
  if (!lease->has_lease_ms()) lease->set_lease_ms(5000);
  if (!lease->has_end_unresponsive_after_ms()) {
    lease->set_end_unresponsive_after_ms(0);
  }
  // The file's fields over request_limits.h's defaults.
  v1::LimitsConfig merged = DefaultRequestLimits();
  merged.MergeFrom(*limits);
  *limits = std::move(merged);
  return c;
}

absl::Status ValidateConfig(const v1::DaemonConfig& c) {
  if (c.socket_path().empty() || c.socket_path()[0] != '/') {
    return Invalid(
        "socket_path",
        absl::StrCat("must be an absolute path, got '", c.socket_path(), "'"));
  }
  if (c.socket_mode() > 0777) {
    return Invalid(
        "socket_mode",
        absl::StrFormat("must be a file mode (at most 0777), got 0%o",
                        c.socket_mode()));
  }
  if (!c.tcp_address().empty() && !IsHostPort(c.tcp_address())) {
    return Invalid("tcp_address", absl::StrCat("must be host:port, got '",
                                               c.tcp_address(), "'"));
  }
  if (!IsHostPort(c.metrics_address())) {
    return Invalid("metrics_address", absl::StrCat("must be host:port, got '",
                                                   c.metrics_address(), "'"));
  }
  if (c.backend() != "auto" && c.backend() != "cuda" && c.backend() != "sim") {
    return Invalid("backend", absl::StrCat("must be auto, cuda or sim, got '",
                                           c.backend(), "'"));
  }
  const v1::SimBackendConfig& sim = c.sim();
  if (sim.gpus() < 1 || sim.gpus() > 64) {
    return Invalid("sim.gpus", absl::StrCat("must be 1..64, got ", sim.gpus()));
  }
  if (sim.memory_bytes() <= 0) {
    return Invalid("sim.memory_bytes", "must be positive");
  }
  if (sim.chunk_bytes() <= 0 || sim.chunk_bytes() % kPage != 0) {
    return Invalid("sim.chunk_bytes",
                   absl::StrCat("must be a positive multiple of ", kPage,
                                " bytes, got ", sim.chunk_bytes()));
  }
  if (!(sim.d2h_bytes_per_second() > 0) || !(sim.h2d_bytes_per_second() > 0)) {
    return Invalid("sim bandwidths", "must be positive");
  }
  if (c.cuda().chunk_bytes() < 0 || c.cuda().chunk_bytes() > 64 * kGiB) {
    return Invalid("cuda.chunk_bytes",
                   absl::StrCat("must be 0 (the GPU's granularity) or a size "
                                "up to 64 GiB, got ",
                                c.cuda().chunk_bytes()));
  }
  if (!(c.gpu_share() > 0) || c.gpu_share() > 1) {
    return Invalid("gpu_share",
                   absl::StrCat("must be in (0, 1], got ", c.gpu_share()));
  }
  if (c.min_session_bytes() < 0) {
    return Invalid("min_session_bytes", "must not be negative");
  }
  if (c.host_slab_bytes() <= 0 || c.host_slab_bytes() % kPage != 0) {
    return Invalid("host_slab_bytes",
                   absl::StrCat("must be a positive multiple of ", kPage,
                                " bytes, got ", c.host_slab_bytes()));
  }
  if (c.host_pool_bytes() < c.host_slab_bytes()) {
    return Invalid(
        "host_pool_bytes",
        absl::StrCat("must hold at least one slab (", c.host_slab_bytes(),
                     " bytes), got ", c.host_pool_bytes()));
  }
  if (c.default_host_quota_bytes() < 0) {
    return Invalid("default_host_quota_bytes", "must not be negative");
  }
  if (auto h = policy::ParseHeuristic(c.heuristic()); !h.ok()) {
    return Invalid("heuristic", h.status().message());
  }
  if (c.exact_search_below() < 0) {
    return Invalid(
        "exact_search_below",
        absl::StrCat("must not be negative, got ", c.exact_search_below()));
  }
  if (!(c.prefetch_replay_window() >= 0) || c.prefetch_replay_window() > 1) {
    return Invalid(
        "prefetch_replay_window",
        absl::StrCat("must be in [0, 1], got ", c.prefetch_replay_window()));
  }
  if (c.limits().max_recorded_accesses() < 0) {
    return Invalid("limits.max_recorded_accesses",
                   absl::StrCat("must not be negative, got ",
                                c.limits().max_recorded_accesses()));
  }
  if (auto w =
          policy::Watermarks::Create(c.high_watermark(), c.low_watermark());
      !w.ok()) {
    return Invalid("high_watermark/low_watermark", w.status().message());
  }
  const v1::LimitsConfig& l = c.limits();
  const std::pair<const char*, int64_t> positive[] = {
      {"limits.max_message_bytes", l.max_message_bytes()},
      {"limits.max_batch_events", l.max_batch_events()},
      {"limits.max_tensors_per_session", l.max_tensors_per_session()},
      {"limits.max_sessions_per_gpu", l.max_sessions_per_gpu()},
      {"limits.max_host_quota_bytes", l.max_host_quota_bytes()},
      {"limits.max_label_bytes", l.max_label_bytes()},
      {"limits.max_status_sessions", l.max_status_sessions()},
      {"limits.max_queued_order_bytes", l.max_queued_order_bytes()},
      {"limits.max_sessions_per_uid", l.max_sessions_per_uid()},
      {"limits.max_side_connections_per_uid", l.max_side_connections_per_uid()},
      {"limits.max_grpc_connections_per_uid", l.max_grpc_connections_per_uid()},
      {"limits.grpc_memory_bytes", l.grpc_memory_bytes()},
      {"limits.grpc_max_threads", l.grpc_max_threads()},
      {"limits.max_concurrent_streams", l.max_concurrent_streams()},
      {"limits.settings_ack_ms", l.settings_ack_ms()},
      {"limits.min_ping_interval_ms", l.min_ping_interval_ms()},
      {"limits.keepalive_time_ms", l.keepalive_time_ms()},
      {"limits.keepalive_timeout_ms", l.keepalive_timeout_ms()},
  };
  for (const auto& [field, value] : positive) {
    if (value <= 0) {
      return Invalid(field, absl::StrCat("must be positive, got ", value));
    }
  }
  if (l.max_ping_strikes() < 0) {
    return Invalid("limits.max_ping_strikes",
                   absl::StrCat("must be 0 (no GOAWAY) or positive, got ",
                                l.max_ping_strikes()));
  }
  if (l.malloc_arenas() < 0) {
    return Invalid("limits.malloc_arenas",
                   absl::StrCat("must be 0 (glibc's default) or positive, got ",
                                l.malloc_arenas()));
  }
  // Clients heartbeat every quarter lease, but at most every 250 ms: a
  // shorter lease would expire processes that answer. Over an hour, a
  // frozen process would hold its memory unseen for that long.
  if (c.lease().lease_ms() < 1000 || c.lease().lease_ms() > 3600000) {
    return Invalid("lease.lease_ms", absl::StrCat("must be 1000..3600000, got ",
                                                  c.lease().lease_ms()));
  }
  if (c.lease().end_unresponsive_after_ms() < 0) {
    return Invalid("lease.end_unresponsive_after_ms",
                   absl::StrCat("must be 0 (never) or positive, got ",
                                c.lease().end_unresponsive_after_ms()));
  }
  // Otherwise every session that takes the default would be refused.
  if (c.default_host_quota_bytes() > l.max_host_quota_bytes()) {
    return Invalid("default_host_quota_bytes",
                   absl::StrCat("must not exceed limits.max_host_quota_bytes (",
                                l.max_host_quota_bytes(), "), got ",
                                c.default_host_quota_bytes()));
  }
  return absl::OkStatus();
}

RequestLimits RequestLimitsFrom(const v1::DaemonConfig& config) {
  const v1::LimitsConfig& l = config.limits();
  RequestLimits r;
  r.max_label_bytes = l.max_label_bytes();
  r.max_status_sessions = l.max_status_sessions();
  r.max_queued_order_bytes = l.max_queued_order_bytes();
  r.max_message_bytes = l.max_message_bytes();
  return r;
}

}  // namespace deltad::daemon
