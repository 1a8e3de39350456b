#include <cstring>
#include <string>

#include "client/deltad_client.h"
#include "gtest/gtest.h"

namespace {

int Refill(void* user, uint64_t id, void* out) {
  ++*static_cast<int*>(user);
  std::memset(out, static_cast<int>(id), 1 << 20);
  return 0;
}

TEST(CApi, TracksPinsAndFreesInProcessWithoutADaemon) {
  deltad_client_options o;
  deltad_client_options_init(&o);
  o.use_daemon = 0;
  o.fallback_budget_bytes = 2 << 20;
  o.sim_d2h_bytes_per_second = 0;
  o.sim_h2d_bytes_per_second = 0;
  deltad_client* c = nullptr;
  ASSERT_EQ(deltad_client_connect(&o, &c), 0) << deltad_last_error();
  int recomputes = 0;
  for (uint64_t id = 1; id <= 4; ++id) {
    deltad_tensor_info t{};
    t.id = id;
    t.bytes = 1 << 20;
    t.compute_cost_ns = 1;
    void* p = nullptr;
    ASSERT_EQ(deltad_track(c, &t, Refill, &recomputes, &p), 0)
        << deltad_last_error();
    std::memset(p, static_cast<int>(id), 1 << 20);
    deltad_unpin(c, id);
  }
  // Two of four fit the budget: the first ones went.
  EXPECT_EQ(deltad_resident(c, 4), 1);
  EXPECT_EQ(deltad_resident(c, 1), 0);
  EXPECT_EQ(deltad_resident(c, 99), 0);
  void* p = nullptr;
  ASSERT_EQ(deltad_pin(c, 1, &p), 0) << deltad_last_error();
  EXPECT_EQ(deltad_resident(c, 1), 1);
  EXPECT_EQ(static_cast<unsigned char*>(p)[12345], 1);
  deltad_unpin(c, 1);
  deltad_client_stats s;
  ASSERT_EQ(deltad_stats(c, &s), 0);
  EXPECT_LE(s.peak_device_bytes, 2 << 20);
  EXPECT_EQ(s.connected, 0);
  // No daemon: no session, nor any lost.
  deltad_client_session_stats sessions;
  ASSERT_EQ(deltad_session_stats(c, &sessions), 0);
  EXPECT_EQ(sessions.connected, 0);
  EXPECT_EQ(sessions.session_id, 0u);
  EXPECT_EQ(sessions.sessions_lost, 0);
  EXPECT_EQ(deltad_session_stats(c, nullptr), 3);
  EXPECT_EQ(deltad_free(c, 1), 0);
  EXPECT_EQ(deltad_free(c, 1), 5);  // NOT_FOUND
  EXPECT_NE(std::strlen(deltad_last_error()), 0u);
  deltad_tensor_info bad{};
  bad.id = 9;
  EXPECT_EQ(deltad_track(c, &bad, nullptr, nullptr, &p), 3);
  deltad_client_close(c);
}

TEST(CApi, RejectsNullArgumentsAndUnknownDevices) {
  EXPECT_EQ(deltad_client_connect(nullptr, nullptr), 3);
  deltad_client_options o;
  deltad_client_options_init(&o);
  o.device = "tpu";
  deltad_client* c = nullptr;
  EXPECT_EQ(deltad_client_connect(&o, &c), 3);  // INVALID_ARGUMENT
  EXPECT_NE(std::string(deltad_last_error()).find("tpu"), std::string::npos);
  EXPECT_NE(std::string(deltad_last_error()).find("\"sim-chunks\""),
            std::string::npos);
  EXPECT_EQ(deltad_pin(nullptr, 1, nullptr), 3);
  EXPECT_EQ(deltad_set_compute_stream(nullptr, nullptr), 3);
  deltad_prefetch(nullptr, nullptr, 0);  // ignored, no crash
}

TEST(CApi, TheCudaDeviceFailsCleanlyWithoutAGpu) {
  deltad_client_options o;
  deltad_client_options_init(&o);
  o.use_daemon = 0;
  o.device = "cuda";
  deltad_client* c = nullptr;
  const int rc = deltad_client_connect(&o, &c);
  if (rc == 0) {
    GTEST_SKIP() << "a GPU is present; the GPU tests cover the cuda device";
  }
  // FAILED_PRECONDITION (no driver or GPU) or UNIMPLEMENTED (no toolkit at
  // build time), with the reason.
  EXPECT_TRUE(rc == 9 || rc == 12) << rc << ": " << deltad_last_error();
  EXPECT_NE(std::strlen(deltad_last_error()), 0u);
  EXPECT_EQ(c, nullptr);
}

TEST(CApi, AComputeStreamIsRefusedOnTheSimDeviceAndPrefetchIsAHint) {
  deltad_client_options o;
  deltad_client_options_init(&o);
  o.use_daemon = 0;
  o.fallback_budget_bytes = 4 << 20;
  deltad_client* c = nullptr;
  ASSERT_EQ(deltad_client_connect(&o, &c), 0) << deltad_last_error();
  EXPECT_EQ(deltad_set_compute_stream(c, nullptr), 9);  // FAILED_PRECONDITION
  const uint64_t unknown[] = {7, 8};
  deltad_prefetch(c, unknown, 2);  // unknown ids are skipped
  deltad_client_stats s;
  ASSERT_EQ(deltad_stats(c, &s), 0);
  EXPECT_EQ(s.device_bytes, 0);
  deltad_client_close(c);
}

}  // namespace
