// The daemon's configuration file: parsed, completed with defaults and
// validated as deltad does at start. Defaults must be stable (applying them
// twice changes nothing) and valid on their own, and whatever parses must
// print back to text that parses to the same configuration.
#include <string>
#include <utility>
#include <vector>

#include "daemon/config.h"
#include "deltad/v1/daemon_config.pb.h"
#include "fuzz/fuzz_target.h"
#include "google/protobuf/text_format.h"
#include "google/protobuf/util/field_comparator.h"
#include "google/protobuf/util/message_differencer.h"

namespace deltad::fuzz {

std::vector<std::pair<std::string, std::string>> Seeds() {
  return {
      {"seed_every_field",
       "backend: \"sim\"\n"
       "socket_path: \"/run/deltad/deltad.sock\"\n"
       "socket_mode: 0660\n"
       "tcp_address: \"127.0.0.1:7070\"\n"
       "metrics_address: \"[::1]:9464\"\n"
       "gpu_share: 0.9\n"
       "min_session_bytes: 1073741824\n"
       "host_pool_bytes: 68719476736\n"
       "host_slab_bytes: 268435456\n"
       "default_host_quota_bytes: 8589934592\n"
       "heuristic: \"delta_cost\"\n"
       "sampled_search: true\n"
       "high_watermark: 0.75\n"
       "low_watermark: 0.65\n"
       "cuda { chunk_bytes: 0 measure_bandwidth: true }\n"
       "sim {\n"
       "  gpus: 8\n"
       "  memory_bytes: 85899345920\n"
       "  chunk_bytes: 2097152\n"
       "  d2h_bytes_per_second: 25000000000\n"
       "  h2d_bytes_per_second: 25e9\n"
       "}\n"
       "limits {\n"
       "  max_message_bytes: 4194304\n"
       "  max_batch_events: 65536\n"
       "  max_tensors_per_session: 4194304\n"
       "  max_sessions_per_gpu: 64\n"
       "}\n"},
      {"seed_empty", ""},
      {"seed_comments", "# nothing but a comment\n\n"},
      {"seed_invalid_values",
       "gpu_share: 1.5\nsocket_mode: 01777\nheuristic: \"nope\"\n"
       "sim { gpus: 0 chunk_bytes: 100 }\nhigh_watermark: 0.1\n"},
      {"seed_syntax_error", "backend: sim\nlimits { max_batch_events: -1 \n"},
  };
}

}  // namespace deltad::fuzz

namespace {

// A NaN field (gpu_share: nan) prints as "nan" and parses back as NaN,
// which is the same configuration though it compares unequal.
bool Same(const deltad::v1::DaemonConfig& a,
          const deltad::v1::DaemonConfig& b) {
  google::protobuf::util::DefaultFieldComparator comparator;
  comparator.set_treat_nan_as_equal(true);
  google::protobuf::util::MessageDifferencer differencer;
  differencer.set_field_comparator(&comparator);
  return differencer.Compare(a, b);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using deltad::daemon::ParseConfig;
  using deltad::daemon::ValidateConfig;
  using deltad::daemon::WithDefaults;
  static const bool defaults_valid =
      ValidateConfig(WithDefaults(deltad::v1::DaemonConfig())).ok();
  DELTAD_FUZZ_CHECK(defaults_valid);
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto config = ParseConfig(text, "fuzz.conf");
  if (!config.ok()) return 0;
  std::string printed;
  DELTAD_FUZZ_CHECK(
      google::protobuf::TextFormat::PrintToString(*config, &printed));
  auto again = ParseConfig(printed, "printed.conf");
  DELTAD_FUZZ_CHECK(again.ok());
  DELTAD_FUZZ_CHECK(Same(*config, *again));
  const deltad::v1::DaemonConfig full = WithDefaults(*config);
  DELTAD_FUZZ_CHECK(Same(WithDefaults(full), full));
  (void)ValidateConfig(full);
  return 0;
}
