#include "tools/table.h"

#include "gtest/gtest.h"

namespace deltad::tools {
namespace {

TEST(FormatBytes, PicksTheLargestBinaryUnitBelowTheSize) {
  EXPECT_EQ(FormatBytes(0), "0 B");
  EXPECT_EQ(FormatBytes(1023), "1023 B");
  EXPECT_EQ(FormatBytes(1536), "1.5 KiB");
  EXPECT_EQ(FormatBytes(int64_t{64} << 20), "64.0 MiB");
  EXPECT_EQ(FormatBytes(int64_t{9} << 30), "9.0 GiB");
  EXPECT_EQ(FormatBytes(int64_t{3} << 40), "3.0 TiB");
  // Just below a unit rounds up into the next one, not to "1024.0 MiB".
  EXPECT_EQ(FormatBytes((int64_t{1} << 30) - 1), "1.0 GiB");
  EXPECT_EQ(FormatBytes(-(int64_t{2} << 20)), "-2.0 MiB");
}

TEST(FormatDuration, ScalesToTheMagnitude) {
  EXPECT_EQ(FormatDuration(850), "850 ns");
  EXPECT_EQ(FormatDuration(12'500), "12.5 us");
  EXPECT_EQ(FormatDuration(3'200'000), "3.2 ms");
  EXPECT_EQ(FormatDuration(4'000'000'000), "4.0 s");
  EXPECT_EQ(FormatDuration(int64_t{150'000'000'000}), "2.5 min");
  EXPECT_EQ(FormatDuration(int64_t{7'200'000'000'000}), "2.0 h");
}

TEST(FormatGBps, IsDecimalGigabytes) {
  EXPECT_EQ(FormatGBps(25e9), "25.0");
  EXPECT_EQ(FormatGBps(12.34e9), "12.3");
}

TEST(Printable, ReplacesControlCharacters) {
  EXPECT_EQ(Printable("job\x1b[2J\n7"), "job?[2J?7");
  EXPECT_EQ(Printable("rank 3 \xc3\xa9t\xc3\xa9"), "rank 3 \xc3\xa9t\xc3\xa9");
}

TEST(Table, AlignsColumnsAndTrimsTrailingBlanks) {
  Table t({{"ID", Table::Align::kRight},
           {"LABEL", Table::Align::kLeft},
           {"SIZE", Table::Align::kRight}});
  t.AddRow({"1", "train", "9.0 GiB"});
  t.AddRow({"12", "a", "64.0 MiB"});
  t.AddRow({"3"});  // missing cells are blank
  EXPECT_EQ(t.rows(), 3u);
  EXPECT_EQ(t.Render(),
            "ID  LABEL      SIZE\n"
            " 1  train   9.0 GiB\n"
            "12  a      64.0 MiB\n"
            " 3\n");
}

TEST(Table, CountsCharactersNotBytes) {
  Table t({{"A", Table::Align::kLeft}, {"B", Table::Align::kLeft}});
  t.AddRow({"\xc3\xa9t\xc3\xa9", "x"});  // "été": 3 characters, 5 bytes
  t.AddRow({"abcd", "y"});
  EXPECT_EQ(t.Render(),
            "A     B\n"
            "\xc3\xa9t\xc3\xa9   x\n"
            "abcd  y\n");
}

}  // namespace
}  // namespace deltad::tools
