#ifndef DELTAD_TOOLS_TABLE_H_
#define DELTAD_TOOLS_TABLE_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"

namespace deltad::tools {

// Sizes as operators read them: "512 B", "1.5 KiB", "64.0 MiB", "9.0 GiB".
std::string FormatBytes(int64_t bytes);
// Bytes per second in decimal gigabytes, as link speeds are quoted: "25.0".
std::string FormatGBps(double bytes_per_second);
// A duration at a readable scale: "850 ns", "12.5 us", "3.2 ms", "4.0 s",
// "2.5 min", "1.2 h".
std::string FormatDuration(int64_t ns);
// Text that came from a client (labels) made safe for a terminal: control
// characters become '?', so a label cannot move the cursor or recolour the
// operator's screen.
std::string Printable(absl::string_view text);

// A plain-text table: a header row and aligned columns, two spaces apart,
// no trailing blanks. Widths count UTF-8 characters, not bytes.
class Table {
 public:
  enum class Align { kLeft, kRight };
  struct Column {
    std::string title;
    Align align = Align::kLeft;
  };

  explicit Table(std::vector<Column> columns) : columns_(std::move(columns)) {}

  // Missing cells are blank; cells beyond the columns are dropped.
  void AddRow(std::vector<std::string> cells);
  size_t rows() const { return rows_.size(); }
  // Every line ends in '\n'.
  std::string Render() const;

 private:
  std::vector<Column> columns_;
  std::vector<std::vector<std::string>> rows_;
};

}  // namespace deltad::tools

#endif  // DELTAD_TOOLS_TABLE_H_
