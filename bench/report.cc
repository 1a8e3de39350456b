#include "bench/report.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <sstream>

namespace deltad::bench {

Percentiles Summarise(std::vector<double> v) {
  Percentiles p;
  if (v.empty()) return p;
  std::sort(v.begin(), v.end());
  const auto at = [&](double q) {
    const auto rank = static_cast<size_t>(std::ceil(q * v.size()));
    return v[std::clamp<size_t>(rank, 1, v.size()) - 1];
  };
  p.p50 = at(0.50);
  p.p99 = at(0.99);
  double sum = 0;
  for (double x : v) sum += x;
  p.mean = sum / static_cast<double>(v.size());
  return p;
}

std::string Verdict(bool met) { return met ? "met" : "**MISSED**"; }

std::string CommandLine(const std::string& binary, int argc, char** argv) {
  std::string command = "build/bench/" + binary;
  for (int i = 1; i < argc; ++i) command += std::string(" ") + argv[i];
  if (const char* via = std::getenv("DELTAD_BENCH_COMMAND")) command = via;
  return command;
}

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

double MachineBusySeconds() {
  std::ifstream in("/proc/stat");
  std::string cpu;
  in >> cpu;
  int64_t ticks[8] = {};  // user nice system idle iowait irq softirq steal
  for (int64_t& t : ticks) in >> t;
  int64_t busy = 0;
  for (int i = 0; i < 8; ++i) {
    if (i != 3 && i != 4) busy += ticks[i];
  }
  return static_cast<double>(busy) / static_cast<double>(sysconf(_SC_CLK_TCK));
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

bool PrintReport(const std::string& report, const std::string& doc,
                 const std::string& tag) {
  std::printf("%s", report.c_str());
  std::fflush(stdout);
  return doc.empty() || UpdateDocSection(doc, tag, report);
}

}  // namespace deltad::bench
