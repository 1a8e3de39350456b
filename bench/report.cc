#include "bench/report.h"

#include <ctime>
#include <fstream>
#include <sstream>

namespace deltad::bench {

std::string CpuModel() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      return line.substr(line.find(':') + 2);
    }
  }
  return "unknown CPU";
}

std::string Today() {
  const std::time_t now = std::time(nullptr);
  char date[32];
  std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
  return date;
}

bool UpdateDocSection(const std::string& path, const std::string& tag,
                      const std::string& section) {
  const std::string begin = "<!-- " + tag + ":begin -->";
  const std::string end = "<!-- " + tag + ":end -->";
  std::string doc;
  {
    std::ifstream in(path);
    std::stringstream ss;
    ss << in.rdbuf();
    doc = ss.str();
  }
  const std::string block = begin + "\n" + section + end;
  const auto b = doc.find(begin);
  const auto e = doc.find(end);
  if (b != std::string::npos && e != std::string::npos && e > b) {
    doc.replace(b, e + end.size() - b, block);
  } else {
    doc += "\n" + block + "\n";
  }
  std::ofstream out(path, std::ios::trunc);
  out << doc;
  return static_cast<bool>(out);
}

}  // namespace deltad::bench
