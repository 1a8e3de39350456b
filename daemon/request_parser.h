#ifndef DELTAD_DAEMON_REQUEST_PARSER_H_
#define DELTAD_DAEMON_REQUEST_PARSER_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/message.h"

namespace deltad::daemon {

// Parses a request as it came off the wire into `message` (cleared first).
//
// gRPC's own parsing of a request that does not parse gives INTERNAL with an
// empty message, or on a stream just ends it, and protobuf writes an error
// line for every string field that is not UTF-8: a client could not tell
// what it did wrong, and a hostile one could fill the journal. Here:
// INVALID_ARGUMENT naming the first string field that is not valid UTF-8
// (e.g. "OpenSessionRequest.label"), found before protobuf sees it, so
// nothing is logged; or INVALID_ARGUMENT saying the bytes are not a
// `message` at all.
absl::Status ParseRequest(absl::string_view wire,
                          google::protobuf::Message& message);

// Whether `text` is well-formed UTF-8 (no overlong forms, no surrogates,
// nothing above U+10FFFF), as protobuf requires of string fields.
bool IsValidUtf8(absl::string_view text);

}  // namespace deltad::daemon

#endif  // DELTAD_DAEMON_REQUEST_PARSER_H_
