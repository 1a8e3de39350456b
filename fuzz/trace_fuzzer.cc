// The trace importers of the simulator (policies/sim): the text format
// (trace_io.h) when the first byte is even, a DTR op log (dtr_log.h) when
// it is odd; the rest is the file. Whatever they accept must be a valid
// trace, and a text trace must print back to text that parses to the same
// trace.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "fuzz/fuzz_target.h"
#include "policies/sim/device_profile.h"
#include "policies/sim/dtr_log.h"
#include "policies/sim/model_traces.h"
#include "policies/sim/trace.h"
#include "policies/sim/trace_io.h"

namespace deltad::fuzz {
namespace {

// DELTAD_FUZZ_VERBOSE=1 prints what the importer said, to read a
// reproducer.
void Report(const absl::Status& s) {
  static const bool verbose = std::getenv("DELTAD_FUZZ_VERBOSE") != nullptr;
  if (verbose) std::fprintf(stderr, "%s\n", s.ToString().c_str());
}

void CheckTrace(const sim::Trace& trace) {
  DELTAD_FUZZ_CHECK(trace.Validate().ok());
  DELTAD_FUZZ_CHECK(trace.ComputeNs() >= 0);
  const std::string text = sim::FormatTrace(trace);
  auto again = sim::ParseTrace(text, "formatted");
  DELTAD_FUZZ_CHECK(again.ok());
  DELTAD_FUZZ_CHECK(sim::FormatTrace(*again) == text);
}

// ImportDtrLog reads a path: the input goes into one in-memory file,
// reached through /proc, rather than onto the disk millions of times.
void ImportDtr(const uint8_t* data, size_t size) {
  static const int fd = ::memfd_create("fuzz-dtr", MFD_CLOEXEC);
  if (fd < 0 || ::ftruncate(fd, 0) != 0) return;
  size_t done = 0;
  while (done < size) {
    const ssize_t n =
        ::pwrite(fd, data + done, size - done, static_cast<off_t>(done));
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
  auto trace = sim::ImportDtrLog(absl::StrCat("/proc/self/fd/", fd));
  Report(trace.status());
  if (trace.ok()) CheckTrace(*trace);
}

}  // namespace

std::vector<std::pair<std::string, std::string>> Seeds() {
  std::vector<std::pair<std::string, std::string>> seeds;
  const std::string text(1, '\0');
  seeds.emplace_back("seed_text_every_statement",
                     text +
                         "deltad-trace 1  # comment\n"
                         "name seed-net\n"
                         "const in 4096\n"
                         "const w 512\n"
                         "const gone 8\n"
                         "release gone\n"
                         "op conv fwd 120 ws=1024 in=in,w out=a:8192,s:64\n"
                         "op view fwd 3 in=a alias=av:a\n"
                         "\n"
                         "op relu_ fwd 9 in=av mut=a\n"
                         "op loss bwd 40 in=a,s out=g:8192 alias=gv:g mut=w\n"
                         "release a,s,never\n");
  seeds.emplace_back("seed_text_errors", text +
                                             "deltad-trace 1\n"
                                             "const x 4\n"
                                             "op f fwd 1 in=ghost\n");
  seeds.emplace_back("seed_text_bad_header", text + "deltad-trace 2\n");
  // The head of a real model's trace.
  auto device = sim::FindDeviceProfile("a100-80gb");
  if (device.ok()) {
    sim::ModelOptions options;
    options.batch = 1;
    options.height = 32;
    options.width = 32;
    for (const char* model : {"resnet50", "gpt"}) {
      sim::ModelOptions o = options;
      o.gpt_layers = 1;
      o.gpt_hidden = 64;
      o.gpt_heads = 2;
      o.gpt_seq = 16;
      o.gpt_vocab = 100;
      auto trace = sim::BuildModelTrace(model, o, *device);
      if (!trace.ok()) continue;
      const std::string formatted = sim::FormatTrace(*trace);
      std::vector<absl::string_view> lines = absl::StrSplit(formatted, '\n');
      if (lines.size() > 60) lines.resize(60);
      seeds.emplace_back(absl::StrCat("seed_text_", model),
                         text + absl::StrJoin(lines, "\n") + "\n");
    }
  }
  const std::string dtr(1, '\1');
  seeds.emplace_back("seed_dtr_every_instruction",
                     dtr +
                         R"({"ANNOTATION":"START","INSTRUCTION":"ANNOTATE"}
{"INSTRUCTION":"CONSTANT","NAME":"x1"}
{"INSTRUCTION":"MEMORY","MEMORY":"1728","NAME":"x1"}
{"DST":"x2","INSTRUCTION":"COPY","SRC":"x1"}
{"INSTRUCTION":"RELEASE","NAME":"x1"}
{"INSTRUCTION":"CONSTANT","NAME":"x3"}
{"INSTRUCTION":"MEMORY","MEMORY":"64","NAME":"x3"}
{"ARGS":["x2","x3"],"INSTRUCTION":"CALL","NAME":"conv2d","RESULT":["x4","x5"],"TIME":1200}
{"INSTRUCTION":"MEMORY","MEMORY":"4096","NAME":"x4"}
{"ALIAS":"-1","INSTRUCTION":"ALIAS","NAME":"x4"}
{"INSTRUCTION":"MEMORY","MEMORY":"1728","NAME":"x5"}
{"ALIAS":"0","INSTRUCTION":"ALIAS","NAME":"x5"}
{"ANNOTATION":"BACKWARD","INSTRUCTION":"ANNOTATE"}
{"ARGS":["x4"],"INSTRUCTION":"MUTATE","MUTATE":[0],"NAME":"relu_","TIME":"30"}
{"DST":"x5","INSTRUCTION":"COPY_FROM","SRC":"x3"}
{"INSTRUCTION":"RELEASE","NAME":"x4"}
{"INSTRUCTION":"RELEASE","NAME":"x99"}
{"ANNOTATION":"START","INSTRUCTION":"ANNOTATE"}
)");
  seeds.emplace_back("seed_dtr_not_json", dtr + "{\"INSTRUCTION\":\n");
  return seeds;
}

}  // namespace deltad::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  if (data[0] % 2 == 0) {
    auto trace = deltad::sim::ParseTrace(
        absl::string_view(reinterpret_cast<const char*>(data + 1), size - 1));
    deltad::fuzz::Report(trace.status());
    if (trace.ok()) deltad::fuzz::CheckTrace(*trace);
  } else {
    deltad::fuzz::ImportDtr(data + 1, size - 1);
  }
  return 0;
}
