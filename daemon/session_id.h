#ifndef DELTAD_DAEMON_SESSION_ID_H_
#define DELTAD_DAEMON_SESSION_ID_H_

#include <cstdint>

namespace deltad::daemon {

// A session of one process on one GPU, numbered by the daemon from 1.
using SessionId = uint64_t;

}  // namespace deltad::daemon

#endif  // DELTAD_DAEMON_SESSION_ID_H_
