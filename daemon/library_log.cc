#include "daemon/library_log.h"

#include <grpc/support/log.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "google/protobuf/stubs/logging.h"

namespace deltad::daemon {
namespace {

LibraryLog* TheLog() {
  static auto* const log = new LibraryLog(stderr);
  return log;
}

const char* GprSeverity(gpr_log_severity s) {
  switch (s) {
    case GPR_LOG_SEVERITY_DEBUG:
      return "debug";
    case GPR_LOG_SEVERITY_INFO:
      return "info";
    case GPR_LOG_SEVERITY_ERROR:
      return "error";
  }
  return "?";
}

void FromGrpc(gpr_log_func_args* args) {
  TheLog()->Write("grpc", GprSeverity(args->severity),
                  args->file == nullptr ? "" : args->file, args->line,
                  args->message == nullptr ? "" : args->message);
}

void FromProtobuf(google::protobuf::LogLevel level, const char* file, int line,
                  const std::string& message) {
  const char* severity = level >= google::protobuf::LOGLEVEL_ERROR ? "error"
                         : level == google::protobuf::LOGLEVEL_WARNING
                             ? "warning"
                             : "info";
  TheLog()->Write("protobuf", severity, file == nullptr ? "" : file, line,
                  message);
}

}  // namespace

void LibraryLog::Write(absl::string_view library, absl::string_view severity,
                       absl::string_view file, int line,
                       absl::string_view message) {
  int64_t held_back = 0;
  if (!limit_.Allow(&held_back)) return;
  std::string text = absl::StrCat("deltad: ", library, " ", severity, ": ",
                                  message, " (", file, ":", line, ")");
  if (held_back > 0) {
    absl::StrAppend(&text, " [", held_back, " library log lines held back]");
  }
  std::fprintf(out_, "%s\n", text.c_str());
  std::fflush(out_);
}

void RouteLibraryLogs() {
  TheLog();
  gpr_set_log_function(&FromGrpc);
  google::protobuf::SetLogHandler(&FromProtobuf);
}

}  // namespace deltad::daemon
