#ifndef DELTAD_DAEMON_HTTP2_REFUSAL_H_
#define DELTAD_DAEMON_HTTP2_REFUSAL_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace deltad::daemon {

// The server's side of an HTTP/2 connection the daemon refuses: every gRPC
// call the client starts on it is answered with RESOURCE_EXHAUSTED and
// `why` (a trailers-only response), then a GOAWAY names `why` too. Without
// the answer a gRPC client sees only a connection that went away and
// retries it until its deadline; with it, the call fails at once with the
// limit's name. Parses only what it must (frame headers, the preface); a
// client that sends anything else gets the GOAWAY. Not thread safe.
class Http2Refusal {
 public:
  explicit Http2Refusal(std::string why);

  // What the server sends first: its SETTINGS (empty).
  static std::string Preface();

  // Takes bytes the client sent; returns what to send back: a SETTINGS
  // acknowledgement for each of its SETTINGS, the refusal for each call it
  // started. An error once the bytes are not HTTP/2 (or more than a small
  // buffer's worth of one frame): the connection has nothing more to say.
  absl::StatusOr<std::string> Feed(absl::string_view bytes);

  // The GOAWAY (ENHANCE_YOUR_CALM) naming `why`, after the calls answered.
  std::string Goaway() const;

  // Calls answered so far.
  int answered() const { return answered_; }

 private:
  std::string Refusal(uint32_t stream) const;

  std::string why_;
  std::string pending_;  // bytes not parsed yet: at most one frame
  bool preface_seen_ = false;
  uint32_t last_stream_ = 0;
  int answered_ = 0;
};

}  // namespace deltad::daemon

#endif  // DELTAD_DAEMON_HTTP2_REFUSAL_H_
