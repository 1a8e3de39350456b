#include "tools/table.h"

#include <algorithm>
#include <cstdlib>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace deltad::tools {

namespace {

// UTF-8 characters in `s`: bytes that are not continuation bytes.
size_t Width(absl::string_view s) {
  return static_cast<size_t>(std::count_if(s.begin(), s.end(), [](char c) {
    return (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  }));
}

}  // namespace

std::string FormatBytes(int64_t bytes) {
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
  // Negative sizes should not occur, but a wrong sign must show, not wrap.
  const char* sign = bytes < 0 ? "-" : "";
  const double magnitude = std::abs(static_cast<double>(bytes));
  if (magnitude < 1024) return absl::StrCat(bytes, " B");
  double value = magnitude / 1024;
  size_t unit = 0;
  // Rounding to one decimal can reach 1024.0: move up a unit before that.
  while (value >= 1023.95 && unit + 1 < std::size(kUnits)) {
    value /= 1024;
    ++unit;
  }
  return absl::StrFormat("%s%.1f %s", sign, value, kUnits[unit]);
}

std::string FormatGBps(double bytes_per_second) {
  return absl::StrFormat("%.1f", bytes_per_second / 1e9);
}

std::string FormatDuration(int64_t ns) {
  const double v = static_cast<double>(ns);
  if (ns < 1000) return absl::StrCat(ns, " ns");
  if (ns < 1'000'000) return absl::StrFormat("%.1f us", v / 1e3);
  if (ns < 1'000'000'000) return absl::StrFormat("%.1f ms", v / 1e6);
  if (ns < int64_t{60'000'000'000}) return absl::StrFormat("%.1f s", v / 1e9);
  if (ns < int64_t{3'600'000'000'000}) {
    return absl::StrFormat("%.1f min", v / 60e9);
  }
  return absl::StrFormat("%.1f h", v / 3600e9);
}

std::string Printable(absl::string_view text) {
  std::string out(text);
  for (char& c : out) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7F) c = '?';
  }
  return out;
}

void Table::AddRow(std::vector<std::string> cells) {
  cells.resize(columns_.size());
  rows_.push_back(std::move(cells));
}

std::string Table::Render() const {
  std::vector<size_t> widths(columns_.size());
  for (size_t c = 0; c < columns_.size(); ++c) {
    widths[c] = Width(columns_[c].title);
    for (const auto& row : rows_) {
      widths[c] = std::max(widths[c], Width(row[c]));
    }
  }
  std::string out;
  auto line = [&](auto cell_of) {
    std::string text;
    for (size_t c = 0; c < columns_.size(); ++c) {
      const std::string& cell = cell_of(c);
      const std::string pad(widths[c] - Width(cell), ' ');
      if (c > 0) text += "  ";
      if (columns_[c].align == Align::kRight) {
        absl::StrAppend(&text, pad, cell);
      } else {
        absl::StrAppend(&text, cell, pad);
      }
    }
    text.erase(text.find_last_not_of(' ') + 1);
    absl::StrAppend(&out, text, "\n");
  };
  line([&](size_t c) -> const std::string& { return columns_[c].title; });
  for (const auto& row : rows_) {
    line([&](size_t c) -> const std::string& { return row[c]; });
  }
  return out;
}

}  // namespace deltad::tools
