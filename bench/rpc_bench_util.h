// rpc_bench's clock, progress lines and exit on error.
#ifndef DELTAD_BENCH_RPC_BENCH_UTIL_H_
#define DELTAD_BENCH_RPC_BENCH_UTIL_H_

#include <sys/resource.h>
#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <string>

namespace deltad::bench {

inline constexpr int64_t kMiB = int64_t{1} << 20;
inline constexpr int64_t kGiB = int64_t{1} << 30;
// Above Linux's PID_MAX_LIMIT, so no real process can share these pids.
inline constexpr pid_t kFakePidBase = pid_t{1} << 22;
// A tensor id no session ever creates: a batch that accesses it is refused,
// and the refusal coming back on the stream says that every batch written
// before it has been applied (a stream's batches are applied in order).
inline constexpr uint64_t kFenceId = std::numeric_limits<uint64_t>::max();
inline constexpr int kWarmupCalls = 200;

using Clock = std::chrono::steady_clock;

inline double Seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

inline double Micros(Clock::duration d) {
  return std::chrono::duration<double, std::micro>(d).count();
}

inline int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             Clock::now().time_since_epoch())
      .count();
}

// User plus system CPU time of the whole process (daemon and clients alike).
inline double CpuSeconds() {
  rusage r{};
  getrusage(RUSAGE_SELF, &r);
  return static_cast<double>(r.ru_utime.tv_sec + r.ru_stime.tv_sec) +
         static_cast<double>(r.ru_utime.tv_usec + r.ru_stime.tv_usec) / 1e6;
}

// Progress on stderr, with the seconds since the start: a run takes a minute
// or two, and where the time goes is worth seeing.
inline const Clock::time_point kStart = Clock::now();

inline void Note(const std::string& what) {
  std::fprintf(stderr, "rpc_bench [%6.1f s]: %s\n",
               Seconds(Clock::now() - kStart), what.c_str());
}

// The temporary directory of the daemon's sockets, removed on the way out
// whichever way the run ends.
inline std::string& TempDir() {
  static auto* dir = new std::string();
  return *dir;
}

[[noreturn]] inline void Die(const std::string& why) {
  std::fprintf(stderr, "rpc_bench: %s\n", why.c_str());
  if (!TempDir().empty()) {
    std::error_code ignored;
    std::filesystem::remove_all(TempDir(), ignored);
  }
  std::exit(1);
}

}  // namespace deltad::bench

#endif  // DELTAD_BENCH_RPC_BENCH_UTIL_H_
