#include "daemon/host_pool.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/unix_socket.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace deltad::daemon {
namespace {

using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::SizeIs;

const int64_t kPage = ::sysconf(_SC_PAGESIZE);
const int64_t kSlab = 4 * kPage;

std::unique_ptr<HostPool> MakePool(int64_t slabs) {
  absl::StatusOr<std::unique_ptr<HostPool>> pool =
      HostPool::Create(slabs * kSlab, kSlab);
  EXPECT_TRUE(pool.ok()) << pool.status();
  return pool.ok() ? *std::move(pool) : nullptr;
}

// A shared, writable mapping of a whole slab; unmapped on destruction.
class Mapping {
 public:
  Mapping(int fd, int64_t bytes) : bytes_(bytes) {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    EXPECT_NE(p, MAP_FAILED) << "mmap of fd " << fd << ": " << errno;
    data_ = p == MAP_FAILED ? nullptr : static_cast<unsigned char*>(p);
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    if (data_ != nullptr) ::munmap(data_, bytes_);
  }
  unsigned char* data() const { return data_; }
  void Fill(unsigned char byte) const { std::memset(data_, byte, bytes_); }
  // Bytes in the mapping that are not `byte`.
  int64_t CountNot(unsigned char byte) const {
    return std::count_if(data_, data_ + bytes_,
                         [byte](unsigned char b) { return b != byte; });
  }

 private:
  unsigned char* data_ = nullptr;
  int64_t bytes_;
};

// --- Create -----------------------------------------------------------------

TEST(HostPoolCreate, RejectsZeroSlabSize) {
  auto pool = HostPool::Create(kSlab, 0);
  EXPECT_EQ(pool.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(pool.status().message(), HasSubstr("slab size"));
}

TEST(HostPoolCreate, RejectsSlabSizeNotAMultipleOfThePage) {
  auto pool = HostPool::Create(16 * kPage, kPage + 1);
  EXPECT_EQ(pool.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(pool.status().message(),
              HasSubstr("not a multiple of the page size"));
}

TEST(HostPoolCreate, RejectsZeroTotal) {
  auto pool = HostPool::Create(0, kSlab);
  EXPECT_EQ(pool.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(pool.status().message(), HasSubstr("total size"));
}

TEST(HostPoolCreate, RejectsTotalSmallerThanOneSlab) {
  auto pool = HostPool::Create(kSlab - kPage, kSlab);
  EXPECT_EQ(pool.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(pool.status().message(), HasSubstr("smaller than one slab"));
}

TEST(HostPoolCreate, RoundsTotalDownToWholeSlabs) {
  auto pool = HostPool::Create(3 * kSlab + kPage, kSlab);
  ASSERT_TRUE(pool.ok()) << pool.status();
  HostPoolStats s = (*pool)->Stats();
  EXPECT_EQ(s.total_bytes, 3 * kSlab);
  EXPECT_EQ(s.free_bytes, 3 * kSlab);
  EXPECT_EQ(s.free_slabs, 3);
  EXPECT_EQ(s.slab_bytes, kSlab);
}

TEST(HostPoolCreate, RefusesMoreSlabsThanTheDescriptorLimit) {
  // 2^40 slabs: far beyond any RLIMIT_NOFILE; must fail before allocating.
  auto pool = HostPool::Create(kSlab << 40, kSlab);
  EXPECT_EQ(pool.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(pool.status().message(), HasSubstr("RLIMIT_NOFILE"));
}

// --- Grant ------------------------------------------------------------------

TEST(HostPoolGrant, GrantsWholeSlabsWithinQuota) {
  auto pool = MakePool(8);
  ASSERT_NE(pool, nullptr);
  // 2.5 slabs of quota: two whole slabs, never a third.
  auto slabs = pool->Grant(1, 2 * kSlab + kSlab / 2);
  ASSERT_TRUE(slabs.ok()) << slabs.status();
  ASSERT_THAT(*slabs, SizeIs(2));
  std::set<uint64_t> ids;
  std::set<int> fds;
  for (const Slab& s : *slabs) {
    EXPECT_EQ(s.bytes, kSlab);
    struct stat st;
    ASSERT_EQ(::fstat(s.fd, &st), 0) << "slab " << s.id << " fd is not open";
    EXPECT_EQ(st.st_size, kSlab);
    ids.insert(s.id);
    fds.insert(s.fd);
  }
  EXPECT_THAT(ids, SizeIs(2));
  EXPECT_THAT(fds, SizeIs(2));
  EXPECT_EQ(pool->Stats().granted_bytes, 2 * kSlab);
}

TEST(HostPoolGrant, TopsUpToTheQuotaAndNoFurther) {
  auto pool = MakePool(8);
  ASSERT_NE(pool, nullptr);
  ASSERT_TRUE(pool->Grant(1, 2 * kSlab).ok());
  auto again = pool->Grant(1, 2 * kSlab);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_THAT(*again, IsEmpty());
  auto more = pool->Grant(1, 5 * kSlab);
  ASSERT_TRUE(more.ok()) << more.status();
  EXPECT_THAT(*more, SizeIs(3));
  auto smaller = pool->Grant(1, kSlab);
  ASSERT_TRUE(smaller.ok()) << smaller.status();
  EXPECT_THAT(*smaller, IsEmpty());
  EXPECT_THAT(pool->SlabsOf(1), SizeIs(5));
}

TEST(HostPoolGrant, RejectsAQuotaBelowOneSlab) {
  auto pool = MakePool(2);
  ASSERT_NE(pool, nullptr);
  for (int64_t quota : {int64_t{0}, int64_t{-1}, kSlab - 1}) {
    auto slabs = pool->Grant(1, quota);
    EXPECT_EQ(slabs.status().code(), absl::StatusCode::kInvalidArgument)
        << quota;
    EXPECT_THAT(slabs.status().message(), HasSubstr("smaller than one slab"));
  }
  EXPECT_EQ(pool->Stats().free_slabs, 2);
}

TEST(HostPoolGrant, ExhaustionSaysWhatIsFreeAndWhatWasAskedAndGrantsNothing) {
  auto pool = MakePool(3);
  ASSERT_NE(pool, nullptr);
  ASSERT_TRUE(pool->Grant(1, 2 * kSlab).ok());
  auto slabs = pool->Grant(2, 2 * kSlab);
  EXPECT_EQ(slabs.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(slabs.status().message(),
              HasSubstr(absl::StrCat("host pool has ", kSlab,
                                     " bytes free, asked ", 2 * kSlab)));
  // All or nothing: the one free slab is still free.
  EXPECT_THAT(pool->SlabsOf(2), IsEmpty());
  EXPECT_EQ(pool->Stats().free_slabs, 1);
}

TEST(HostPoolGrant, SlabsAreSealedAgainstShrinkingAndGrowing) {
  auto pool = MakePool(1);
  ASSERT_NE(pool, nullptr);
  auto slabs = pool->Grant(1, kSlab);
  ASSERT_TRUE(slabs.ok()) << slabs.status();
  const int fd = (*slabs)[0].fd;
  const int seals = ::fcntl(fd, F_GET_SEALS);
  EXPECT_TRUE(seals & F_SEAL_SHRINK);
  EXPECT_TRUE(seals & F_SEAL_GROW);
  EXPECT_FALSE(seals & F_SEAL_WRITE);
  EXPECT_NE(::ftruncate(fd, kPage), 0);
  EXPECT_EQ(errno, EPERM);
  EXPECT_NE(::ftruncate(fd, 2 * kSlab), 0);
  EXPECT_NE(::fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE), 0);
}

TEST(HostPoolGrant, SlabDescriptorsAreCloseOnExec) {
  auto pool = MakePool(1);
  ASSERT_NE(pool, nullptr);
  auto slabs = pool->Grant(1, kSlab);
  ASSERT_TRUE(slabs.ok()) << slabs.status();
  EXPECT_TRUE(::fcntl((*slabs)[0].fd, F_GETFD) & FD_CLOEXEC);
}

// --- Release ----------------------------------------------------------------

TEST(HostPoolRelease, ReturnsTheSessionsBytesToThePool) {
  auto pool = MakePool(4);
  ASSERT_NE(pool, nullptr);
  ASSERT_TRUE(pool->Grant(1, 3 * kSlab).ok());
  ASSERT_TRUE(pool->Grant(2, kSlab).ok());
  EXPECT_EQ(pool->Stats().free_bytes, 0);
  ASSERT_TRUE(pool->ReleaseSession(1).ok());
  HostPoolStats s = pool->Stats();
  EXPECT_EQ(s.free_bytes, 3 * kSlab);
  EXPECT_EQ(s.granted_bytes, kSlab);
  EXPECT_EQ(s.sessions, 1);
  EXPECT_THAT(pool->SlabsOf(1), IsEmpty());
  EXPECT_THAT(pool->SlabsOf(2), SizeIs(1));
  // What was released can be granted again.
  auto slabs = pool->Grant(3, 3 * kSlab);
  ASSERT_TRUE(slabs.ok()) << slabs.status();
  EXPECT_THAT(*slabs, SizeIs(3));
}

TEST(HostPoolRelease, ReleasingAnUnknownSessionIsANoOp) {
  auto pool = MakePool(2);
  ASSERT_NE(pool, nullptr);
  EXPECT_TRUE(pool->ReleaseSession(42).ok());
  ASSERT_TRUE(pool->Grant(1, kSlab).ok());
  ASSERT_TRUE(pool->ReleaseSession(1).ok());
  EXPECT_TRUE(pool->ReleaseSession(1).ok());
  EXPECT_EQ(pool->Stats().free_slabs, 2);
}

TEST(HostPoolRelease, ReGrantedSlabReadsZeros) {
  // Every slab is granted, so the second session must get the same ones.
  auto pool = MakePool(3);
  ASSERT_NE(pool, nullptr);
  auto first = pool->Grant(1, 3 * kSlab);
  ASSERT_TRUE(first.ok()) << first.status();
  std::set<uint64_t> first_ids;
  for (const Slab& s : *first) {
    Mapping m(s.fd, s.bytes);
    ASSERT_NE(m.data(), nullptr);
    m.Fill(0xA5);
    ASSERT_EQ(m.CountNot(0xA5), 0);
    first_ids.insert(s.id);
  }
  ASSERT_TRUE(pool->ReleaseSession(1).ok());

  auto second = pool->Grant(2, 3 * kSlab);
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_THAT(*second, SizeIs(3));
  for (const Slab& s : *second) {
    EXPECT_TRUE(first_ids.contains(s.id));
    Mapping m(s.fd, s.bytes);
    ASSERT_NE(m.data(), nullptr);
    EXPECT_EQ(m.CountNot(0), 0) << "slab " << s.id << " kept old data";
  }
}

TEST(HostPoolRelease, PreviousHolderCannotSeeTheNextSessionsData) {
  // A client keeps its descriptor after its session ends (it may be
  // malicious, or just slow to exit). It must neither read nor write what
  // the next session puts in the slab.
  auto pool = MakePool(1);
  ASSERT_NE(pool, nullptr);
  auto first = pool->Grant(1, kSlab);
  ASSERT_TRUE(first.ok()) << first.status();
  common::UniqueFd kept(::dup((*first)[0].fd));
  ASSERT_TRUE(kept.valid());
  Mapping old_view(kept.get(), kSlab);
  ASSERT_NE(old_view.data(), nullptr);
  old_view.Fill(0x11);
  ASSERT_TRUE(pool->ReleaseSession(1).ok());
  // The old holder's view was wiped too (hole punched).
  EXPECT_EQ(old_view.CountNot(0), 0);

  auto second = pool->Grant(2, kSlab);
  ASSERT_TRUE(second.ok()) << second.status();
  Mapping new_view((*second)[0].fd, kSlab);
  ASSERT_NE(new_view.data(), nullptr);
  new_view.Fill(0x22);
  EXPECT_EQ(old_view.CountNot(0x22), kSlab) << "old holder sees new data";
  old_view.Fill(0x33);
  EXPECT_EQ(new_view.CountNot(0x22), 0) << "old holder wrote into new data";
}

// --- Stats and SlabsOf
// --------------------------------------------------------

TEST(HostPoolStats, CountsBytesAndSlabsByState) {
  auto pool = MakePool(5);
  ASSERT_NE(pool, nullptr);
  ASSERT_TRUE(pool->Grant(7, 2 * kSlab).ok());
  ASSERT_TRUE(pool->Grant(8, kSlab).ok());
  HostPoolStats s = pool->Stats();
  EXPECT_EQ(s.total_bytes, 5 * kSlab);
  EXPECT_EQ(s.granted_bytes, 3 * kSlab);
  EXPECT_EQ(s.free_bytes, 2 * kSlab);
  EXPECT_EQ(s.granted_slabs, 3);
  EXPECT_EQ(s.free_slabs, 2);
  EXPECT_EQ(s.wiping_slabs, 0);
  EXPECT_EQ(s.retired_slabs, 0);
  EXPECT_EQ(s.sessions, 2);
}

TEST(HostPoolSlabsOf, ListsTheSessionsSlabsByIdAndNothingForOthers) {
  auto pool = MakePool(4);
  ASSERT_NE(pool, nullptr);
  auto a = pool->Grant(1, kSlab);
  auto b = pool->Grant(2, kSlab);
  auto c = pool->Grant(1, 2 * kSlab);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  std::vector<Slab> of1 = pool->SlabsOf(1);
  ASSERT_THAT(of1, SizeIs(2));
  EXPECT_LT(of1[0].id, of1[1].id);
  EXPECT_EQ(of1[0].id, (*a)[0].id);
  EXPECT_EQ(of1[1].id, (*c)[0].id);
  EXPECT_EQ(of1[0].fd, (*a)[0].fd);
  EXPECT_THAT(pool->SlabsOf(99), IsEmpty());
}

// --- Threads
// ------------------------------------------------------------------

TEST(HostPoolThreads, ConcurrentGrantsNeverOverGrant) {
  constexpr int kSlabs = 64;
  constexpr int kThreads = 40;  // each wants 2 slabs: 32 can have them
  auto pool = MakePool(kSlabs);
  ASSERT_NE(pool, nullptr);
  std::vector<absl::StatusOr<std::vector<Slab>>> results(
      kThreads, absl::UnknownError("not run"));
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      while (!go.load()) std::this_thread::yield();
      results[t] = pool->Grant(t, 2 * kSlab);
    });
  }
  go = true;
  for (std::thread& th : threads) th.join();

  int ok = 0;
  std::set<uint64_t> ids;
  for (int t = 0; t < kThreads; ++t) {
    if (results[t].ok()) {
      ++ok;
      ASSERT_THAT(*results[t], SizeIs(2));
      for (const Slab& s : *results[t]) {
        EXPECT_TRUE(ids.insert(s.id).second) << "slab " << s.id << " twice";
      }
    } else {
      EXPECT_EQ(results[t].status().code(),
                absl::StatusCode::kResourceExhausted)
          << results[t].status();
    }
  }
  EXPECT_EQ(ok, kSlabs / 2);
  HostPoolStats s = pool->Stats();
  EXPECT_EQ(s.granted_slabs, kSlabs);
  EXPECT_EQ(s.free_slabs, 0);
}

TEST(HostPoolThreads, GrantAndReleaseChurnKeepsTheBooksBalanced) {
  constexpr int kSlabs = 16;
  constexpr int kThreads = 8;
  constexpr int kRounds = 200;
  auto pool = MakePool(kSlabs);
  ASSERT_NE(pool, nullptr);
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int r = 0; r < kRounds; ++r) {
        const uint64_t session = t * 1000 + r;
        auto slabs = pool->Grant(session, (1 + (t + r) % 3) * kSlab);
        if (!slabs.ok() &&
            slabs.status().code() != absl::StatusCode::kResourceExhausted) {
          ++bad;
        }
        HostPoolStats s = pool->Stats();
        if (s.free_slabs + s.granted_slabs + s.wiping_slabs + s.retired_slabs !=
            kSlabs) {
          ++bad;
        }
        if (!pool->ReleaseSession(session).ok()) ++bad;
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
  HostPoolStats s = pool->Stats();
  EXPECT_EQ(s.free_slabs, kSlabs);
  EXPECT_EQ(s.sessions, 0);
}

// --- Lifetime
// -----------------------------------------------------------------

TEST(HostPoolLifetime, DestructorClosesEverySlabDescriptor) {
  std::vector<int> fds;
  {
    auto pool = MakePool(3);
    ASSERT_NE(pool, nullptr);
    auto slabs = pool->Grant(1, 2 * kSlab);
    ASSERT_TRUE(slabs.ok()) << slabs.status();
    for (const Slab& s : *slabs) fds.push_back(s.fd);
    // A released slab's replacement descriptor must be closed too.
    ASSERT_TRUE(pool->ReleaseSession(1).ok());
    auto again = pool->Grant(2, 3 * kSlab);
    ASSERT_TRUE(again.ok()) << again.status();
    fds.clear();
    for (const Slab& s : *again) fds.push_back(s.fd);
  }
  for (int fd : fds) {
    EXPECT_EQ(::fcntl(fd, F_GETFD), -1) << "fd " << fd << " still open";
  }
}

}  // namespace
}  // namespace deltad::daemon
