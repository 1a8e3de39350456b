#include "daemon/heap_return.h"

#include <dlfcn.h>
#include <sys/types.h>

#include <cstddef>
#include <cstdlib>
#include <utility>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace deltad::daemon {

namespace {

// jemalloc's control interface, looked up at run time: the daemon links
// jemalloc where the build found it, and an operator may preload it, while
// the tests and the sanitizer builds run on glibc's malloc. Null where
// jemalloc does not serve the process.
using MallctlFn = int (*)(const char*, void*, size_t*, void*, size_t);

MallctlFn Mallctl() {
  static const MallctlFn fn =
      reinterpret_cast<MallctlFn>(dlsym(RTLD_DEFAULT, "mallctl"));
  return fn;
}

template <typename T>
bool JemallocRead(const char* name, T* value) {
  size_t size = sizeof(T);
  return Mallctl()(name, value, &size, nullptr, 0) == 0 && size == sizeof(T);
}

// jemalloc's statistics are a snapshot taken when the epoch advances.
bool JemallocRefresh() {
  uint64_t epoch = 1;
  size_t size = sizeof(epoch);
  return Mallctl()("epoch", &epoch, &size, &epoch, size) == 0;
}

// "stats.arenas.<i>" and "arena.<i>" with i = MALLCTL_ARENAS_ALL (4096 in
// jemalloc's API): every arena at once.
constexpr char kAllArenasDirty[] = "stats.arenas.4096.pdirty";
constexpr char kAllArenasMuzzy[] = "stats.arenas.4096.pmuzzy";
constexpr char kPurgeAllArenas[] = "arena.4096.purge";

}  // namespace

std::string HeapAllocatorName() {
  if (Mallctl() != nullptr) {
    const char* version = nullptr;
    std::string name = "jemalloc";
    if (JemallocRead("version", &version) && version != nullptr) {
      // "5.3.0-0-g<commit>": the release is enough.
      const std::string v = version;
      name += " " + v.substr(0, v.find('-'));
    }
    // What an operator needs to know of it: whether freed pages go back by
    // themselves, and after how long.
    bool background = false;
    ssize_t decay_ms = 0;
    if (JemallocRead("opt.background_thread", &background) &&
        JemallocRead("opt.dirty_decay_ms", &decay_ms)) {
      name += background ? " (freed pages returned after " +
                               std::to_string(decay_ms) + " ms)"
                         : " (no background thread: freed pages returned "
                           "when the daemon trims)";
    }
    return name;
  }
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  return "other";
#elif defined(__GLIBC__)
  return "glibc";
#else
  return "other";
#endif
}

int64_t HeapInUseBytes() {
  if (Mallctl() != nullptr) {
    size_t allocated = 0;
    return JemallocRefresh() && JemallocRead("stats.allocated", &allocated)
               ? static_cast<int64_t>(allocated)
               : -1;
  }
#if defined(__GLIBC__) && (__GLIBC__ > 2 || __GLIBC_MINOR__ >= 33)
  const struct mallinfo2 info = mallinfo2();
  return static_cast<int64_t>(info.uordblks + info.hblkhd);
#else
  return -1;
#endif
}

int64_t HeapFreeBytes() {
  if (Mallctl() != nullptr) {
    size_t page = 0, dirty = 0, muzzy = 0;
    if (!JemallocRefresh() || !JemallocRead("arenas.page", &page) ||
        !JemallocRead(kAllArenasDirty, &dirty) ||
        !JemallocRead(kAllArenasMuzzy, &muzzy)) {
      return 0;
    }
    return static_cast<int64_t>((dirty + muzzy) * page);
  }
#if defined(__GLIBC__) && (__GLIBC__ > 2 || __GLIBC_MINOR__ >= 33)
  const struct mallinfo2 info = mallinfo2();
  return static_cast<int64_t>(info.fordblks);
#else
  return 0;
#endif
}

void TrimHeap() {
  if (Mallctl() != nullptr) {
    (void)Mallctl()(kPurgeAllArenas, nullptr, nullptr, nullptr, 0);
    return;
  }
#if defined(__GLIBC__)
  (void)malloc_trim(0);
#endif
}

int LimitHeapArenas(int arenas) {
  // jemalloc fixes its arenas when it starts (opt.narenas).
  if (Mallctl() != nullptr) return 0;
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

HeapReturn::HeapReturn() : HeapReturn(Options{}, HeapFreeBytes, TrimHeap) {}

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
