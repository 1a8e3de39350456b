#ifndef DELTAD_COMMON_PROTOCOL_VERSION_H_
#define DELTAD_COMMON_PROTOCOL_VERSION_H_

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"

namespace deltad::common {

// The wire protocol the daemon and the client library speak
// (proto/deltad/v1 and the side socket's messages). It changes when one
// side's messages would be misread by the other; releases that only add
// fields keep it. A side that sends 0 predates the field and speaks 1.
inline constexpr uint32_t kProtocolVersion = 1;

inline uint32_t SpokenProtocol(uint32_t sent) { return sent == 0 ? 1 : sent; }

// Why a client and a daemon cannot work together, naming both.
inline std::string ProtocolMismatch(const std::string& client_version,
                                    uint32_t client_protocol,
                                    const std::string& daemon_version,
                                    uint32_t daemon_protocol) {
  return absl::StrCat(
      "the client library ",
      client_version.empty() ? "(of a version before 0.1.0)" : client_version,
      " speaks protocol ", client_protocol, " and deltad ",
      daemon_version.empty() ? "(of a version before 0.1.0)" : daemon_version,
      " speaks protocol ", daemon_protocol,
      ": run a client library and a daemon of the same protocol (upgrade the "
      "older one)");
}

// The client's check of the daemon's answer to OpenSession: empty when the
// daemon speaks this library's protocol (`daemon_sent` as it came, 0 from a
// daemon that predates the field), else why they cannot work together.
inline std::string DaemonProtocolMismatch(const std::string& client_version,
                                          const std::string& daemon_version,
                                          uint32_t daemon_sent) {
  const uint32_t spoken = SpokenProtocol(daemon_sent);
  if (spoken == kProtocolVersion) return "";
  return ProtocolMismatch(client_version, kProtocolVersion, daemon_version,
                          spoken);
}

}  // namespace deltad::common

#endif  // DELTAD_COMMON_PROTOCOL_VERSION_H_
