// The process allocator's C entry points (deltad_torch_malloc / free, the
// functions PyTorch's CUDAPluggableAllocator calls) over an attached client.
// The allocator is process-wide: every test leaves none attached.
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "client/deltad_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int kFailedPrecondition = 9;

deltad_client* Connect(int64_t budget, const char* device = "sim-chunks") {
  deltad_client_options o;
  deltad_client_options_init(&o);
  o.use_daemon = 0;
  o.device = device;
  o.fallback_budget_bytes = budget;
  o.sim_memory_bytes = int64_t{256} << 20;
  o.sim_d2h_bytes_per_second = 0;
  o.sim_h2d_bytes_per_second = 0;
  deltad_client* c = nullptr;
  EXPECT_EQ(deltad_client_connect(&o, &c), 0) << deltad_last_error();
  return c;
}

deltad_allocator_usage Usage() {
  deltad_allocator_usage u;
  EXPECT_EQ(deltad_allocator_stats(&u), 0);
  return u;
}

class TorchAllocatorTest : public ::testing::Test {
 protected:
  void TearDown() override {
    deltad_allocator_set_reclaim(nullptr, nullptr);
    (void)deltad_allocator_detach();
    for (deltad_client* c : clients_) deltad_client_close(c);
  }
  deltad_client* Attached(int64_t budget, const char* device = "sim-chunks") {
    deltad_client* c = Connect(budget, device);
    clients_.push_back(c);
    EXPECT_EQ(deltad_allocator_attach(c), 0) << deltad_last_error();
    return c;
  }
  // Tensor 1 of `bytes` filled with 0x33, unpinned, offloadable only.
  static bool TrackOffloadable(deltad_client* c, int64_t bytes) {
    deltad_tensor_info t{};
    t.id = 1;
    t.bytes = bytes;
    t.uncomputable = 1;
    void* tensor = nullptr;
    if (deltad_track(c, &t, nullptr, nullptr, &tensor) != 0) {
      ADD_FAILURE() << deltad_last_error();
      return false;
    }
    std::memset(tensor, 0x33, bytes);
    deltad_unpin(c, 1);
    return true;
  }
  std::vector<deltad_client*> clients_;
};

TEST_F(TorchAllocatorTest, MallocWithNothingAttachedReturnsNullAndSaysWhy) {
  EXPECT_EQ(deltad_torch_malloc(1024, 0, nullptr), nullptr);
  EXPECT_THAT(deltad_last_error(),
              AllOf(HasSubstr("no deltad client is attached"),
                    HasSubstr("deltad_allocator_attach")));
  EXPECT_EQ(Usage().attached, 0);
}

TEST_F(TorchAllocatorTest, ServesWritableMemoryAndCountsItInTheStats) {
  Attached(16 * kMiB);
  void* p = deltad_torch_malloc(3 * kMiB, 0, nullptr);
  ASSERT_NE(p, nullptr) << deltad_last_error();
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 256, 0u);
  std::memset(p, 0x7e, 3 * kMiB);
  void* q = deltad_torch_malloc(1000, 0, nullptr);
  ASSERT_NE(q, nullptr) << deltad_last_error();
  deltad_allocator_usage u = Usage();
  EXPECT_EQ(u.attached, 1);
  EXPECT_EQ(u.allocated_bytes, 3 * kMiB + 1000);
  EXPECT_EQ(u.device_bytes, 3 * kMiB + 1000);
  EXPECT_EQ(u.budget_bytes, 16 * kMiB);
  EXPECT_EQ(u.blocks, 2);
  deltad_torch_free(p, 3 * kMiB, 0, nullptr);
  deltad_torch_free(q, 1000, 0, nullptr);
  u = Usage();
  EXPECT_EQ(u.allocated_bytes, 0);
  EXPECT_EQ(u.blocks, 0);
  EXPECT_EQ(u.peak_device_bytes, 3 * kMiB + 1000);
}

TEST_F(TorchAllocatorTest, TheBudgetIsEnforcedWithAMessageAndFreeingMakesRoom) {
  Attached(4 * kMiB);
  void* a = deltad_torch_malloc(2 * kMiB, 0, nullptr);
  void* b = deltad_torch_malloc(2 * kMiB, 0, nullptr);
  ASSERT_NE(a, nullptr) << deltad_last_error();
  ASSERT_NE(b, nullptr) << deltad_last_error();
  EXPECT_EQ(deltad_torch_malloc(2 * kMiB, 0, nullptr), nullptr);
  EXPECT_THAT(deltad_last_error(),
              AllOf(HasSubstr("no room for 2097152 bytes"),
                    HasSubstr("budget of 4194304"), HasSubstr("4194304 held")));
  deltad_torch_free(b, 2 * kMiB, 0, nullptr);
  void* c = deltad_torch_malloc(2 * kMiB, 0, nullptr);
  EXPECT_NE(c, nullptr) << deltad_last_error();
  deltad_torch_free(a, 2 * kMiB, 0, nullptr);
  deltad_torch_free(c, 2 * kMiB, 0, nullptr);
}

TEST_F(TorchAllocatorTest, SizeZeroReturnsNullAndANegativeSizeIsAnError) {
  Attached(4 * kMiB);
  EXPECT_EQ(deltad_torch_malloc(0, 0, nullptr), nullptr);
  EXPECT_EQ(Usage().blocks, 0);
  EXPECT_EQ(deltad_torch_malloc(-1, 0, nullptr), nullptr);
  EXPECT_THAT(deltad_last_error(), HasSubstr("-1"));
  deltad_torch_free(nullptr, 0, 0, nullptr);  // ignored
}

TEST_F(TorchAllocatorTest, ASecondAttachIsRefusedUntilDetached) {
  deltad_client* first = Attached(4 * kMiB);
  deltad_client* second = Connect(4 * kMiB);
  clients_.push_back(second);
  EXPECT_EQ(deltad_allocator_attach(second), kFailedPrecondition);
  EXPECT_THAT(deltad_last_error(), HasSubstr("detach it first"));
  EXPECT_EQ(deltad_allocator_attach(first), kFailedPrecondition);
  EXPECT_EQ(deltad_allocator_detach(), 0);
  EXPECT_EQ(deltad_allocator_detach(), kFailedPrecondition);
  EXPECT_EQ(deltad_allocator_attach(second), 0) << deltad_last_error();
  EXPECT_EQ(deltad_allocator_attach(nullptr), 3);
}

TEST_F(TorchAllocatorTest, ABlockFreedAfterADetachGoesBackToItsOwnClient) {
  // Heap-backed clients: the second could otherwise free the first's
  // memory as its own.
  deltad_client* first = Attached(8 * kMiB, "sim");
  void* p = deltad_torch_malloc(kMiB, 0, nullptr);
  ASSERT_NE(p, nullptr) << deltad_last_error();
  ASSERT_EQ(deltad_allocator_detach(), 0);
  EXPECT_EQ(deltad_torch_malloc(kMiB, 0, nullptr), nullptr);
  deltad_client* second = Attached(8 * kMiB, "sim");
  void* q = deltad_torch_malloc(kMiB, 0, nullptr);
  ASSERT_NE(q, nullptr) << deltad_last_error();
  deltad_torch_free(p, kMiB, 0, nullptr);
  deltad_client_stats s;
  ASSERT_EQ(deltad_stats(first, &s), 0);
  EXPECT_EQ(s.device_bytes, 0);
  ASSERT_EQ(deltad_stats(second, &s), 0);
  EXPECT_EQ(s.device_bytes, kMiB);
  deltad_torch_free(q, kMiB, 0, nullptr);
  ASSERT_EQ(deltad_stats(second, &s), 0);
  EXPECT_EQ(s.device_bytes, 0);
}

TEST_F(TorchAllocatorTest, FreeingABlockOfAClosedClientIsIgnored) {
  deltad_client* c = Connect(8 * kMiB);
  ASSERT_EQ(deltad_allocator_attach(c), 0) << deltad_last_error();
  void* p = deltad_torch_malloc(kMiB, 0, nullptr);
  ASSERT_NE(p, nullptr) << deltad_last_error();
  deltad_client_close(c);  // detaches it; its memory goes with it
  EXPECT_EQ(Usage().attached, 0);
  EXPECT_EQ(Usage().blocks, 0);
  deltad_torch_free(p, kMiB, 0, nullptr);
  EXPECT_THAT(deltad_last_error(), HasSubstr("ignored"));
  EXPECT_EQ(deltad_allocator_detach(), kFailedPrecondition);
}

TEST_F(TorchAllocatorTest, StrayAndRepeatedFreesAreIgnored) {
  deltad_client* c = Attached(8 * kMiB);
  void* p = deltad_torch_malloc(kMiB, 0, nullptr);
  ASSERT_NE(p, nullptr) << deltad_last_error();
  int local = 0;
  deltad_torch_free(&local, sizeof(local), 0, nullptr);
  deltad_torch_free(static_cast<char*>(p) + 256, kMiB, 0, nullptr);
  EXPECT_EQ(Usage().allocated_bytes, kMiB);
  // A wrong size: the one recorded at allocation is freed.
  deltad_torch_free(p, 5, 0, nullptr);
  deltad_torch_free(p, kMiB, 0, nullptr);
  deltad_client_stats s;
  ASSERT_EQ(deltad_stats(c, &s), 0);
  EXPECT_EQ(s.device_bytes, 0);
}

TEST_F(TorchAllocatorTest, ConcurrentMallocAndFreeFromSeveralThreads) {
  Attached(64 * kMiB);
  constexpr int kThreads = 4;
  std::vector<std::thread> threads;
  std::vector<int> failures(kThreads, 0);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const int64_t sizes[] = {512, 64 << 10, 2 * kMiB, 4 * kMiB};
      std::vector<std::pair<void*, int64_t>> held;
      for (int i = 0; i < 400; ++i) {
        const int64_t bytes = sizes[(i * 7 + t) % 4];
        void* p = deltad_torch_malloc(bytes, t, nullptr);
        if (p == nullptr) {
          ++failures[static_cast<size_t>(t)];
          continue;
        }
        static_cast<unsigned char*>(p)[bytes - 1] =
            static_cast<unsigned char>(t);
        held.emplace_back(p, bytes);
        if (held.size() > 2) {  // a few live at once, freed out of order
          auto [q, n] = held[static_cast<size_t>(i) % held.size()];
          if (static_cast<unsigned char*>(q)[n - 1] != t) {
            ++failures[static_cast<size_t>(t)];
          }
          deltad_torch_free(q, n, t, nullptr);
          held.erase(held.begin() + static_cast<std::ptrdiff_t>(
                                        static_cast<size_t>(i) % held.size()));
        }
      }
      for (auto [q, n] : held) deltad_torch_free(q, n, t, nullptr);
    });
  }
  for (std::thread& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(failures[static_cast<size_t>(t)], 0) << "thread " << t;
  }
  const deltad_allocator_usage u = Usage();
  EXPECT_EQ(u.allocated_bytes, 0);
  EXPECT_EQ(u.blocks, 0);
  EXPECT_LE(u.peak_device_bytes, 64 * kMiB);
}

TEST_F(TorchAllocatorTest, ATrackedTensorIsOffloadedForAnAllocation) {
  deltad_client* c = Attached(8 * kMiB);
  ASSERT_TRUE(TrackOffloadable(c, 4 * kMiB));
  void* p = deltad_torch_malloc(6 * kMiB, 0, nullptr);
  ASSERT_NE(p, nullptr) << deltad_last_error();
  EXPECT_EQ(deltad_resident(c, 1), 0);
  deltad_torch_free(p, 6 * kMiB, 0, nullptr);
  void* back = nullptr;
  ASSERT_EQ(deltad_pin(c, 1, &back), 0) << deltad_last_error();
  EXPECT_EQ(static_cast<unsigned char*>(back)[12345], 0x33);
  deltad_unpin(c, 1);
  EXPECT_EQ(deltad_free(c, 1), 0);
}

// What a reclaim callback saw and does: frees the blocks it holds.
struct Reclaimer {
  std::vector<void*> blocks;  // each `block_bytes`, freed when asked
  int64_t block_bytes = 0;
  int calls = 0;
  std::vector<int64_t> asked;
  bool allocate_inside = false;  // tries an allocation of its own first
  void* inner = nullptr;
};

int64_t Reclaim(int64_t bytes, void* ctx) {
  auto* r = static_cast<Reclaimer*>(ctx);
  ++r->calls;
  r->asked.push_back(bytes);
  if (r->allocate_inside) r->inner = deltad_torch_malloc(bytes, 0, nullptr);
  if (r->blocks.empty()) return 0;
  deltad_torch_free(r->blocks.back(), r->block_bytes, 0, nullptr);
  r->blocks.pop_back();
  return r->block_bytes;
}

TEST_F(TorchAllocatorTest, AnAllocationTheBudgetCannotHoldAsksTheCallback) {
  Attached(8 * kMiB);
  Reclaimer r;
  r.block_bytes = 2 * kMiB;
  for (int i = 0; i < 3; ++i) {
    r.blocks.push_back(deltad_torch_malloc(2 * kMiB, 0, nullptr));
    ASSERT_NE(r.blocks.back(), nullptr) << deltad_last_error();
  }
  const deltad_allocator_usage before = Usage();
  ASSERT_EQ(deltad_allocator_set_reclaim(&Reclaim, &r), 0);
  // 6 MiB held of 8: room for 2 MiB without the callback; 6 MiB needs two
  // of its blocks freed, one per call.
  void* small = deltad_torch_malloc(2 * kMiB, 0, nullptr);
  ASSERT_NE(small, nullptr) << deltad_last_error();
  EXPECT_EQ(r.calls, 0);
  deltad_torch_free(small, 2 * kMiB, 0, nullptr);
  void* p = deltad_torch_malloc(6 * kMiB, 0, nullptr);
  ASSERT_NE(p, nullptr) << deltad_last_error();
  EXPECT_EQ(r.calls, 2);
  // What the budget lacked each time: 4 MiB, then 2.
  EXPECT_THAT(r.asked, ::testing::ElementsAre(4 * kMiB, 2 * kMiB));
  EXPECT_EQ(r.blocks.size(), 1u);
  const deltad_allocator_usage after = Usage();
  EXPECT_EQ(after.reclaims - before.reclaims, 2);
  EXPECT_EQ(after.reclaimed_bytes - before.reclaimed_bytes, 4 * kMiB);
  EXPECT_EQ(after.allocated_bytes, 8 * kMiB);
  deltad_torch_free(p, 6 * kMiB, 0, nullptr);
  deltad_torch_free(r.blocks.back(), 2 * kMiB, 0, nullptr);
}

TEST_F(TorchAllocatorTest, TheCallbackMakesRoomBeforeTrackedTensorsGo) {
  deltad_client* c = Attached(8 * kMiB);
  ASSERT_TRUE(TrackOffloadable(c, 4 * kMiB));
  Reclaimer r;
  r.block_bytes = 2 * kMiB;
  r.blocks.push_back(deltad_torch_malloc(2 * kMiB, 0, nullptr));
  ASSERT_NE(r.blocks.back(), nullptr) << deltad_last_error();
  ASSERT_EQ(deltad_allocator_set_reclaim(&Reclaim, &r), 0);
  // 6 MiB held of 8, 4 asked: the callback's 2 MiB go, the tracked tensor
  // stays (the slow path would have offloaded it instead).
  void* p = deltad_torch_malloc(4 * kMiB, 0, nullptr);
  ASSERT_NE(p, nullptr) << deltad_last_error();
  EXPECT_EQ(r.calls, 1);
  EXPECT_EQ(deltad_resident(c, 1), 1);
  // With nothing left to reclaim, the slow path offloads it as before.
  void* q = deltad_torch_malloc(4 * kMiB, 0, nullptr);
  ASSERT_NE(q, nullptr) << deltad_last_error();
  EXPECT_EQ(r.calls, 2);
  EXPECT_EQ(deltad_resident(c, 1), 0);
  deltad_torch_free(p, 4 * kMiB, 0, nullptr);
  deltad_torch_free(q, 4 * kMiB, 0, nullptr);
  EXPECT_EQ(deltad_free(c, 1), 0);
}

TEST_F(TorchAllocatorTest, ACallbackThatFreesNothingLeavesTheBudgetsRefusal) {
  Attached(4 * kMiB);
  void* held = deltad_torch_malloc(4 * kMiB, 0, nullptr);
  ASSERT_NE(held, nullptr) << deltad_last_error();
  Reclaimer r;
  ASSERT_EQ(deltad_allocator_set_reclaim(&Reclaim, &r), 0);
  EXPECT_EQ(deltad_torch_malloc(2 * kMiB, 0, nullptr), nullptr);
  EXPECT_EQ(r.calls, 1);
  EXPECT_THAT(r.asked, ::testing::ElementsAre(2 * kMiB));
  EXPECT_THAT(deltad_last_error(), HasSubstr("no room for 2097152 bytes"));
  // Removed: not asked again.
  ASSERT_EQ(deltad_allocator_set_reclaim(nullptr, &r), 0);
  EXPECT_EQ(deltad_torch_malloc(2 * kMiB, 0, nullptr), nullptr);
  EXPECT_EQ(r.calls, 1);
  deltad_torch_free(held, 4 * kMiB, 0, nullptr);
}

TEST_F(TorchAllocatorTest, TheCallbacksOwnAllocationDoesNotCallItAgain) {
  Attached(4 * kMiB);
  Reclaimer r;
  r.block_bytes = 4 * kMiB;
  r.blocks.push_back(deltad_torch_malloc(4 * kMiB, 0, nullptr));
  ASSERT_NE(r.blocks.back(), nullptr) << deltad_last_error();
  r.allocate_inside = true;
  ASSERT_EQ(deltad_allocator_set_reclaim(&Reclaim, &r), 0);
  void* p = deltad_torch_malloc(2 * kMiB, 0, nullptr);
  ASSERT_NE(p, nullptr) << deltad_last_error();
  // The inner allocation (made before the callback freed anything) failed
  // without recursing; the outer one got the freed room.
  EXPECT_EQ(r.calls, 1);
  EXPECT_EQ(r.inner, nullptr);
  deltad_torch_free(p, 2 * kMiB, 0, nullptr);
}

TEST_F(TorchAllocatorTest, MallocOrRaiseThrowsTheBudgetsMessageInsteadOfNull) {
  Attached(4 * kMiB);
  void* p = deltad_torch_malloc_or_raise(4 * kMiB, 0, nullptr);
  ASSERT_NE(p, nullptr) << deltad_last_error();
  EXPECT_EQ(deltad_torch_malloc_or_raise(0, 0, nullptr), nullptr);
  std::string message;
  try {
    deltad_torch_malloc_or_raise(2 * kMiB, 0, nullptr);
  } catch (const std::exception& e) {
    message = e.what();
  }
  EXPECT_THAT(message, AllOf(HasSubstr("no room for 2097152 bytes"),
                             HasSubstr("budget of 4194304")));
  deltad_torch_free(p, 4 * kMiB, 0, nullptr);
}

TEST_F(TorchAllocatorTest, ThePeakOfLiveBlocksRestartsWhereItIsReset) {
  Attached(16 * kMiB);
  void* a = deltad_torch_malloc(4 * kMiB, 0, nullptr);
  void* b = deltad_torch_malloc(2 * kMiB, 0, nullptr);
  ASSERT_NE(b, nullptr) << deltad_last_error();
  deltad_torch_free(b, 2 * kMiB, 0, nullptr);
  EXPECT_GE(Usage().peak_allocated_bytes, 6 * kMiB);
  ASSERT_EQ(deltad_allocator_reset_peak(), 0);
  EXPECT_EQ(Usage().peak_allocated_bytes, 4 * kMiB);  // what is live
  void* c = deltad_torch_malloc(kMiB, 0, nullptr);
  deltad_torch_free(c, kMiB, 0, nullptr);
  EXPECT_EQ(Usage().peak_allocated_bytes, 5 * kMiB);
  deltad_torch_free(a, 4 * kMiB, 0, nullptr);
  ASSERT_EQ(deltad_allocator_reset_peak(), 0);
  EXPECT_EQ(Usage().peak_allocated_bytes, 0);
}

}  // namespace
