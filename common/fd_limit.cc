#include "common/fd_limit.h"

#include <sys/resource.h>

#include <cerrno>

namespace deltad::common {

absl::Status RaiseDescriptorLimit() {
  struct rlimit limit;
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) {
    return absl::ErrnoToStatus(errno, "reading the descriptor limit");
  }
  if (limit.rlim_cur >= limit.rlim_max) return absl::OkStatus();
  limit.rlim_cur = limit.rlim_max;
  if (setrlimit(RLIMIT_NOFILE, &limit) != 0) {
    return absl::ErrnoToStatus(errno, "raising the descriptor limit");
  }
  return absl::OkStatus();
}

}  // namespace deltad::common
