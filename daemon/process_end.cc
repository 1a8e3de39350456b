#include "daemon/process_end.h"

#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/unix_socket.h"

namespace deltad::daemon {

namespace {

std::string Stat(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

bool ProcessStopped(pid_t pid) {
  const std::string stat = Stat(pid);
  // The state (field 3) follows the command name, after its last ')'.
  const size_t paren = stat.rfind(')');
  if (paren == std::string::npos || paren + 2 >= stat.size()) return false;
  const char state = stat[paren + 2];
  return state == 'T' || state == 't';
}

uint64_t ProcessStartTime(pid_t pid) {
  const std::string stat = Stat(pid);
  // The command name (field 2) is in parentheses and may hold anything,
  // spaces and parentheses included: the fields after it start after the
  // last ')'.
  const size_t paren = stat.rfind(')');
  if (paren == std::string::npos) return 0;
  const std::vector<std::string> fields =
      absl::StrSplit(stat.substr(paren + 1), ' ', absl::SkipEmpty());
  // fields[0] is field 3 (state); the start time is field 22.
  constexpr size_t kStartTime = 22 - 3;
  if (fields.size() <= kStartTime) return 0;
  uint64_t start = 0;
  const std::string& f = fields[kStartTime];
  if (std::from_chars(f.data(), f.data() + f.size(), start).ec != std::errc()) {
    return 0;
  }
  return start;
}

absl::Status KillProcess(pid_t pid, uint64_t start_time) {
  const int raw = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  if (raw < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("process ", pid, " is gone"));
  }
  common::UniqueFd pidfd(raw);
  // Checked after the pidfd is open: from here the pid cannot name another
  // process while we hold it.
  if (start_time == 0 || ProcessStartTime(pid) != start_time) {
    return absl::FailedPreconditionError(
        absl::StrCat("pid ", pid,
                     " names another process now (the one that held the "
                     "session is gone)"));
  }
  if (::syscall(SYS_pidfd_send_signal, pidfd.get(), SIGKILL, nullptr, 0) != 0) {
    const int err = errno;
    if (err == EPERM) {
      return absl::PermissionDeniedError(
          absl::StrCat("deltad may not signal process ", pid,
                       " (another user's; deltad is not root)"));
    }
    return absl::FailedPreconditionError(
        absl::StrCat("process ", pid, " is gone (errno ", err, ")"));
  }
  return absl::OkStatus();
}

}  // namespace deltad::daemon
