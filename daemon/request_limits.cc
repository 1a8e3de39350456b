#include "daemon/request_limits.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace deltad::daemon {

namespace {

// Labels end up on operators' terminals (deltactl sessions): no control
// characters, so a label cannot move the cursor or rewrite other lines.
absl::Status CheckLabel(absl::string_view label, const RequestLimits& limits) {
  constexpr absl::string_view kField = "OpenSessionRequest.label";
  if (label.size() > static_cast<size_t>(limits.max_label_bytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat(kField, " is ", label.size(), " bytes; the limit is ",
                     limits.max_label_bytes, " (limits.max_label_bytes)"));
  }
  for (size_t i = 0; i < label.size(); ++i) {
    const auto c = static_cast<unsigned char>(label[i]);
    if (c < 0x20 || c == 0x7f) {
      return absl::InvalidArgumentError(
          absl::StrCat(kField, " holds a control character (byte ",
                       static_cast<int>(c), " at offset ", i, ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckMessageBytes(size_t bytes, const RequestLimits& limits) {
  if (bytes <= static_cast<size_t>(limits.max_message_bytes)) {
    return absl::OkStatus();
  }
  return absl::ResourceExhaustedError(
      absl::StrCat("the request is ", bytes, " bytes; the limit is ",
                   limits.max_message_bytes, " (limits.max_message_bytes)"));
}

absl::Status Validate(const v1::OpenSessionRequest& request,
                      const RequestLimits& limits) {
  return CheckLabel(request.label(), limits);
}

}  // namespace deltad::daemon
