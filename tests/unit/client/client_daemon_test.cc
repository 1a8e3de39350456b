// The client against a daemon in the same process, over a real Unix socket:
// the session, the synchronous release, and what happens when the daemon
// goes away and comes back.
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>

#include "client/client.h"
#include "client/sim_chunk_device.h"
#include "client/sim_device.h"
#include "daemon/config.h"
#include "daemon/process_end.h"
#include "daemon/server.h"
#include "gtest/gtest.h"

namespace deltad::client {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

class ClientDaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("deltad-client-test-" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
    socket_ = (dir_ / "d.sock").string();
    StartDaemon();
  }
  void TearDown() override {
    client_.reset();
    server_.reset();
    std::filesystem::remove_all(dir_);
  }

  void StartDaemon(int64_t gpu_memory = 64 * kMiB) {
    v1::DaemonConfig c;
    c.set_socket_path(socket_);
    c.set_metrics_address("127.0.0.1:0");
    c.mutable_sim()->set_gpus(2);
    c.mutable_sim()->set_memory_bytes(gpu_memory);
    c.set_min_session_bytes(4 * kMiB);
    c.set_host_pool_bytes(64 * kMiB);
    c.set_host_slab_bytes(4 * kMiB);
    c.set_default_host_quota_bytes(32 * kMiB);
    c = daemon::WithDefaults(c);
    ASSERT_TRUE(daemon::ValidateConfig(c).ok());
    auto s = daemon::Server::Start(c);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
  }

  void Connect(int64_t budget) {
    Connect(budget, std::make_unique<SimDevice>(1 << 30, 0, 0));
  }
  void Connect(int64_t budget, std::unique_ptr<Device> device) {
    auto c = MakeClient(budget, std::move(device));
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = std::move(*c);
  }
  // The device memory of the daemon's sim backend: its chunks, mapped.
  static std::unique_ptr<Device> ChunkDevice() {
    auto d = SimChunkDevice::Create(64 * kMiB, 0, 0);
    EXPECT_TRUE(d.ok()) << d.status();
    return d.ok() ? std::unique_ptr<Device>(std::move(*d)) : nullptr;
  }
  // One session given the whole budget of a GPU of three 2 MiB chunks: the
  // daemon has no room to lend it.
  void ConnectAloneToASmallGpu() {
    server_.reset();
    StartDaemon(8 * kMiB);
    const int64_t budget = server_->node().Status().gpus(0).budget_bytes();
    ASSERT_EQ(budget, 6 * kMiB) << "the scenarios count on three chunks";
    Connect(budget, ChunkDevice());
    ASSERT_TRUE(client_->connected());
  }
  int64_t GpuChunkBytes() const {
    return server_->node().Status().gpus(0).chunk_bytes();
  }

  absl::StatusOr<std::unique_ptr<Client>> MakeClient(
      int64_t budget, std::unique_ptr<Device> device) {
    ClientOptions o;
    o.link.socket_path = socket_;
    o.link.requested_budget_bytes = budget;
    o.link.label = "test";
    o.fallback_budget_bytes = budget > 0 ? budget : 32 * kMiB;
    o.fallback_host_bytes = 64 * kMiB;
    o.reconnect_interval_ms = 50;
    return Client::Connect(o, std::move(device));
  }

  // Uncomputable tensors, so every release is an offload whose bytes
  // must come back. `pinned`: left pinned, as by an op still running.
  void TrackFilled(uint64_t first, uint64_t last, int64_t bytes = kMiB,
                   bool pinned = false) {
    for (uint64_t id = first; id <= last; ++id) {
      TensorInfo t;
      t.id = id;
      t.bytes = bytes;
      t.uncomputable = true;
      auto p = client_->Track(t, nullptr);
      ASSERT_TRUE(p.ok()) << id << ": " << p.status();
      std::memset(*p, static_cast<int>(id), static_cast<size_t>(bytes));
      if (!pinned) client_->Unpin(id);
    }
  }

  void ExpectBytes(uint64_t first, uint64_t last, int64_t bytes = kMiB) {
    for (uint64_t id = first; id <= last; ++id) {
      auto p = client_->Pin(id);
      ASSERT_TRUE(p.ok()) << id << ": " << p.status();
      const auto* b = static_cast<const unsigned char*>(*p);
      EXPECT_EQ(b[0], static_cast<unsigned char>(id)) << id;
      EXPECT_EQ(b[bytes - 1], static_cast<unsigned char>(id)) << id;
      client_->Unpin(id);
    }
  }

  template <typename Pred>
  bool Eventually(Pred pred) {
    for (int i = 0; i < 400; ++i) {
      if (pred()) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
    return pred();
  }

  std::filesystem::path dir_;
  std::string socket_;
  std::unique_ptr<daemon::Server> server_;
  std::unique_ptr<Client> client_;
};

// Without a daemon the process decides in-process: with the same filter
// the daemon runs by default, so a job decides alike with and without it.
TEST(ClientDefaults, TheInProcessPolicyFiltersAsTheDaemonDoesByDefault) {
  auto daemon = daemon::NodeOptionsFrom(daemon::WithDefaults({}));
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const policy::FilterOptions local = ClientOptions::DefaultLocalFilter();
  const policy::FilterOptions& remote = daemon->policy.filter;
  EXPECT_EQ(local.heuristic, remote.heuristic);
  EXPECT_EQ(local.sampled, remote.sampled);
  EXPECT_EQ(local.skip_small, remote.skip_small);
  EXPECT_EQ(local.exact_below, remote.exact_below);
  EXPECT_GT(local.exact_below, 0);
}

TEST_F(ClientDaemonTest, OpensASessionWithTheRequestedBudget) {
  Connect(8 * kMiB);
  const ClientStats s = client_->Stats();
  EXPECT_TRUE(s.connected);
  EXPECT_EQ(s.budget_bytes, 8 * kMiB);
  const v1::NodeStatusResponse status = server_->node().Status();
  ASSERT_EQ(status.sessions_size(), 1);
  EXPECT_EQ(status.sessions(0).label(), "test");
  EXPECT_EQ(status.sessions(0).pid(), ::getpid());
  EXPECT_EQ(status.sessions(0).host_bytes(), 0);
}

TEST_F(ClientDaemonTest, TheDaemonsOrdersKeepTheBytesAndTheAccountsAgree) {
  Connect(8 * kMiB);
  // 57.6 MiB of GPU budget: 40 MiB fit, so the daemon lets the session go
  // past its share; beyond the GPU's budget it must release.
  TrackFilled(1, 70);
  client_->Flush();
  ExpectBytes(1, 70);
  const ClientStats s = client_->Stats();
  EXPECT_GT(s.sync_releases, 0);
  EXPECT_GT(s.offloads, 0);
  EXPECT_EQ(s.rejected_batches, 0);
  EXPECT_EQ(s.local_decisions, 0);
  EXPECT_TRUE(s.connected);
  client_->Flush();
  EXPECT_TRUE(Eventually([&] {
    const v1::NodeStatusResponse st = server_->node().Status();
    return st.sessions_size() == 1 &&
           st.sessions(0).device_bytes() == client_->Stats().device_bytes;
  }));
}

TEST_F(ClientDaemonTest, KeepsTrainingWhenTheDaemonGoesAndReportsAllToTheNext) {
  Connect(8 * kMiB);
  TrackFilled(1, 70);  // some offloaded into the daemon's slabs
  ASSERT_GT(client_->Stats().offloads, 0);
  server_->Drain();
  server_.reset();  // the slabs' memory stays mapped in the client
  ASSERT_TRUE(Eventually([&] { return !client_->connected(); }));
  TrackFilled(71, 80);  // decided in-process now
  ExpectBytes(1, 80);
  EXPECT_GT(client_->Stats().local_decisions, 0);

  StartDaemon();
  ASSERT_TRUE(Eventually([&] { return client_->connected(); }));
  EXPECT_EQ(client_->Stats().reconnects, 1);
  client_->Flush();
  EXPECT_TRUE(Eventually([&] {
    const v1::NodeStatusResponse st = server_->node().Status();
    return st.sessions_size() == 1 && st.sessions(0).tensors() == 80;
  }));
  ExpectBytes(1, 80);
  EXPECT_EQ(client_->Stats().rejected_batches, 0);
}

// Between two iterations a process may hold no tensor at all; a session
// found again then is a reconnect all the same.
TEST_F(ClientDaemonTest,
       ASessionFoundAgainWithNoTensorsHeldCountsAsAReconnect) {
  Connect(8 * kMiB);
  ASSERT_TRUE(client_->connected());
  EXPECT_EQ(client_->Stats().reconnects, 0);
  server_->Drain();
  server_.reset();
  ASSERT_TRUE(Eventually([&] { return !client_->connected(); }));
  StartDaemon();
  ASSERT_TRUE(Eventually([&] { return client_->connected(); }));
  EXPECT_EQ(client_->Stats().reconnects, 1);
}

TEST_F(ClientDaemonTest, WithoutADaemonTheClientStartsInProcess) {
  server_.reset();
  Connect(4 * kMiB);
  EXPECT_FALSE(client_->connected());
  TrackFilled(1, 10);
  ExpectBytes(1, 10);
  EXPECT_LE(client_->Stats().peak_device_bytes, 4 * kMiB);
}

// --- device memory in the daemon's chunks -----------------------------------

TEST_F(ClientDaemonTest, AChunkDeviceHoldsItsBudgetInTheDaemonsChunks) {
  Connect(8 * kMiB, ChunkDevice());
  ASSERT_TRUE(client_->connected());
  const v1::NodeStatusResponse st = server_->node().Status();
  ASSERT_EQ(st.sessions_size(), 1);
  // 2 MiB chunks (the sim backend's default), four of them.
  EXPECT_EQ(st.sessions(0).chunk_bytes(), 8 * kMiB);
  EXPECT_EQ(st.gpus(0).chunk_bytes(), 8 * kMiB);
}

TEST_F(ClientDaemonTest, AChunkDeviceKeepsTheBytesThroughOffloadsAndReloads) {
  Connect(8 * kMiB, ChunkDevice());
  // 1 MiB tensors in 2 MiB chunks: whole chunks each (half a chunk and
  // more), so the budget holds four at a time, not eight.
  TrackFilled(1, 40);
  ExpectBytes(1, 40);
  const ClientStats s = client_->Stats();
  EXPECT_GT(s.offloads, 0);
  EXPECT_TRUE(s.connected);
  EXPECT_EQ(s.rejected_batches, 0);
  // Beyond the budget only while the GPU had room no one held.
  EXPECT_LE(GpuChunkBytes(), server_->node().Status().gpus(0).budget_bytes());
}

TEST_F(ClientDaemonTest,
       ChunksShortOfABudgetThatAllowsTheBytesAreMadeByReleasingWhatCanBe) {
  ASSERT_NO_FATAL_FAILURE(ConnectAloneToASmallGpu());
  // Three tensors of a chunk each, 3.3 MiB in all: the first still pinned
  // by its op, the other two releasable.
  constexpr int64_t kTensor = kMiB + kMiB / 10;
  ASSERT_NO_FATAL_FAILURE(TrackFilled(1, 1, kTensor, /*pinned=*/true));
  ASSERT_NO_FATAL_FAILURE(TrackFilled(2, 3, kTensor));
  // 2.6 MiB more fit the budget's bytes but take two chunks, and none is
  // free. Releasing both releasable tensors frees 2.2 MiB, less than the
  // bytes asked, but the two chunks the allocation lacks.
  ASSERT_NO_FATAL_FAILURE(TrackFilled(4, 4, 2 * kMiB + 6 * kMiB / 10));
  client_->Unpin(1);
  const ClientStats s = client_->Stats();
  EXPECT_GE(s.offloads, 2) << "reloads " << s.reloads;
  EXPECT_TRUE(s.connected);
  EXPECT_EQ(s.rejected_batches, 0);
  ExpectBytes(1, 3, kTensor);
}

TEST_F(ClientDaemonTest,
       ASmallAllocationShortOfAPageReleasesUntilAChunkIsFree) {
  ASSERT_NO_FATAL_FAILURE(ConnectAloneToASmallGpu());
  // 96 blocks of 60 KiB fill the three 2 MiB chunks, 34 to a page; the
  // first page's stay pinned by their op. 5.6 MiB: the budget has room for
  // a small tensor, but no chunk is free for a page of its size class.
  constexpr int64_t kBlock = 60 << 10;
  constexpr uint64_t kBlocks = 96;
  ASSERT_NO_FATAL_FAILURE(TrackFilled(1, 34, kBlock, /*pinned=*/true));
  ASSERT_NO_FATAL_FAILURE(TrackFilled(35, kBlocks, kBlock));
  ASSERT_NO_FATAL_FAILURE(TrackFilled(kBlocks + 1, kBlocks + 1, 8));
  for (uint64_t id = 1; id <= 34; ++id) client_->Unpin(id);
  EXPECT_TRUE(client_->Stats().connected);
  ExpectBytes(1, kBlocks, kBlock);
}

TEST_F(ClientDaemonTest, ClosingAChunkClientGivesTheChunksBack) {
  Connect(8 * kMiB, ChunkDevice());
  TrackFilled(1, 4);
  ASSERT_EQ(GpuChunkBytes(), 8 * kMiB);
  client_->Close();
  EXPECT_TRUE(Eventually([&] { return GpuChunkBytes() == 0; }));
}

TEST_F(ClientDaemonTest, RawAllocationsTakeTheDaemonsChunksBesideTensors) {
  Connect(8 * kMiB, ChunkDevice());
  ASSERT_TRUE(client_->connected());
  TrackFilled(1, 4);  // every chunk of the budget in use
  auto raw = client_->AllocateRaw(4 * kMiB);
  ASSERT_TRUE(raw.ok()) << raw.status();
  std::memset(*raw, 0xee, 4 * kMiB);
  ClientStats s = client_->Stats();
  EXPECT_EQ(s.raw_bytes, 4 * kMiB);
  EXPECT_TRUE(s.connected);
  EXPECT_EQ(s.rejected_batches, 0);
  EXPECT_LE(GpuChunkBytes(), server_->node().Status().gpus(0).budget_bytes());
  // Past the GPU's whole budget: refused, saying what the budget holds.
  auto huge = client_->AllocateRaw(128 * kMiB);
  ASSERT_FALSE(huge.ok());
  EXPECT_TRUE(absl::IsResourceExhausted(huge.status())) << huge.status();
  EXPECT_NE(huge.status().message().find("within the budget of"),
            std::string::npos)
      << huge.status();
  client_->FreeRaw(*raw, 4 * kMiB);
  ExpectBytes(1, 4);
  s = client_->Stats();
  EXPECT_EQ(s.raw_bytes, 0);
  EXPECT_EQ(s.rejected_batches, 0);
}

TEST_F(ClientDaemonTest, AChunkDeviceWithoutADaemonMakesItsOwnChunks) {
  server_.reset();
  Connect(4 * kMiB, ChunkDevice());
  EXPECT_FALSE(client_->connected());
  TrackFilled(1, 10);
  ExpectBytes(1, 10);
  EXPECT_LE(client_->Stats().peak_device_bytes, 4 * kMiB);
}

// Everything held pinned by running ops (as a recompute chain pins its
// parents) and a budget already met: the allocation that lets them finish
// takes room in a chunk already mapped, rather than failing the step.
TEST_F(ClientDaemonTest, WhenEverythingHeldIsInUseRoomInMappedChunksIsUsed) {
  server_.reset();
  Connect(5 * kMiB, ChunkDevice());
  ASSERT_FALSE(client_->connected());
  // 60 KiB blocks, 96 to three 2 MiB chunks: the budget's 85 leave room
  // for 11 more in the third, all pinned by their ops.
  constexpr int64_t kBlock = 60 << 10;
  ASSERT_NO_FATAL_FAILURE(TrackFilled(1, 85, kBlock, /*pinned=*/true));
  ASSERT_EQ(client_->Stats().chunk_bytes, 6 * kMiB);
  ASSERT_EQ(client_->Stats().past_budget_allocations, 0);
  // Those 11: past the budget, in the chunk held.
  ASSERT_NO_FATAL_FAILURE(TrackFilled(86, 96, kBlock, /*pinned=*/true));
  ClientStats s = client_->Stats();
  EXPECT_EQ(s.past_budget_allocations, 11);
  EXPECT_EQ(s.chunk_bytes, 6 * kMiB) << "no chunk was added for them";
  // The chunks are full now: nothing more past the budget.
  TensorInfo more;
  more.id = 97;
  more.bytes = kBlock;
  more.uncomputable = true;
  EXPECT_EQ(client_->Track(more, nullptr).status().code(),
            absl::StatusCode::kResourceExhausted);
  // Once the ops end, the budget holds again.
  for (uint64_t id = 1; id <= 96; ++id) client_->Unpin(id);
  ASSERT_NO_FATAL_FAILURE(TrackFilled(97, 97, kBlock));
  ExpectBytes(1, 97, kBlock);
  s = client_->Stats();
  EXPECT_EQ(s.past_budget_allocations, 11);
  EXPECT_LE(s.device_bytes, 5 * kMiB);
}

// 3 MiB offloads in 4 MiB host slabs leave 1 MiB free in each: together
// they hold more offloads, in pieces (the policy counts them as room).
TEST_F(ClientDaemonTest, FreeRoomLeftInEachHostSlabStillHoldsOffloads) {
  // A GPU with a 6 MiB budget: the daemon has nothing to lend.
  server_.reset();
  StartDaemon(8 * kMiB);
  Connect(6 * kMiB);
  ASSERT_TRUE(client_->connected());
  // 11 tensors of 3 MiB, 2 resident: 27 MiB offloaded in the eight 4 MiB
  // slabs of the 32 MiB quota, 24 MiB of them in one piece each.
  constexpr int64_t kTensor = 3 * kMiB;
  ASSERT_NO_FATAL_FAILURE(TrackFilled(1, 11, kTensor));
  EXPECT_GE(client_->Stats().host_bytes, 27 * kMiB);
  ExpectBytes(1, 11, kTensor);
  const ClientStats s = client_->Stats();
  EXPECT_EQ(s.local_refused_no_host, 0);
  EXPECT_EQ(s.rejected_batches, 0);
}

TEST_F(ClientDaemonTest, AChunkDeviceKeepsItsTensorsWhenTheDaemonRestarts) {
  Connect(8 * kMiB, ChunkDevice());
  TrackFilled(1, 20);
  server_->Drain();
  server_.reset();
  ASSERT_TRUE(Eventually([&] { return !client_->connected(); }));
  TrackFilled(21, 30);
  StartDaemon();
  ASSERT_TRUE(Eventually([&] { return client_->connected(); }));
  ExpectBytes(1, 30);
  EXPECT_EQ(client_->Stats().rejected_batches, 0);
}

// Back from a daemon that went away, a process may hold more than its new
// session grants (another job took the room meanwhile). Nothing else would
// bring it back: the GPU still has bytes to lend, so the daemon orders no
// release, and the chunks it mapped before are not the new session's.
TEST_F(ClientDaemonTest,
       AProcessBackHoldingMoreThanItsNewGrantReleasesTheRest) {
  ClientOptions o;
  o.link.socket_path = socket_;
  o.link.requested_budget_bytes = 16 * kMiB;
  o.link.label = "back";
  o.fallback_budget_bytes = 16 * kMiB;
  o.fallback_host_bytes = 64 * kMiB;
  // Slow to come back, so that the newcomer below is there first.
  o.reconnect_interval_ms = 1500;
  auto a = Client::Connect(o, ChunkDevice());
  ASSERT_TRUE(a.ok()) << a.status();
  client_ = std::move(*a);
  ASSERT_TRUE(client_->connected());
  TrackFilled(1, 14);
  server_->Drain();
  server_.reset();
  ASSERT_TRUE(Eventually([&] { return !client_->connected(); }));
  StartDaemon();
  // Another process's job, whose floor takes all but 8 MiB of the GPU's
  // budget (this process may hold one session per GPU: the parent's pid
  // stands in for it).
  const int64_t gpu_budget = server_->node().Status().gpus(0).budget_bytes();
  const pid_t other = ::getppid();
  auto token = server_->node().registry().RegisterPeer(
      {other, ::getuid(), ::getgid(), daemon::ProcessStartTime(other)});
  ASSERT_TRUE(token.ok()) << token.status();
  v1::OpenSessionRequest newcomer;
  newcomer.set_gpu(0);
  newcomer.set_requested_budget_bytes(gpu_budget - 8 * kMiB);
  newcomer.set_min_budget_bytes(gpu_budget - 8 * kMiB);
  newcomer.set_label("newcomer");
  ASSERT_TRUE(server_->node().OpenSession(*token, newcomer).ok());
  ASSERT_TRUE(Eventually([&] { return client_->connected(); }));
  // The release follows the attach, on the keeper's thread.
  EXPECT_TRUE(Eventually([&] {
    const ClientStats now = client_->Stats();
    return now.device_bytes <= now.budget_bytes;
  })) << "held "
      << client_->Stats().device_bytes << " bytes past the new grant of "
      << client_->Stats().budget_bytes;
  const ClientStats back = client_->Stats();
  EXPECT_LE(back.budget_bytes, 8 * kMiB);
  EXPECT_GT(back.offloads, 0);
  ExpectBytes(1, 14);
  EXPECT_EQ(client_->Stats().rejected_batches, 0);
}

// A device that maps another backend's chunks than the daemon has.
class CudaLikeDevice final : public Device {
 public:
  absl::string_view name() const override { return "cuda-like"; }
  absl::string_view chunk_backend() const override { return "cuda"; }
  absl::StatusOr<void*> Allocate(int64_t) override {
    return absl::ResourceExhaustedError("no chunks");
  }
  void Free(void*, int64_t) override {}
  void CopyToHost(void*, const void*, int64_t) override {}
  void CopyToDevice(void*, const void*, int64_t) override {}
};

// A device that knows its GPU's UUID, as a CUDA one does, with heap memory.
class UuidDevice final : public Device {
 public:
  explicit UuidDevice(std::string uuid) : uuid_(std::move(uuid)) {}
  absl::string_view name() const override { return "uuid"; }
  std::string gpu_uuid() const override { return uuid_; }
  absl::StatusOr<void*> Allocate(int64_t bytes) override {
    return std::malloc(static_cast<size_t>(bytes));
  }
  void Free(void* p, int64_t) override { std::free(p); }
  void CopyToHost(void* h, const void* d, int64_t n) override {
    std::memcpy(h, d, static_cast<size_t>(n));
  }
  void CopyToDevice(void* d, const void* h, int64_t n) override {
    std::memcpy(d, h, static_cast<size_t>(n));
  }

 private:
  std::string uuid_;
};

// A process that sees its GPU as device 0 (a container given one GPU) is
// placed on the daemon's GPU with that device's UUID.
TEST_F(ClientDaemonTest, AClientWithoutAGpuIndexOpensOnTheGpuWithItsUuid) {
  const std::string uuid = server_->node().Status().gpus(1).uuid();
  ASSERT_FALSE(uuid.empty());
  ClientOptions o;
  o.link.socket_path = socket_;
  o.reconnect_interval_ms = 0;
  auto c = Client::Connect(o, std::make_unique<UuidDevice>(uuid));
  ASSERT_TRUE(c.ok()) << c.status();
  const v1::NodeStatusResponse st = server_->node().Status();
  ASSERT_EQ(st.sessions_size(), 1);
  EXPECT_EQ(st.sessions(0).gpu(), 1);
  c->reset();
  auto unknown =
      Client::Connect(o, std::make_unique<UuidDevice>("GPU-not-on-this-node"));
  ASSERT_TRUE(unknown.ok()) << unknown.status();
  EXPECT_FALSE((*unknown)->connected());  // refused: goes on alone
}

TEST_F(ClientDaemonTest, ADeviceThatCannotMapTheDaemonsChunksGoesOnAlone) {
  Connect(8 * kMiB, std::make_unique<CudaLikeDevice>());
  EXPECT_FALSE(client_->connected());
  EXPECT_EQ(GpuChunkBytes(), 0);
  EXPECT_TRUE(Eventually(
      [&] { return server_->node().Status().sessions_size() == 0; }));
}

}  // namespace
}  // namespace deltad::client
