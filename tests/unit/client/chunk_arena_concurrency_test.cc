// A ChunkArena shared by threads allocating and freeing at once.

#include <cstdint>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "client/chunk_arena.h"
#include "gtest/gtest.h"
#include "tests/unit/client/chunk_arena_test_helpers.h"

namespace deltad::client {
namespace {

using absl::StatusCode;

TEST(ChunkArena, ConcurrentAllocationsKeepTheirBytes) {
  SimSetup s(48);
  constexpr int kThreads = 4;
  constexpr int kRounds = 1000;
  std::vector<std::thread> threads;
  std::vector<int> failures(kThreads, 0);
  // Per thread, how many small and large allocations succeeded.
  std::vector<int> small_ok(kThreads, 0);
  std::vector<int> large_ok(kThreads, 0);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(static_cast<unsigned>(t) + 1);
      std::uniform_int_distribution<int64_t> small(1, kChunk / 2 - 1);
      std::uniform_int_distribution<int64_t> large(kChunk / 2, 3 * kChunk);
      struct Live {
        unsigned char* data;
        int64_t bytes;
        unsigned char tag;
      };
      std::vector<Live> live;
      auto check_and_free = [&](size_t i) {
        const auto [p, bytes, tag] = live[i];
        for (int64_t j = 0; j < bytes; j += 97) {
          if (p[j] != tag) ++failures[static_cast<size_t>(t)];
        }
        if (p[bytes - 1] != tag) ++failures[static_cast<size_t>(t)];
        s.arena->Free(p, bytes);
        live[i] = live.back();
        live.pop_back();
      };
      for (int round = 0; round < kRounds; ++round) {
        const int64_t bytes = rng() % 4 == 0 ? large(rng) : small(rng);
        auto p = s.arena->Allocate(bytes);
        if (p.ok()) {
          auto* data = static_cast<unsigned char*>(*p);
          const auto tag = static_cast<unsigned char>(rng());
          std::memset(data, tag, static_cast<size_t>(bytes));
          live.push_back(Live{data, bytes, tag});
          ++(bytes < kChunk / 2 ? small_ok : large_ok)[static_cast<size_t>(t)];
        } else if (p.status().code() != StatusCode::kResourceExhausted) {
          ++failures[static_cast<size_t>(t)];
        }
        if (!live.empty() && (live.size() >= 6 || rng() % 2 == 0 || !p.ok())) {
          check_and_free(rng() % live.size());
        }
      }
      while (!live.empty()) check_and_free(live.size() - 1);
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (size_t t = 0; t < kThreads; ++t) {
    EXPECT_EQ(failures[t], 0) << t;
    EXPECT_GT(small_ok[t], 0) << t;
    EXPECT_GT(large_ok[t], 0) << t;
  }
  EXPECT_EQ(s.arena->allocated_bytes(), 0);
  EXPECT_EQ(s.arena->free_bytes(), 48 * kChunk);
}

}  // namespace
}  // namespace deltad::client
