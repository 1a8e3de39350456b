#ifndef DELTAD_FUZZ_FUZZ_TARGET_H_
#define DELTAD_FUZZ_FUZZ_TARGET_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

// What every fuzz target defines. The same source builds two ways: with
// libFuzzer (clang, -DDELTAD_FUZZ=ON), which supplies main(), and in the
// normal build with fuzz/replay_main.cc, which runs the corpus through it
// as a test and writes the seeds below.

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace deltad::fuzz {

// Valid inputs that reach each operation or format the target knows, by
// file name: the start of its corpus (replay --write_seeds DIR).
std::vector<std::pair<std::string, std::string>> Seeds();

// Stops the process the way a sanitizer would, so that libFuzzer keeps the
// input as a crash and the replay test fails: an invariant that no input
// may break was broken.
[[noreturn]] void Violated(const char* what, const char* file, int line);

// How many descriptors the process has open: the same after an input as
// before it, or the code under test leaks them (a daemon that runs for
// months would run out).
int OpenFds();

}  // namespace deltad::fuzz

#define DELTAD_FUZZ_CHECK(cond)                                       \
  do {                                                                \
    if (!(cond)) ::deltad::fuzz::Violated(#cond, __FILE__, __LINE__); \
  } while (false)

#endif  // DELTAD_FUZZ_FUZZ_TARGET_H_
