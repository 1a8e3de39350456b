// The normal build's driver for a fuzz target: runs every file named on the
// command line (or found under a named directory) through
// LLVMFuzzerTestOneInput once, so that the corpus is a regression test
// without clang or libFuzzer. With --write_seeds DIR it writes the target's
// seed inputs instead.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "fuzz/fuzz_target.h"

namespace {

bool ReadFile(const std::string& path, std::string* out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  out->assign(std::istreambuf_iterator<char>(in),
              std::istreambuf_iterator<char>());
  return !in.bad();
}

int WriteSeeds(const std::string& dir) {
  std::filesystem::create_directories(dir);
  for (const auto& [name, bytes] : deltad::fuzz::Seeds()) {
    std::ofstream out(std::filesystem::path(dir) / name, std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!out) {
      std::fprintf(stderr, "cannot write %s/%s\n", dir.c_str(), name.c_str());
      return 1;
    }
  }
  std::printf("wrote %zu seeds to %s\n", deltad::fuzz::Seeds().size(),
              dir.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::strcmp(argv[1], "--write_seeds") == 0) {
    return WriteSeeds(argv[2]);
  }
  if (argc < 2) {
    std::fprintf(stderr,
                 "usage: %s FILE_OR_DIR...   replay inputs\n"
                 "       %s --write_seeds DIR\n",
                 argv[0], argv[0]);
    return 2;
  }
  std::vector<std::string> files;
  for (int i = 1; i < argc; ++i) {
    const std::filesystem::path p(argv[i]);
    if (std::filesystem::is_directory(p)) {
      for (const auto& e : std::filesystem::recursive_directory_iterator(p)) {
        if (e.is_regular_file()) files.push_back(e.path().string());
      }
    } else if (std::filesystem::is_regular_file(p)) {
      files.push_back(p.string());
    } else {
      std::fprintf(stderr, "no such file or directory: %s\n", argv[i]);
      return 1;
    }
  }
  // An empty corpus would make the test pass while checking nothing.
  if (files.empty()) {
    std::fprintf(stderr, "no inputs found\n");
    return 1;
  }
  std::sort(files.begin(), files.end());
  for (const std::string& f : files) {
    std::string bytes;
    if (!ReadFile(f, &bytes)) {
      std::fprintf(stderr, "cannot read %s\n", f.c_str());
      return 1;
    }
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()),
                           bytes.size());
  }
  std::printf("replayed %zu inputs\n", files.size());
  return 0;
}
