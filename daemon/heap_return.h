#ifndef DELTAD_DAEMON_HEAP_RETURN_H_
#define DELTAD_DAEMON_HEAP_RETURN_H_

#include <cstdint>
#include <functional>
#include <string>

namespace deltad::daemon {

// The process's malloc: "jemalloc <version>" where jemalloc serves it (the
// daemon links it where the build found it, or it was preloaded), else
// "glibc" (or "other" under a sanitizer's or another allocator).
std::string HeapAllocatorName();

// Caps the glibc malloc arenas at `arenas` (0: leaves glibc's default),
// unless MALLOC_ARENA_MAX is set in the environment (glibc read it at
// start). Call it before threads start. Returns the cap in force, 0 for
// glibc's default or where it is not glibc's to set (under jemalloc).
int LimitHeapArenas(int arenas);

// The bytes the process's heap has handed out and not had back (jemalloc's
// stats.allocated; glibc's mallinfo2: in use in its arenas plus its own
// mappings); -1 where that is not known. Unlike the resident size, it does
// not keep the allocator's high-water mark: a leak shows in it as a climb,
// while freed memory that stays mapped does not.
int64_t HeapInUseBytes();

// The freed bytes the heap keeps mapped (jemalloc's dirty pages, glibc's
// free chunks), and giving them back to the system now.
int64_t HeapFreeBytes();
void TrimHeap();

// Gives the heap that sessions freed back to the system. Under glibc each
// stream's handler thread allocates in an arena of its own, and what a
// session frees when it ends stays mapped there: after the soak's trainers
// drained, the daemon held 180 MiB of RSS with 30 MiB of it in use, and
// malloc_trim brought it to 63 MiB. So an idle daemon kept the high-water
// mark of its busiest minute. jemalloc's background thread returns freed
// pages within a second by itself; this then only hurries a mass of them
// (HeapFreeBytes, TrimHeap). Not thread safe: one timer thread ticks it.
class HeapReturn {
 public:
  struct Options {
    int64_t interval_ns = int64_t{10} * 1000000000;  // at most one trim
    int64_t min_free_bytes = int64_t{16} << 20;      // worth a trim
    // Trimmed at the next tick, whatever the interval: a flood of HTTP/2
    // PINGs on connection after connection left 1.4 GB freed but mapped
    // within 15 s (67 MiB once trimmed).
    int64_t urgent_free_bytes = int64_t{256} << 20;
  };
  // `free_bytes`: the bytes the allocator holds free; `trim`: gives them
  // back. The default constructor uses HeapFreeBytes and TrimHeap.
  HeapReturn();
  HeapReturn(Options options, std::function<int64_t()> free_bytes,
             std::function<void()> trim);

  // Trims when `interval_ns` has passed since the last trim and at least
  // `min_free_bytes` lie free, or at once when `urgent_free_bytes` do. True
  // when it trimmed.
  bool Tick(int64_t now_ns);

  int64_t trims() const { return trims_; }
  int64_t offered_bytes() const { return offered_bytes_; }  // free at trims

 private:
  Options options_;
  std::function<int64_t()> free_bytes_;
  std::function<void()> trim_;
  int64_t last_ns_ = 0;  // of the last trim
  int64_t trims_ = 0;
  int64_t offered_bytes_ = 0;
};

}  // namespace deltad::daemon

#endif  // DELTAD_DAEMON_HEAP_RETURN_H_
