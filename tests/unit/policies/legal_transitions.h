#ifndef DELTAD_TESTS_UNIT_POLICIES_LEGAL_TRANSITIONS_H_
#define DELTAD_TESTS_UNIT_POLICIES_LEGAL_TRANSITIONS_H_

#include "policies/tensor.h"

namespace deltad::policy::testing_util {

// The state machine of TensorTable::SetState, written out independently of
// the library so the tests hold it to the specification.
inline bool LegalTransition(TensorState from, TensorState to) {
  using S = TensorState;
  switch (from) {
    case S::kResident:
      return to == S::kOffloading || to == S::kEvicted;
    case S::kOffloading:  // the order overtaken by the process's eviction
      return to == S::kOffloaded || to == S::kResident || to == S::kEvicted;
    case S::kOffloaded:
      return to == S::kReloading || to == S::kResident || to == S::kEvicted;
    case S::kReloading:
      return to == S::kResident || to == S::kOffloaded;
    case S::kEvicted:
    case S::kFreed:
      return false;
  }
  return false;
}

}  // namespace deltad::policy::testing_util

#endif  // DELTAD_TESTS_UNIT_POLICIES_LEGAL_TRANSITIONS_H_
