#include "daemon/config.h"

#include <cstdio>
#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace deltad::daemon {
namespace {

using ::testing::HasSubstr;

v1::DaemonConfig Parsed(const std::string& text) {
  auto c = ParseConfig(text, "test.conf");
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *c : v1::DaemonConfig{};
}

TEST(Config, AnEmptyFileGivesTheDocumentedDefaults) {
  const v1::DaemonConfig c = WithDefaults(Parsed(""));
  EXPECT_EQ(c.socket_path(), "/run/deltad/deltad.sock");
  EXPECT_EQ(c.socket_mode(), 0660u);
  EXPECT_EQ(c.tcp_address(), "");  // TCP off unless asked for
  EXPECT_EQ(c.metrics_address(), "127.0.0.1:9464");
  EXPECT_EQ(c.backend(), "auto");
  EXPECT_EQ(c.sim().gpus(), 8);
  EXPECT_EQ(c.sim().memory_bytes(), int64_t{80} << 30);
  EXPECT_EQ(c.heuristic(), "delta_cost");
  EXPECT_TRUE(c.sampled_search());
  EXPECT_EQ(c.exact_search_below(), 2048);
  EXPECT_DOUBLE_EQ(c.prefetch_replay_window(), 0.25);
  EXPECT_EQ(c.limits().max_recorded_accesses(), 65536);
  EXPECT_DOUBLE_EQ(c.high_watermark(), 0.75);
  EXPECT_EQ(c.limits().max_host_quota_bytes(), int64_t{64} << 30);
  EXPECT_EQ(c.limits().max_label_bytes(), RequestLimits{}.max_label_bytes);
  EXPECT_TRUE(ValidateConfig(c).ok()) << ValidateConfig(c);
}

TEST(Config, SetFieldsOverrideDefaultsAndZeroIsAValue) {
  const v1::DaemonConfig c = WithDefaults(Parsed(R"(
    # comments are allowed
    socket_path: "/tmp/d.sock"
    backend: "sim"
    sim { gpus: 2 memory_bytes: 1073741824 }
    min_session_bytes: 0
  )"));
  EXPECT_EQ(c.socket_path(), "/tmp/d.sock");
  EXPECT_EQ(c.sim().gpus(), 2);
  EXPECT_EQ(c.sim().chunk_bytes(), int64_t{2} << 20);  // default kept
  EXPECT_EQ(c.min_session_bytes(), 0);  // an explicit 0 is not "unset"
  EXPECT_TRUE(ValidateConfig(c).ok());
}

TEST(Config, SyntaxErrorsNameFileLineAndColumn) {
  auto c = ParseConfig("backend: \"sim\"\nsim { gpus: two }\n", "deltad.conf");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("deltad.conf:2:"));
}

TEST(Config, UnknownFieldsAreErrors) {
  auto c = ParseConfig("sokcet_path: \"/x\"\n", "deltad.conf");
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("sokcet_path"));
}

TEST(Config, EachBadValueIsRefusedNamingTheField) {
  const std::pair<const char*, const char*> cases[] = {
      {"socket_path: \"relative.sock\"", "socket_path"},
      {"socket_mode: 4095", "socket_mode"},
      {"tcp_address: \"nohost\"", "tcp_address"},
      {"metrics_address: \"127.0.0.1:99999\"", "metrics_address"},
      {"backend: \"tpu\"", "backend"},
      {"sim { gpus: 0 }", "sim.gpus"},
      {"sim { gpus: 65 }", "sim.gpus"},
      {"sim { chunk_bytes: 1000 }", "sim.chunk_bytes"},
      {"sim { d2h_bytes_per_second: 0 }", "bandwidths"},
      {"gpu_share: 1.5", "gpu_share"},
      {"gpu_share: 0", "gpu_share"},
      {"min_session_bytes: -1", "min_session_bytes"},
      {"host_slab_bytes: 100", "host_slab_bytes"},
      {"host_pool_bytes: 4096 host_slab_bytes: 8192", "host_pool_bytes"},
      {"heuristic: \"fifo\"", "heuristic"},
      {"exact_search_below: -1", "exact_search_below"},
      {"prefetch_replay_window: -0.1", "prefetch_replay_window"},
      {"prefetch_replay_window: 1.5", "prefetch_replay_window"},
      {"limits { max_recorded_accesses: -1 }", "limits.max_recorded_accesses"},
      {"high_watermark: 0.5 low_watermark: 0.6", "watermark"},
      {"limits { max_batch_events: 0 }", "limits"},
      {"limits { max_host_quota_bytes: 0 }", "limits"},
      {"limits { max_label_bytes: 0 }", "limits.max_label_bytes"},
      {"limits { max_status_sessions: 0 }", "limits.max_status_sessions"},
      {"limits { max_queued_order_bytes: -1 }",
       "limits.max_queued_order_bytes"},
      {"limits { max_sessions_per_uid: 0 }", "limits.max_sessions_per_uid"},
      {"limits { max_side_connections_per_uid: 0 }",
       "limits.max_side_connections_per_uid"},
      {"limits { grpc_max_threads: 0 }", "limits.grpc_max_threads"},
      {"limits { max_grpc_connections_per_uid: 0 }",
       "limits.max_grpc_connections_per_uid"},
      {"limits { malloc_arenas: -1 }", "limits.malloc_arenas"},
      {"limits { max_ping_strikes: -1 }", "limits.max_ping_strikes"},
      {"default_host_quota_bytes: 2048 limits { max_host_quota_bytes: 1024 }",
       "default_host_quota_bytes"},
  };
  for (const auto& [text, field] : cases) {
    const absl::Status s = ValidateConfig(WithDefaults(Parsed(text)));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_THAT(s.message(), HasSubstr(field)) << text;
  }
}

TEST(Config, LoadsFromAFileAndReportsAMissingOne) {
  const std::string path = ::testing::TempDir() + "/deltad_config_test.conf";
  {
    std::ofstream out(path);
    out << "backend: \"sim\"\nheuristic: \"dtr\"\n";
  }
  auto c = LoadConfigFile(path);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->heuristic(), "dtr");
  std::remove(path.c_str());
  EXPECT_EQ(LoadConfigFile(path).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace deltad::daemon
