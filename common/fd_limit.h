#ifndef DELTAD_COMMON_FD_LIMIT_H_
#define DELTAD_COMMON_FD_LIMIT_H_

#include "absl/status/status.h"

namespace deltad::common {

// Raises this process's soft limit on open descriptors to its hard limit.
// Device chunks travel and stay as descriptors (a simulated chunk is a
// memfd that its holder keeps open), so a daemon or a process holding a
// GPU's budget in 2 MiB chunks needs thousands; the 1024 a shell starts
// with runs out first. INTERNAL with the errno text when refused.
absl::Status RaiseDescriptorLimit();

}  // namespace deltad::common

#endif  // DELTAD_COMMON_FD_LIMIT_H_
