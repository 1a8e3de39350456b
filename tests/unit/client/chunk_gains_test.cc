// An allocation past the budget that the daemon made room for, whose
// chunks come a few at a time (other sessions still releasing them): the
// client waits for them rather than fail a step the daemon allows.
#include <cstdint>
#include <cstring>
#include <memory>

#include "client/client.h"
#include "client/sim_chunk_device.h"
#include "gtest/gtest.h"
#include "tests/unit/client/fake_daemon.h"

namespace deltad::client {
namespace {

using testing_util::FakeDaemon;
using testing_util::FakeDaemonCounts;
using testing_util::FakeDaemonOptions;

constexpr int64_t kMiB = int64_t{1} << 20;

std::unique_ptr<Client> ConnectToFake(const FakeDaemonOptions& fake,
                                      FakeDaemonCounts* counts,
                                      int owed_chunks_wait_ms) {
  auto device = SimChunkDevice::Create(256 * kMiB, 0, 0);
  EXPECT_TRUE(device.ok()) << device.status();
  if (!device.ok()) return nullptr;
  ClientOptions o;
  o.open_link = FakeDaemon(fake, counts);
  o.link.label = "test";
  o.owed_chunks_wait_ms = owed_chunks_wait_ms;
  auto c = Client::Connect(o, std::move(*device));
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

TEST(ChunkGainsTest, ChunksThatComeOneAtATimeAreWaitedForPastTheRounds) {
  FakeDaemonOptions fake;
  fake.budget_bytes = 8 * kMiB;  // four 2 MiB chunks
  fake.chunks_per_fetch_past_budget = 1;
  FakeDaemonCounts counts;
  std::unique_ptr<Client> client = ConnectToFake(fake, &counts, 10000);
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(client->connected());
  ASSERT_EQ(client->Stats().chunk_bytes, 8 * kMiB);
  // 40 MiB: twenty chunks past the budget's four, one per call for chunks,
  // more calls than an allocation has rounds (16).
  TensorInfo t;
  t.id = 1;
  t.bytes = 40 * kMiB;
  t.uncomputable = true;
  auto p = client->Track(t, nullptr);
  ASSERT_TRUE(p.ok()) << p.status() << " (chunk calls " << counts.fetches
                      << ", chunks granted " << counts.chunks_granted << ")";
  std::memset(*p, 7, static_cast<size_t>(t.bytes));
  // The twenty chunks it takes, sixteen of them past the budget.
  EXPECT_GE(client->Stats().chunk_bytes, 40 * kMiB);
  EXPECT_GT(counts.fetches, 16);
  client->Unpin(1);
}

// Chunks that do not come fail the allocation, saying what it lacked.
TEST(ChunkGainsTest, ChunksThatStopComingFailTheAllocationWithAReason) {
  FakeDaemonOptions fake;
  fake.budget_bytes = 8 * kMiB;
  fake.chunks_per_fetch_past_budget = 0;  // nothing past the budget
  FakeDaemonCounts counts;
  std::unique_ptr<Client> client = ConnectToFake(fake, &counts, 200);
  ASSERT_NE(client, nullptr);
  TensorInfo t;
  t.id = 1;
  t.bytes = 40 * kMiB;
  t.uncomputable = true;
  auto p = client->Track(t, nullptr);
  ASSERT_FALSE(p.ok());
  EXPECT_TRUE(absl::IsResourceExhausted(p.status())) << p.status();
  EXPECT_NE(p.status().message().find("41943040 bytes need 20 chunks"),
            absl::string_view::npos)
      << p.status();
}

}  // namespace
}  // namespace deltad::client
