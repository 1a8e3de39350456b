#ifndef DELTAD_POLICIES_STATUS_MACROS_H_
#define DELTAD_POLICIES_STATUS_MACROS_H_

#include "absl/status/status.h"

// Public Abseil has no RETURN_IF_ERROR; this is the usual small stand-in.
#define DELTAD_RETURN_IF_ERROR(expr)                 \
  do {                                               \
    const ::absl::Status deltad_status_ = (expr);    \
    if (!deltad_status_.ok()) return deltad_status_; \
  } while (false)

#endif  // DELTAD_POLICIES_STATUS_MACROS_H_
