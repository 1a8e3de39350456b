#include "common/side_protocol.h"

#include <cstdint>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace deltad::common::side {
namespace {

TEST(SideProtocol, RecordsRoundTripAndRejectBadSizes) {
  auto r = DecodeRecord(EncodeRecord({.id = 42, .bytes = 2 << 20}));
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->id, 42u);
  EXPECT_EQ(r->bytes, 2 << 20);
  EXPECT_FALSE(DecodeRecord(EncodeRecord({.id = 1, .bytes = 0})));
  EXPECT_FALSE(DecodeRecord(EncodeRecord({.id = 1, .bytes = -5})));
  EXPECT_FALSE(DecodeRecord("short"));
}

TEST(SideProtocol, ChunksWantedNeedsATokenAndNoNegativeTarget) {
  auto w = DecodeChunksWanted(EncodeChunksWanted({"tok", 1 << 30}));
  ASSERT_TRUE(w.has_value());
  EXPECT_EQ(w->session_token, "tok");
  EXPECT_EQ(w->target_bytes, 1 << 30);
  EXPECT_FALSE(DecodeChunksWanted(EncodeChunksWanted({"", 1})));
  EXPECT_FALSE(DecodeChunksWanted(EncodeChunksWanted({"tok", -1})));
  EXPECT_FALSE(DecodeChunksWanted(""));
}

TEST(SideProtocol, ChunksReturnedRoundTripsAndRejectsTornPayloads) {
  const std::vector<uint64_t> ids = {1, 7, uint64_t{1} << 40};
  auto r = DecodeChunksReturned(EncodeChunksReturned({"token", ids}));
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->session_token, "token");
  EXPECT_EQ(r->chunk_ids, ids);
  // An empty list is well formed.
  auto none = DecodeChunksReturned(EncodeChunksReturned({"token", {}}));
  ASSERT_TRUE(none.has_value());
  EXPECT_TRUE(none->chunk_ids.empty());
  // Torn id, no token, a token length past the payload, nothing at all.
  EXPECT_FALSE(
      DecodeChunksReturned(EncodeChunksReturned({"token", ids}) + "x"));
  EXPECT_FALSE(DecodeChunksReturned(EncodeChunksReturned({"", ids})));
  EXPECT_FALSE(DecodeChunksReturned(std::string("\xff\xff\x00\x00tok", 7)));
  EXPECT_FALSE(DecodeChunksReturned(""));
}

TEST(SideProtocol, ReturnedIdsPerMessageFitTheMessageLimit) {
  const std::string token(64, 't');
  const size_t n = MaxReturnedPerMessage(token.size());
  ASSERT_GT(n, 0u);
  const std::vector<uint64_t> ids(n, 9);
  EXPECT_LE(EncodeChunksReturned({token, ids}).size(), kMaxMessageBytes);
  const std::vector<uint64_t> one_more(n + 1, 9);
  EXPECT_GT(EncodeChunksReturned({token, one_more}).size(), kMaxMessageBytes);
  EXPECT_EQ(MaxReturnedPerMessage(kMaxMessageBytes), 0u);
}

}  // namespace
}  // namespace deltad::common::side
