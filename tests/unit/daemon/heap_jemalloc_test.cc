// The daemon's heap accounting and return where jemalloc is its malloc
// (this test links jemalloc as deltad does; built where the build found it).
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "daemon/heap_return.h"
#include "gtest/gtest.h"

namespace deltad::daemon {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

// Allocates and touches `mib` blocks of 1 MiB, as a burst of sessions
// would, and frees them.
class Burst {
 public:
  explicit Burst(int mib) {
    for (int i = 0; i < mib; ++i) {
      void* p = std::malloc(kMiB);
      std::memset(p, 1, kMiB);
      blocks_.push_back(p);
    }
  }
  ~Burst() { Free(); }
  void Free() {
    for (void* p : blocks_) std::free(p);
    blocks_.clear();
  }

 private:
  std::vector<void*> blocks_;
};

TEST(HeapJemallocTest, TheDaemonsAllocatorIsNamedWithHowItReturnsMemory) {
  const std::string name = HeapAllocatorName();
  EXPECT_EQ(name.rfind("jemalloc ", 0), 0u) << name;
  EXPECT_NE(name.find("returned"), std::string::npos) << name;
  // Its arenas are fixed when it starts: the glibc cap does not apply.
  EXPECT_EQ(LimitHeapArenas(2), 0);
}

TEST(HeapJemallocTest, HeapInUseFollowsWhatIsHeldNotWhatWasOnceHeld) {
  const int64_t before = HeapInUseBytes();
  ASSERT_GE(before, 0);
  Burst burst(64);
  // Within a MiB: small blocks cached per thread count as free to it.
  EXPECT_GE(HeapInUseBytes(), before + 63 * kMiB);
  burst.Free();
  EXPECT_LT(HeapInUseBytes(), before + 8 * kMiB);
}

TEST(HeapJemallocTest, ATrimGivesTheFreedPagesBack) {
  { Burst burst(64); }
  // Without the daemon's configuration, freed pages stay dirty for jemalloc's
  // default 10 s: most of the burst is still there.
  EXPECT_GE(HeapFreeBytes(), 32 * kMiB);
  TrimHeap();
  EXPECT_LT(HeapFreeBytes(), 4 * kMiB);
}

}  // namespace
}  // namespace deltad::daemon
