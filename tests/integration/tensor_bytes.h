#ifndef DELTAD_TESTS_INTEGRATION_TENSOR_BYTES_H_
#define DELTAD_TESTS_INTEGRATION_TENSOR_BYTES_H_

#include <cstdint>
#include <cstdio>
#include <string>

// What the test clients (fault_client_main.cc, steady_client_main.cc)
// share: the bytes each tensor holds, and their line-based output.
namespace deltad::testing_util {

// Tensor `id`'s bytes: a pattern no other tensor has.
inline void FillTensor(void* out, int64_t bytes, uint64_t id) {
  auto* p = static_cast<uint64_t*>(out);
  for (int64_t i = 0; i < bytes / 8; ++i) p[i] = id * 0x9E3779B97F4A7C15ULL + i;
}

inline bool TensorIntact(const void* in, int64_t bytes, uint64_t id) {
  const auto* p = static_cast<const uint64_t*>(in);
  for (int64_t i = 0; i < bytes / 8; ++i) {
    if (p[i] != id * 0x9E3779B97F4A7C15ULL + i) return false;
  }
  return true;
}

// One line on stdout, flushed: the test reads it through a pipe.
inline void Say(const std::string& line) {
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

}  // namespace deltad::testing_util

#endif  // DELTAD_TESTS_INTEGRATION_TENSOR_BYTES_H_
