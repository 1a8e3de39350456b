#include "daemon/session_end_log.h"

#include <cstdio>
#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace deltad::daemon {

void SessionEndLog::Ended(const SessionInfo& session, SessionEnd why,
                          absl::string_view detail,
                          const absl::StatusOr<SessionUsage>& usage) {
  if (why == SessionEnd::kClosed) return;
  int64_t held_back = 0;
  if (!limit_.Allow(&held_back)) return;
  // The label and the detail come from the client: escaped, so that they
  // cannot forge lines of their own.
  std::string line = absl::StrCat(
      "deltad: session ", session.id, " (pid ", session.peer.pid, ", GPU ",
      session.gpu, ", \"", absl::CHexEscape(session.label), "\") ended: ",
      why == SessionEnd::kStreamBroken
          ? "its stream broke before the process closed it"
          : "its process's side connection closed");
  if (!detail.empty())
    absl::StrAppend(&line, " (", absl::CHexEscape(detail), ")");
  if (usage.ok()) {
    absl::StrAppend(&line, "; reclaimed ", usage->tensors, " tensors, ",
                    usage->device_bytes, " device bytes, ", usage->host_bytes,
                    " host bytes");
  }
  if (held_back > 0) {
    absl::StrAppend(&line, "; ", held_back, " more such lines held back");
  }
  std::fprintf(stderr, "%s\n", line.c_str());
}

}  // namespace deltad::daemon
