#ifndef DELTAD_TESTS_UNIT_POLICIES_RESIDENT_BYTES_H_
#define DELTAD_TESTS_UNIT_POLICIES_RESIDENT_BYTES_H_

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace deltad::policy::testing_util {

// Resident bytes of [p, p + bytes), from the kernel's page tables: what a
// test of memory given back asserts on, exactly and without the noise of
// the process's RSS.
inline size_t ResidentBytes(const void* p, size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p) & ~(page - 1);
  const size_t pages =
      (reinterpret_cast<uintptr_t>(p) + bytes - begin + page - 1) / page;
  std::vector<unsigned char> in_core(pages);
  if (mincore(reinterpret_cast<void*>(begin), pages * page, in_core.data()) !=
      0) {
    ADD_FAILURE() << "mincore failed";
    return 0;
  }
  size_t resident = 0;
  for (unsigned char c : in_core) resident += (c & 1) * page;
  return resident;
}

}  // namespace deltad::policy::testing_util

#endif  // DELTAD_TESTS_UNIT_POLICIES_RESIDENT_BYTES_H_
