#include "daemon/heap_return.h"

#include <cstdlib>
#include <utility>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace deltad::daemon {

namespace {

int64_t GlibcFreeBytes() {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || __GLIBC_MINOR__ >= 33)
  const struct mallinfo2 info = mallinfo2();
  return static_cast<int64_t>(info.fordblks);
#else
  return 0;
#endif
}

void GlibcTrim() {
#if defined(__GLIBC__)
  (void)malloc_trim(0);
#endif
}

}  // namespace

int64_t HeapInUseBytes() {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || __GLIBC_MINOR__ >= 33)
  const struct mallinfo2 info = mallinfo2();
  return static_cast<int64_t>(info.uordblks + info.hblkhd);
#else
  return -1;
#endif
}

int LimitHeapArenas(int arenas) {
#if defined(__GLIBC__)
  if (const char* env = std::getenv("MALLOC_ARENA_MAX"); env && *env) {
    return std::atoi(env);
  }
  if (arenas <= 0) return 0;
  return mallopt(M_ARENA_MAX, arenas) == 1 ? arenas : 0;
#else
  (void)arenas;
  return 0;
#endif
}

HeapReturn::HeapReturn() : HeapReturn(Options{}, GlibcFreeBytes, GlibcTrim) {}

HeapReturn::HeapReturn(Options options, std::function<int64_t()> free_bytes,
                       std::function<void()> trim)
    : options_(options),
      free_bytes_(std::move(free_bytes)),
      trim_(std::move(trim)) {}

bool HeapReturn::Tick(int64_t now_ns) {
  const int64_t free = free_bytes_();
  const bool due = trims_ == 0 || now_ns - last_ns_ >= options_.interval_ns;
  if (!(due && free >= options_.min_free_bytes) &&
      free < options_.urgent_free_bytes) {
    return false;
  }
  last_ns_ = now_ns;
  trim_();
  ++trims_;
  offered_bytes_ += free;
  return true;
}

}  // namespace deltad::daemon
