#ifndef DELTAD_DAEMON_CONFIG_H_
#define DELTAD_DAEMON_CONFIG_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "daemon/request_limits.h"
#include "deltad/v1/daemon_config.pb.h"

namespace deltad::daemon {

// Parses a configuration in protobuf text format. Errors name the source,
// line and column and what the parser expected.
absl::StatusOr<v1::DaemonConfig> ParseConfig(absl::string_view text,
                                             absl::string_view source);
absl::StatusOr<v1::DaemonConfig> LoadConfigFile(const std::string& path);

// Fills every unset field with its default (see daemon_config.proto).
v1::DaemonConfig WithDefaults(const v1::DaemonConfig& config);

// Checks a configuration with defaults applied; the message names the field
// and what is wrong with its value.
absl::Status ValidateConfig(const v1::DaemonConfig& config);

// The limits a configuration (with defaults filled in) sets.
RequestLimits RequestLimitsFrom(const v1::DaemonConfig& config);

}  // namespace deltad::daemon

#endif  // DELTAD_DAEMON_CONFIG_H_
