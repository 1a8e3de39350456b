#include "common/side_protocol.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace deltad::common::side {

absl::StatusOr<std::vector<Grant>> ReceiveGrants(int socket, Tag item,
                                                 Tag done) {
  std::vector<Grant> grants;
  for (;;) {
    auto message = RecvFds(socket, 1, kMaxMessageBytes);
    if (!message.ok()) {
      return absl::UnavailableError(absl::StrCat(
          "waiting for deltad's answer: ", message.status().message()));
    }
    std::vector<UniqueFd> fds;
    for (int fd : message->fds) fds.emplace_back(fd);
    if (message->tag == done) return grants;
    if (message->tag == kError) {
      return absl::FailedPreconditionError(message->payload);
    }
    auto record = DecodeRecord(message->payload);
    if (message->tag != item || !record || fds.size() != 1) {
      return absl::InternalError(
          absl::StrCat("unexpected side-socket message: tag ", message->tag,
                       ", ", message->payload.size(), " payload bytes, ",
                       fds.size(), " descriptors"));
    }
    grants.push_back({record->id, record->bytes, std::move(fds[0])});
  }
}

}  // namespace deltad::common::side
