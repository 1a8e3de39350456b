#include "daemon/chunk_ledger.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "daemon/backend/sim_backend.h"
#include "gtest/gtest.h"

namespace deltad::daemon {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

class ChunkLedgerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SimBackendOptions o;
    o.gpus = 2;
    o.memory_bytes = 64 * kMiB;
    o.chunk_bytes = 4 * kMiB;
    auto b = SimBackend::Create(o);
    ASSERT_TRUE(b.ok()) << b.status();
    backend_ = std::move(*b);
    ledger_ = std::make_unique<ChunkLedger>(*backend_);
  }

  std::unique_ptr<SimBackend> backend_;
  std::unique_ptr<ChunkLedger> ledger_;
};

TEST_F(ChunkLedgerTest, GrantsWholeChunksUpToTheSmallerOfTargetAndBudget) {
  ledger_->AddSession(1, 0);
  auto chunks = ledger_->Grant(1, /*target=*/100 * kMiB, /*budget=*/18 * kMiB);
  ASSERT_TRUE(chunks.ok()) << chunks.status();
  // 18 MiB of budget holds four 4 MiB chunks, not five.
  EXPECT_EQ(chunks->size(), 4u);
  EXPECT_EQ(ledger_->held_bytes(1), 16 * kMiB);
  EXPECT_EQ(backend_->allocated_bytes(0), 16 * kMiB);

  auto capped = ledger_->Grant(1, /*target=*/8 * kMiB, /*budget=*/64 * kMiB);
  ASSERT_TRUE(capped.ok());
  EXPECT_TRUE(capped->empty()) << "already holds more than the target";
}

TEST_F(ChunkLedgerTest, APartialChunkOfTargetIsRoundedUpWithinTheLimit) {
  ledger_->AddSession(1, 0);
  auto chunks = ledger_->Grant(1, /*target=*/9 * kMiB, /*budget=*/64 * kMiB);
  ASSERT_TRUE(chunks.ok());
  EXPECT_EQ(chunks->size(), 3u);
  EXPECT_EQ(ledger_->held_bytes(1), 12 * kMiB);
}

TEST_F(ChunkLedgerTest, GrantedDescriptorsAreTheCallersAndOutliveARelease) {
  ledger_->AddSession(1, 0);
  auto chunks = ledger_->Grant(1, 4 * kMiB, 4 * kMiB);
  ASSERT_TRUE(chunks.ok());
  ASSERT_EQ(chunks->size(), 1u);
  const int fd = (*chunks)[0].fd.get();
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(ledger_->Return(1, {(*chunks)[0].id}).ok());
  // The backend closed its own descriptor; the duplicate still works.
  struct stat st;
  ASSERT_EQ(fstat(fd, &st), 0);
  EXPECT_EQ(st.st_size, 4 * kMiB);
}

TEST_F(ChunkLedgerTest, GrantStopsAtTheGpusMemoryWithWhatItMade) {
  ledger_->AddSession(1, 0);
  ledger_->AddSession(2, 0);
  auto first = ledger_->Grant(1, 48 * kMiB, 48 * kMiB);
  ASSERT_TRUE(first.ok());
  // 16 MiB of the GPU's 64 are left though the budget says 48.
  auto second = ledger_->Grant(2, 48 * kMiB, 48 * kMiB);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->size(), 4u);
  EXPECT_EQ(backend_->allocated_bytes(0), 64 * kMiB);
}

TEST_F(ChunkLedgerTest, ASessionCannotReturnAnotherSessionsChunk) {
  ledger_->AddSession(1, 0);
  ledger_->AddSession(2, 0);
  auto mine = ledger_->Grant(1, 8 * kMiB, 8 * kMiB);
  auto theirs = ledger_->Grant(2, 4 * kMiB, 4 * kMiB);
  ASSERT_TRUE(mine.ok() && theirs.ok());
  const absl::Status s = ledger_->Return(1, {(*mine)[0].id, (*theirs)[0].id});
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  // All or nothing: not even session 1's own chunk went back.
  EXPECT_EQ(ledger_->held_bytes(1), 8 * kMiB);
  EXPECT_EQ(ledger_->held_bytes(2), 4 * kMiB);
  EXPECT_EQ(backend_->allocated_bytes(0), 12 * kMiB);
}

TEST_F(ChunkLedgerTest, ReturningTheSameChunkTwiceReleasesItOnce) {
  ledger_->AddSession(1, 0);
  auto chunks = ledger_->Grant(1, 8 * kMiB, 8 * kMiB);
  ASSERT_TRUE(chunks.ok());
  const uint64_t id = (*chunks)[0].id;
  EXPECT_TRUE(ledger_->Return(1, {id, id}).ok());
  EXPECT_EQ(ledger_->held_bytes(1), 4 * kMiB);
  EXPECT_EQ(ledger_->Return(1, {id}).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(backend_->allocated_bytes(0), 4 * kMiB);
}

TEST_F(ChunkLedgerTest, ReleasingASessionFreesItsChunksAndEndsItsGrants) {
  ledger_->AddSession(1, 1);
  ASSERT_TRUE(ledger_->Grant(1, 20 * kMiB, 20 * kMiB).ok());
  EXPECT_EQ(backend_->allocated_bytes(1), 20 * kMiB);
  EXPECT_EQ(ledger_->ReleaseSession(1), 20 * kMiB);
  EXPECT_EQ(backend_->allocated_bytes(1), 0);
  EXPECT_EQ(ledger_->Grant(1, 4 * kMiB, 4 * kMiB).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(ledger_->ReleaseSession(1), 0);
}

TEST_F(ChunkLedgerTest, UnknownSessionGetsNothing) {
  EXPECT_EQ(ledger_->Grant(7, 4 * kMiB, 4 * kMiB).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(ledger_->Return(7, {1}).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(backend_->allocated_bytes(0), 0);
}

TEST_F(ChunkLedgerTest, DestroyingTheLedgerReturnsEveryChunk) {
  ledger_->AddSession(1, 0);
  ledger_->AddSession(2, 1);
  ASSERT_TRUE(ledger_->Grant(1, 12 * kMiB, 12 * kMiB).ok());
  ASSERT_TRUE(ledger_->Grant(2, 8 * kMiB, 8 * kMiB).ok());
  ledger_.reset();
  EXPECT_EQ(backend_->allocated_bytes(0), 0);
  EXPECT_EQ(backend_->allocated_bytes(1), 0);
}

TEST_F(ChunkLedgerTest, ConcurrentSessionsNeverPassTheGpusMemory) {
  constexpr int kSessions = 6;
  for (int s = 1; s <= kSessions; ++s) ledger_->AddSession(s, 0);
  std::vector<std::thread> threads;
  for (int s = 1; s <= kSessions; ++s) {
    threads.emplace_back([this, s] {
      for (int round = 0; round < 50; ++round) {
        auto got = ledger_->Grant(s, 16 * kMiB, 16 * kMiB);
        if (!got.ok()) continue;
        std::vector<uint64_t> ids;
        for (const common::side::Grant& c : *got) ids.push_back(c.id);
        EXPECT_TRUE(ledger_->Return(s, ids).ok());
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(backend_->allocated_bytes(0), 0);
  for (int s = 1; s <= kSessions; ++s) EXPECT_EQ(ledger_->held_bytes(s), 0);
}

}  // namespace
}  // namespace deltad::daemon
