#include "policies/free_slots.h"

#include <cstdint>
#include <random>
#include <set>

#include "gtest/gtest.h"

namespace deltad::policy {
namespace {

TEST(FreeSlots, HandsOutTheLowestFreeSlotFirst) {
  FreeSlots free;
  for (uint32_t s : {900000u, 7u, 64u, 4095u, 4096u, 262144u}) free.insert(s);
  EXPECT_EQ(free.size(), 6u);
  EXPECT_TRUE(free.contains(4096));
  EXPECT_FALSE(free.contains(4097));
  EXPECT_FALSE(free.contains(5000000));  // beyond what it ever held
  for (uint32_t want : {7u, 64u, 4095u, 4096u, 262144u, 900000u}) {
    EXPECT_EQ(free.PopLowest(), want);
  }
  EXPECT_TRUE(free.empty());
}

TEST(FreeSlots, AgreesWithAnOrderedSetUnderRandomUse) {
  // Slots over several top-level words, so every level fills and empties.
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> any(0, 700000);
  FreeSlots free;
  std::set<uint32_t> want;
  for (int i = 0; i < 200000; ++i) {
    const int op = static_cast<int>(rng() % 4);
    if (op < 2) {
      const uint32_t s = any(rng);
      if (want.insert(s).second) free.insert(s);
    } else if (op == 2 && !want.empty()) {
      ASSERT_EQ(free.PopLowest(), *want.begin()) << i;
      want.erase(want.begin());
    } else if (!want.empty()) {
      auto it = want.lower_bound(any(rng));
      if (it == want.end()) continue;
      free.erase(*it);
      want.erase(it);
    }
    ASSERT_EQ(free.size(), want.size());
  }
  for (uint32_t s : want) ASSERT_TRUE(free.contains(s)) << s;
  while (!want.empty()) {
    ASSERT_EQ(free.PopLowest(), *want.begin());
    want.erase(want.begin());
  }
  EXPECT_TRUE(free.empty());
}

}  // namespace
}  // namespace deltad::policy
