#include "bench/soak_figures.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "bench/soak_process.h"

namespace deltad::bench {
namespace {

std::string LabelValue(absl::string_view labels, absl::string_view name) {
  const std::string key = absl::StrCat(name, "=\"");
  const size_t at = labels.find(key);
  if (at == absl::string_view::npos) return "";
  const size_t start = at + key.size();
  const size_t end = labels.find('"', start);
  return std::string(labels.substr(start, end - start));
}

}  // namespace

int64_t StatusField(pid_t pid, const std::string& field) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) {
      int64_t value = 0;
      (void)absl::SimpleAtoi(
          absl::StripAsciiWhitespace(absl::StripSuffix(
              absl::string_view(line).substr(field.size() + 1), "kB")),
          &value);
      return value;
    }
  }
  return -1;
}

int64_t RssKib(pid_t pid) { return StatusField(pid, "VmRSS"); }

int CountFds(pid_t pid) {
  DIR* dir = opendir(absl::StrCat("/proc/", pid, "/fd").c_str());
  if (dir == nullptr) return -1;
  int n = 0;
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] != '.') ++n;
  }
  closedir(dir);
  return n;
}

double CpuSeconds(pid_t pid) {
  const std::string stat = ReadFile(absl::StrCat("/proc/", pid, "/stat"));
  // The command name may hold spaces; fields count from after its ')'.
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return 0;
  std::vector<std::string> f =
      absl::StrSplit(stat.substr(close + 2), ' ', absl::SkipEmpty());
  // utime and stime are fields 14 and 15 of the whole line, 12 and 13 here.
  if (f.size() < 13) return 0;
  int64_t utime = 0, stime = 0;
  (void)absl::SimpleAtoi(f[11], &utime);
  (void)absl::SimpleAtoi(f[12], &stime);
  return static_cast<double>(utime + stime) /
         static_cast<double>(sysconf(_SC_CLK_TCK));
}

double ChildrenCpuSeconds() {
  rusage r{};
  getrusage(RUSAGE_CHILDREN, &r);
  return static_cast<double>(r.ru_utime.tv_sec + r.ru_stime.tv_sec) +
         static_cast<double>(r.ru_utime.tv_usec + r.ru_stime.tv_usec) / 1e6;
}

std::string ScrapeMetrics(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return "";
  timeval timeout{.tv_sec = 5, .tv_usec = 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string response;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
    // HTTP/1.0: the server closes the connection after the body, so reading
    // to EOF needs no parsing of lengths or chunks.
    const std::string request =
        "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if (send(fd, request.data(), request.size(), MSG_NOSIGNAL) ==
        static_cast<ssize_t>(request.size())) {
      char buffer[65536];
      ssize_t n;
      while ((n = recv(fd, buffer, sizeof buffer, 0)) > 0) {
        response.append(buffer, static_cast<size_t>(n));
      }
      if (n < 0) response.clear();
    }
  }
  close(fd);
  const size_t body = response.find("\r\n\r\n");
  if (response.rfind("HTTP/1.", 0) != 0 || body == std::string::npos ||
      response.find(" 200 ") > body) {
    return "";
  }
  return response.substr(body + 4);
}

Scrape ParseMetrics(const std::string& text) {
  Scrape s;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    if (space == absl::string_view::npos) continue;
    double value = 0;
    if (!absl::SimpleAtod(line.substr(space + 1), &value)) continue;
    const absl::string_view series = line.substr(0, space);
    const size_t brace = series.find('{');
    const absl::string_view name = series.substr(0, brace);
    const absl::string_view labels =
        brace == absl::string_view::npos ? "" : series.substr(brace);
    if (name == "deltad_release_decision_seconds_bucket") {
      const std::string le = LabelValue(labels, "le");
      double bound = 0;
      if (le == "+Inf") {
        bound = std::numeric_limits<double>::infinity();
      } else if (!absl::SimpleAtod(le, &bound)) {
        continue;
      }
      s.buckets[bound] += value;
      s.ok = true;
    } else if (name == "deltad_release_decision_seconds_count") {
      s.count += value;
    } else if (name == "deltad_release_decision_seconds_sum") {
      s.sum += value;
    } else if (name == "deltad_heap_in_use_bytes") {
      s.heap_in_use = value;
    } else if (name == "deltad_refused_total" &&
               LabelValue(labels, "limit") == "grpc_ended_unseen") {
      s.ended_unseen = value;
    } else if (name == "deltad_orders_total") {
      const std::string kind = LabelValue(labels, "kind");
      if (kind == "offload") s.offloads += value;
      if (kind == "evict") s.evictions += value;
      if (kind == "budget") s.budgets += value;
      if (kind == "prefetch") s.prefetches += value;
    }
  }
  return s;
}

void Histogram::Add(const Scrape& from, const Scrape& to) {
  for (const auto& [le, n] : to.buckets) {
    auto it = from.buckets.find(le);
    buckets[le] += n - (it == from.buckets.end() ? 0 : it->second);
  }
  count += to.count - from.count;
  sum += to.sum - from.sum;
}

double Histogram::Quantile(double q) const {
  if (count <= 0 || buckets.empty()) return 0;
  const double rank = q * count;
  double lower = 0, below = 0;
  for (const auto& [le, cum] : buckets) {
    if (cum >= rank) {
      if (std::isinf(le)) return lower;
      if (cum <= below) return le;
      return lower + (le - lower) * (rank - below) / (cum - below);
    }
    lower = le;
    below = cum;
  }
  return lower;
}

bool WriteSamplesCsv(const std::vector<Sample>& samples,
                     const std::string& path) {
  std::ofstream out(path);
  out << "t,phase,rss_kib,anon_kib,heap_kib,threads,fds,sessions,trainers\n";
  for (const Sample& s : samples) {
    out << s.t << ',' << (s.storm ? "storm" : "quiet") << ',' << s.rss_kib
        << ',' << s.anon_kib << ',' << s.heap_kib << ',' << s.threads << ','
        << s.fds << ',' << s.sessions << ',' << s.trainers << '\n';
  }
  return static_cast<bool>(out);
}

}  // namespace deltad::bench
