#ifndef DELTAD_DAEMON_PROCESS_END_H_
#define DELTAD_DAEMON_PROCESS_END_H_

#include <sys/types.h>

#include <cstdint>

#include "absl/status/status.h"

namespace deltad::daemon {

// When the kernel started process `pid` (field 22 of /proc/<pid>/stat,
// clock ticks since boot). With the pid it names one process for good: a
// pid is reused once its process is gone, the pair is not. 0 when it cannot
// be read.
uint64_t ProcessStartTime(pid_t pid);

// Whether the kernel shows process `pid` stopped (SIGSTOP, or stopped by a
// debugger): state T or t in /proc/<pid>/stat. False when it cannot be read.
bool ProcessStopped(pid_t pid);

// Sends SIGKILL to `pid` if it is still the process that started at
// `start_time`, through a pidfd so that the check and the signal name the
// same process. FAILED_PRECONDITION when the process is gone or the pid
// names another one now; PERMISSION_DENIED when the daemon may not signal
// it (another user's, and the daemon is not root).
absl::Status KillProcess(pid_t pid, uint64_t start_time);

}  // namespace deltad::daemon

#endif  // DELTAD_DAEMON_PROCESS_END_H_
