// Copies ahead of need (ClientOptions::copy_ahead): tensors marked
// TensorInfo::copy_ahead are copied to host memory while the executor
// idles; offloading one then takes no copy, and the copies give their host
// room to offloads that need it.
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>

#include "client/client.h"
#include "client/sim_device.h"
#include "gtest/gtest.h"

namespace deltad::client {

// Reaches an in-process plan's release steps and a copy's state, which no
// public call times.
class ClientTestPeer {
 public:
  static absl::Status PlanOffloads(Client& c, uint64_t id) {
    return c.Offload(id, Client::Origin::kLocalPlan);
  }
  static size_t LandedListed(Client& c) {
    std::lock_guard<std::mutex> lock(c.mu_);
    return c.ahead_landed_.size();
  }
  static int64_t HostArenaUsed(Client& c) {
    std::lock_guard<std::mutex> lock(c.mu_);
    return c.arena_.used_bytes();
  }
  static bool CopyingAhead(Client& c, uint64_t id) {
    std::lock_guard<std::mutex> lock(c.mu_);
    auto it = c.records_.find(id);
    return it != c.records_.end() &&
           it->second->ahead == Client::Record::Ahead::kCopying;
  }
};

namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

std::unique_ptr<Client> LocalClient(int64_t budget, int64_t host,
                                    double d2h_bytes_per_s = 0) {
  ClientOptions o;
  o.use_daemon = false;
  o.fallback_budget_bytes = budget;
  o.fallback_host_bytes = host;
  auto c = Client::Connect(
      o, std::make_unique<SimDevice>(int64_t{1} << 30, d2h_bytes_per_s, 0));
  EXPECT_TRUE(c.ok()) << c.status();
  return std::move(*c);
}

// Tracks an uncomputable tensor filled with its id, and unpins it.
void TrackFilled(Client& client, uint64_t id, int64_t bytes, bool ahead) {
  TensorInfo t;
  t.id = id;
  t.bytes = bytes;
  t.uncomputable = true;
  t.copy_ahead = ahead;
  auto p = client.Track(t, nullptr);
  ASSERT_TRUE(p.ok()) << p.status();
  std::memset(*p, static_cast<int>(id), static_cast<size_t>(bytes));
  client.Unpin(id);
}

void ExpectBytesIntact(Client& client, uint64_t id, int64_t bytes) {
  auto p = client.Pin(id);
  ASSERT_TRUE(p.ok()) << p.status();
  const auto* b = static_cast<const unsigned char*>(*p);
  int64_t wrong = 0;
  for (int64_t i = 0; i < bytes; ++i) wrong += b[i] != id;
  EXPECT_EQ(wrong, 0) << "tensor " << id;
  client.Unpin(id);
}

bool WaitFor(const std::function<bool()>& done) {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

// Frees resident tensors among 1..9, all but `keep`, until the client holds
// at most `bytes` on the device.
void FreeResidentDownTo(Client& client, int64_t bytes, uint64_t keep = 0) {
  for (uint64_t id = 1; id <= 9; ++id) {
    if (client.Stats().device_bytes <= bytes) return;
    if (id != keep && client.Resident(id)) {
      ASSERT_TRUE(client.Free(id).ok());
    }
  }
}

// Tensors 1..9 of 1 MiB in a budget of 8: one is offloaded, which maps the
// first heap region for offloads. Returns a resident one.
uint64_t MapAHostRegion(Client& client) {
  for (uint64_t id = 1; id <= 9; ++id) {
    TrackFilled(client, id, kMiB, /*ahead=*/false);
  }
  EXPECT_EQ(client.Stats().offloads, 1);
  for (uint64_t id = 1; id <= 9; ++id) {
    if (client.Resident(id)) return id;
  }
  return 0;
}

TEST(CopyAhead, ATensorCopiedAheadIsOffloadedWithoutACopyAndKeepsItsBytes) {
  auto client = LocalClient(8 * kMiB, 256 * kMiB);
  // No host room is mapped yet: a copy ahead never maps any.
  TrackFilled(*client, 100, kMiB, /*ahead=*/true);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(client->Stats().copies_ahead, 0);
  ASSERT_TRUE(client->Free(100).ok());

  MapAHostRegion(*client);
  FreeResidentDownTo(*client, 5 * kMiB);
  for (uint64_t id = 10; id <= 12; ++id) {
    TrackFilled(*client, id, kMiB, /*ahead=*/true);
  }
  ASSERT_TRUE(WaitFor([&] { return client->Stats().copies_ahead == 3; }))
      << client->Stats().copies_ahead << " copies made";
  const ClientStats before = client->Stats();
  EXPECT_EQ(before.copied_ahead_bytes, 3 * kMiB);
  EXPECT_EQ(before.host_bytes, kMiB);  // the offloaded tensor; not copies

  ASSERT_TRUE(ClientTestPeer::PlanOffloads(*client, 11).ok());
  const ClientStats after = client->Stats();
  EXPECT_EQ(after.offloads_from_copies, 1);
  EXPECT_EQ(after.offloads, before.offloads + 1);
  EXPECT_EQ(after.device_bytes, before.device_bytes - kMiB);
  EXPECT_EQ(after.host_bytes, 2 * kMiB);
  EXPECT_FALSE(client->Resident(11));
  ExpectBytesIntact(*client, 11, kMiB);
  EXPECT_EQ(client->Stats().reloads, 1);
}

TEST(CopyAhead, CopiesGiveTheirHostRoomToAnOffloadOldestFirst) {
  // 4 MiB of host memory: one offload and three copies fill it.
  auto client = LocalClient(8 * kMiB, 4 * kMiB);
  const uint64_t resident = MapAHostRegion(*client);
  ASSERT_NE(resident, 0u);
  FreeResidentDownTo(*client, 5 * kMiB, resident);
  for (uint64_t id = 10; id <= 12; ++id) {
    TrackFilled(*client, id, kMiB, /*ahead=*/true);
  }
  ASSERT_TRUE(WaitFor([&] { return client->Stats().copies_ahead == 3; }));

  // The arena is full; a tensor never copied still offloads, in the room
  // of the oldest copy.
  ASSERT_TRUE(ClientTestPeer::PlanOffloads(*client, resident).ok());
  ClientStats s = client->Stats();
  EXPECT_EQ(s.copies_ahead_dropped, 1);
  EXPECT_EQ(s.local_refused, 0);
  EXPECT_EQ(s.offloads_from_copies, 0);
  // 11 keeps its copy; 10's went.
  ASSERT_TRUE(ClientTestPeer::PlanOffloads(*client, 11).ok());
  ASSERT_TRUE(ClientTestPeer::PlanOffloads(*client, 10).ok());
  s = client->Stats();
  EXPECT_EQ(s.offloads_from_copies, 1);
  EXPECT_EQ(s.copies_ahead_dropped, 2);  // 10 needed 12's room
  for (uint64_t id : {resident, uint64_t{10}, uint64_t{11}, uint64_t{12}}) {
    ExpectBytesIntact(*client, id, kMiB);
  }
}

TEST(CopyAhead, FreeingATensorBeingCopiedWaitsForTheCopyAndReturnsItsRoom) {
  // 20 MB/s: the copy of 2 MiB takes about 100 ms.
  auto client = LocalClient(8 * kMiB, 256 * kMiB, 20e6);
  MapAHostRegion(*client);
  FreeResidentDownTo(*client, 5 * kMiB);  // near the budget: copies go
  TrackFilled(*client, 20, 2 * kMiB, /*ahead=*/true);
  ASSERT_TRUE(
      WaitFor([&] { return ClientTestPeer::CopyingAhead(*client, 20); }));
  ASSERT_TRUE(client->Free(20).ok());
  const ClientStats s = client->Stats();
  EXPECT_EQ(s.copies_ahead, 1);  // it landed, then went with its tensor
  EXPECT_EQ(s.device_bytes, 5 * kMiB);
  EXPECT_EQ(s.host_bytes, kMiB);  // the one offloaded tensor
}

TEST(CopyAhead, CopiesWaitForAReleaseOrThreeQuartersOfTheBudget) {
  auto client = LocalClient(8 * kMiB, 256 * kMiB);
  for (uint64_t id = 10; id <= 13; ++id) {
    TrackFilled(*client, id, kMiB, /*ahead=*/true);
  }
  // 4 MiB of 8, nothing released: no copy (and no host room yet either).
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(client->Stats().copies_ahead, 0);
  // 6 of 8: copies may start, but no host room is mapped yet; the tensors
  // wait for it in line (they used to be dropped from it).
  for (uint64_t id = 14; id <= 15; ++id) {
    TrackFilled(*client, id, kMiB, /*ahead=*/false);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(client->Stats().copies_ahead, 0);
  // Past 8 MiB: a release, which maps host room. Once the process is far
  // below its budget again, the tensors still queued are copied.
  for (uint64_t id = 20; id <= 22; ++id) {
    TrackFilled(*client, id, kMiB, /*ahead=*/false);
  }
  ASSERT_GE(client->Stats().offloads, 1);
  for (uint64_t id : {14, 15, 20, 21, 22}) ASSERT_TRUE(client->Free(id).ok());
  ASSERT_LE(client->Stats().device_bytes, 4 * kMiB);
  ASSERT_TRUE(WaitFor([&] { return client->Stats().copies_ahead >= 1; }))
      << client->Stats().copies_ahead;
}

TEST(CopyAhead, AReloadedTensorKeepsItsHostBytesAndLeavesAgainWithoutACopy) {
  auto client = LocalClient(8 * kMiB, 256 * kMiB);
  MapAHostRegion(*client);
  FreeResidentDownTo(*client, 5 * kMiB);
  TrackFilled(*client, 30, kMiB, /*ahead=*/true);
  TrackFilled(*client, 31, kMiB, /*ahead=*/false);  // may be written again
  for (uint64_t id : {30, 31}) {
    ASSERT_TRUE(ClientTestPeer::PlanOffloads(*client, id).ok());
    ExpectBytesIntact(*client, id, kMiB);  // reloaded
  }
  ClientStats s = client->Stats();
  EXPECT_EQ(s.copies_kept, 1);
  const int64_t from_copies = s.offloads_from_copies;
  for (uint64_t id : {30, 31}) {
    ASSERT_TRUE(ClientTestPeer::PlanOffloads(*client, id).ok());
    ExpectBytesIntact(*client, id, kMiB);
  }
  s = client->Stats();
  EXPECT_EQ(s.offloads_from_copies, from_copies + 1);  // 30's, not 31's
  EXPECT_EQ(s.copies_kept, 2);
  // The copy goes with its tensor: its host block back to the arena.
  const int64_t arena_before = ClientTestPeer::HostArenaUsed(*client);
  ASSERT_TRUE(client->Free(31).ok());  // nothing on the host
  EXPECT_EQ(ClientTestPeer::HostArenaUsed(*client), arena_before);
  ASSERT_TRUE(client->Free(30).ok());
  EXPECT_EQ(ClientTestPeer::HostArenaUsed(*client), arena_before - kMiB);
}

TEST(CopyAhead, TheListOfLandedCopiesForgetsThoseGoneWithTheirTensors) {
  // Offloaded from its kept copy and reloaded again, over and over, with
  // host room to spare: each round lists a copy and leaves one gone.
  auto client = LocalClient(8 * kMiB, 256 * kMiB);
  MapAHostRegion(*client);
  FreeResidentDownTo(*client, 5 * kMiB);
  TrackFilled(*client, 40, 4096, /*ahead=*/true);
  for (int round = 0; round < 10000; ++round) {
    ASSERT_TRUE(ClientTestPeer::PlanOffloads(*client, 40).ok());
    ASSERT_TRUE(client->Pin(40).ok());
    client->Unpin(40);
  }
  EXPECT_GE(client->Stats().copies_kept, 10000);
  EXPECT_LE(ClientTestPeer::LandedListed(*client), 4096u);
  ExpectBytesIntact(*client, 40, 4096);
}

TEST(CopyAhead, NothingIsCopiedWhenTheOptionIsOff) {
  ClientOptions o;
  o.use_daemon = false;
  o.fallback_budget_bytes = 8 * kMiB;
  o.copy_ahead = false;
  auto c =
      Client::Connect(o, std::make_unique<SimDevice>(int64_t{1} << 30, 0, 0));
  ASSERT_TRUE(c.ok()) << c.status();
  Client& client = **c;
  MapAHostRegion(client);
  for (uint64_t id = 10; id <= 12; ++id) {
    TrackFilled(client, id, kMiB, /*ahead=*/true);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(client.Stats().copies_ahead, 0);
}

}  // namespace
}  // namespace deltad::client
