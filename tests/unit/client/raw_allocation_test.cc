// Client::AllocateRaw / FreeRaw with no daemon: memory for a framework's own
// allocator, in the same budget as the tracked tensors, on the heap-backed
// and the chunk-backed simulated devices.
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "client/client.h"
#include "client/sim_chunk_device.h"
#include "client/sim_device.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace deltad::client {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr int64_t kMiB = int64_t{1} << 20;

std::unique_ptr<Device> HeapDevice() {
  return std::make_unique<SimDevice>(int64_t{1} << 30, 0, 0);
}

std::unique_ptr<Device> ChunkDevice() {
  auto d = SimChunkDevice::Create(int64_t{256} << 20, 0, 0);
  EXPECT_TRUE(d.ok()) << d.status();
  return std::move(*d);
}

std::unique_ptr<Client> LocalClient(int64_t budget,
                                    std::unique_ptr<Device> device) {
  ClientOptions o;
  o.use_daemon = false;
  o.fallback_budget_bytes = budget;
  o.fallback_host_bytes = int64_t{64} << 20;
  auto c = Client::Connect(o, std::move(device));
  EXPECT_TRUE(c.ok()) << c.status();
  return std::move(*c);
}

// Uncomputable, so that a release is an offload whose bytes come back.
TensorInfo Uncomputable(uint64_t id, int64_t bytes) {
  TensorInfo t;
  t.id = id;
  t.bytes = bytes;
  t.uncomputable = true;
  return t;
}

// Both simulated devices: the heap one, and the chunk one a GPU's path
// takes (memory only from chunks, made in-process here).
class RawAllocationTest : public ::testing::TestWithParam<bool> {
 protected:
  std::unique_ptr<Client> MakeClient(int64_t budget) {
    return LocalClient(budget, GetParam() ? ChunkDevice() : HeapDevice());
  }
};

TEST_P(RawAllocationTest, AllocationsPastTheBudgetFailAndFreeingMakesRoom) {
  auto client = MakeClient(8 * kMiB);
  std::vector<void*> held;
  for (int i = 0; i < 4; ++i) {
    auto p = client->AllocateRaw(2 * kMiB);
    ASSERT_TRUE(p.ok()) << p.status();
    std::memset(*p, i, 2 * kMiB);  // the memory is really there
    held.push_back(*p);
  }
  auto refused = client->AllocateRaw(kMiB);
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(absl::IsResourceExhausted(refused.status()));
  // What the framework shows as its out-of-memory error: the request, the
  // budget and what holds it.
  EXPECT_THAT(
      refused.status().message(),
      AllOf(HasSubstr("1048576 bytes"), HasSubstr("budget of 8388608"),
            HasSubstr("8388608 held"), HasSubstr("8388608 by the allocator")));
  client->FreeRaw(held.back(), 2 * kMiB);
  held.pop_back();
  auto again = client->AllocateRaw(kMiB);
  ASSERT_TRUE(again.ok()) << again.status();
  client->FreeRaw(*again, kMiB);
  for (void* p : held) client->FreeRaw(p, 2 * kMiB);
  EXPECT_EQ(client->Stats().device_bytes, 0);
  EXPECT_EQ(client->Stats().raw_bytes, 0);
}

TEST_P(RawAllocationTest, RawBytesCountWithTrackedTensorsInTheStats) {
  auto client = MakeClient(16 * kMiB);
  ASSERT_TRUE(client->Track(Uncomputable(1, 4 * kMiB), nullptr).ok());
  client->Unpin(1);
  auto p = client->AllocateRaw(6 * kMiB);
  ASSERT_TRUE(p.ok()) << p.status();
  ClientStats s = client->Stats();
  EXPECT_EQ(s.device_bytes, 10 * kMiB);
  EXPECT_EQ(s.raw_bytes, 6 * kMiB);
  EXPECT_EQ(s.peak_device_bytes, 10 * kMiB);
  client->FreeRaw(*p, 6 * kMiB);
  s = client->Stats();
  EXPECT_EQ(s.device_bytes, 4 * kMiB);
  EXPECT_EQ(s.raw_bytes, 0);
  EXPECT_EQ(s.peak_device_bytes, 10 * kMiB);
}

TEST_P(RawAllocationTest, ATrackedTensorIsOffloadedToMakeRoomForARawOne) {
  auto client = MakeClient(8 * kMiB);
  auto tensor = client->Track(Uncomputable(7, 4 * kMiB), nullptr);
  ASSERT_TRUE(tensor.ok()) << tensor.status();
  std::memset(*tensor, 0x5a, 4 * kMiB);
  client->Unpin(7);
  auto raw = client->AllocateRaw(6 * kMiB);
  ASSERT_TRUE(raw.ok()) << raw.status();
  EXPECT_FALSE(client->Resident(7));
  EXPECT_EQ(client->Stats().offloads, 1);
  EXPECT_LE(client->Stats().peak_device_bytes, 8 * kMiB);
  // The raw memory is never released for the tensor: with it held, the
  // tensor cannot come back.
  EXPECT_FALSE(client->Pin(7).ok());
  client->FreeRaw(*raw, 6 * kMiB);
  auto back = client->Pin(7);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(static_cast<const unsigned char*>(*back)[4 * kMiB - 1], 0x5a);
  client->Unpin(7);
}

TEST_P(RawAllocationTest, APinnedTensorIsNotReleasedForARawAllocation) {
  auto client = MakeClient(8 * kMiB);
  // Returned pinned, and left so.
  ASSERT_TRUE(client->Track(Uncomputable(1, 6 * kMiB), nullptr).ok());
  auto raw = client->AllocateRaw(4 * kMiB);
  ASSERT_FALSE(raw.ok());
  EXPECT_TRUE(absl::IsResourceExhausted(raw.status())) << raw.status();
  EXPECT_THAT(raw.status().message(), HasSubstr("6291456 by tracked tensors"));
  EXPECT_TRUE(client->Resident(1));
}

TEST_P(RawAllocationTest, BadSizesAreRefusedAndAClosedClientAllocatesNothing) {
  auto client = MakeClient(8 * kMiB);
  EXPECT_TRUE(absl::IsInvalidArgument(client->AllocateRaw(0).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(client->AllocateRaw(-5).status()));
  auto held = client->AllocateRaw(kMiB);
  ASSERT_TRUE(held.ok()) << held.status();
  client->Close();
  EXPECT_TRUE(absl::IsFailedPrecondition(client->AllocateRaw(kMiB).status()));
  // Its memory stays until the client dies, and the count stays right.
  EXPECT_EQ(client->Stats().device_bytes, kMiB);
  client->FreeRaw(*held, kMiB);
  EXPECT_EQ(client->Stats().device_bytes, 0);
}

TEST_P(RawAllocationTest, ConcurrentPairsKeepTheirBytesAndTheCount) {
  auto client = MakeClient(64 * kMiB);
  constexpr int kThreads = 4;
  std::vector<std::thread> threads;
  std::vector<int> bad(kThreads, 0);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const int64_t sizes[] = {512, 64 << 10, 2 * kMiB, 3 * kMiB};
      for (int i = 0; i < 500; ++i) {
        const int64_t bytes = sizes[(i + t) % 4];
        auto p = client->AllocateRaw(bytes);
        if (!p.ok()) {
          ++bad[static_cast<size_t>(t)];
          continue;
        }
        auto* b = static_cast<unsigned char*>(*p);
        b[0] = static_cast<unsigned char>(t);
        b[bytes - 1] = static_cast<unsigned char>(t);
        std::this_thread::yield();
        if (b[0] != t || b[bytes - 1] != t) ++bad[static_cast<size_t>(t)];
        client->FreeRaw(*p, bytes);
      }
    });
  }
  for (std::thread& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(bad[static_cast<size_t>(t)], 0);
  const ClientStats s = client->Stats();
  EXPECT_EQ(s.device_bytes, 0);
  EXPECT_EQ(s.raw_bytes, 0);
  EXPECT_LE(s.peak_device_bytes, 64 * kMiB);
}

INSTANTIATE_TEST_SUITE_P(Devices, RawAllocationTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& param) {
                           return param.param ? "ChunkDevice" : "HeapDevice";
                         });

}  // namespace
}  // namespace deltad::client
