// alloc_bench: the process allocator's alloc/free pair, as PyTorch calls it
// through CUDAPluggableAllocator (deltad_torch_malloc + deltad_torch_free),
// on the chunk-backed simulated device ("sim-chunks": memfd chunks mapped
// into one reserved range, the path a GPU's memory takes), beside plain
// malloc + free of the same size in the same run. The target is a p50 of at
// most 1 us per pair.
//
// Each pair is timed on its own (two clock reads, whose cost is a row of
// its own), in blocks that alternate between the paths so that noise from
// the machine falls on all of them alike. Below the C API, the same pairs
// through Client::AllocateRaw / FreeRaw and through the device alone
// (ChunkArena) say where the time goes. --update_doc=FILE rewrites this
// benchmark's section of docs/BENCHMARKS.md.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/report.h"
#include "client/client.h"
#include "client/deltad_client.h"
#include "client/sim_chunk_device.h"

ABSL_FLAG(std::string, sizes, "512,65536,2097152,20971520,67108864",
          "bytes per allocation, comma-separated");
ABSL_FLAG(int, pairs, 200000, "timed alloc/free pairs per size and path");
ABSL_FLAG(int, block, 1000, "pairs per block; the paths alternate by block");
ABSL_FLAG(int64_t, budget_mib, 1024, "the client's budget, in MiB");
ABSL_FLAG(std::string, update_doc, "",
          "Markdown file whose alloc_bench section to rewrite");

namespace {

using deltad::bench::Percentiles;
using deltad::bench::Summarise;
using Clock = std::chrono::steady_clock;

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr double kTargetNs = 1000;

[[noreturn]] void Die(const std::string& why) {
  std::fprintf(stderr, "alloc_bench: %s\n", why.c_str());
  std::exit(1);
}

std::string SizeName(int64_t bytes) {
  if (bytes >= kMiB && bytes % kMiB == 0)
    return absl::StrCat(bytes / kMiB, " MiB");
  if (bytes >= 1024 && bytes % 1024 == 0)
    return absl::StrCat(bytes / 1024, " KiB");
  return absl::StrCat(bytes, " B");
}

// One way to allocate and free `bytes`; false when the allocation failed.
using Pair = std::function<bool(int64_t bytes)>;

struct Path {
  Path(std::string n, Pair p) : name(std::move(n)), pair(std::move(p)) {}
  std::string name;
  Pair pair;
  std::vector<double> ns;
};

// Times `pairs` pairs of every path at `bytes`, alternating by block.
void Measure(std::vector<Path>& paths, int64_t bytes, int pairs, int block) {
  for (Path& p : paths) {
    p.ns.clear();
    p.ns.reserve(static_cast<size_t>(pairs));
    // Warm-up: the first pair of a size maps its chunks (and, the very
    // first, makes the client's chunks).
    for (int i = 0; i < 100; ++i) {
      if (!p.pair(bytes)) Die(absl::StrCat(p.name, " failed at ", bytes));
    }
  }
  for (int done = 0; done < pairs; done += block) {
    const int n = std::min(block, pairs - done);
    for (Path& p : paths) {
      for (int i = 0; i < n; ++i) {
        const Clock::time_point t0 = Clock::now();
        const bool ok = p.pair(bytes);
        const Clock::time_point t1 = Clock::now();
        if (!ok) Die(absl::StrCat(p.name, " failed at ", bytes));
        p.ns.push_back(
            std::chrono::duration<double, std::nano>(t1 - t0).count());
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::string command =
      deltad::bench::CommandLine("alloc_bench", argc, argv);
  std::vector<int64_t> sizes;
  for (absl::string_view s :
       absl::StrSplit(absl::GetFlag(FLAGS_sizes), ',', absl::SkipEmpty())) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(s, &v) || v <= 0) Die(absl::StrCat("bad size ", s));
    sizes.push_back(v);
  }
  const int pairs = absl::GetFlag(FLAGS_pairs);
  const int block = std::max(1, absl::GetFlag(FLAGS_block));
  const int64_t budget = absl::GetFlag(FLAGS_budget_mib) * kMiB;

  // The C API's client, attached as the process allocator.
  deltad_client_options o;
  deltad_client_options_init(&o);
  o.use_daemon = 0;
  o.device = "sim-chunks";
  o.fallback_budget_bytes = budget;
  o.sim_memory_bytes = 2 * budget;
  deltad_client* client = nullptr;
  if (deltad_client_connect(&o, &client) != 0 ||
      deltad_allocator_attach(client) != 0) {
    Die(deltad_last_error());
  }
  // The layers below it, each on a device of its own.
  deltad::client::ClientOptions co;
  co.use_daemon = false;
  co.fallback_budget_bytes = budget;
  auto sim_for_client =
      deltad::client::SimChunkDevice::Create(2 * budget, 0, 0);
  if (!sim_for_client.ok()) Die(std::string(sim_for_client.status().message()));
  auto cxx = deltad::client::Client::Connect(co, std::move(*sim_for_client));
  if (!cxx.ok()) Die(std::string(cxx.status().message()));
  deltad::client::Client& raw_client = **cxx;
  auto arena_device = deltad::client::SimChunkDevice::Create(2 * budget, 0, 0);
  if (!arena_device.ok()) Die(std::string(arena_device.status().message()));
  deltad::client::SimChunkDevice& device = **arena_device;
  if (absl::Status s = device.AddLocalChunks(budget); !s.ok()) {
    Die(std::string(s.message()));
  }

  std::vector<Path> paths;
  paths.emplace_back("deltad_torch_malloc + free", [](int64_t bytes) {
    void* p = deltad_torch_malloc(bytes, 0, nullptr);
    if (p == nullptr) return false;
    deltad_torch_free(p, bytes, 0, nullptr);
    return true;
  });
  paths.emplace_back("Client::AllocateRaw + FreeRaw", [&](int64_t bytes) {
    auto p = raw_client.AllocateRaw(bytes);
    if (!p.ok()) return false;
    raw_client.FreeRaw(*p, bytes);
    return true;
  });
  paths.emplace_back("device (ChunkArena) Allocate + Free", [&](int64_t bytes) {
    auto p = device.Allocate(bytes);
    if (!p.ok()) return false;
    device.Free(*p, bytes);
    return true;
  });
  paths.emplace_back("malloc + free", [](int64_t bytes) {
    void* p = std::malloc(static_cast<size_t>(bytes));
    if (p == nullptr) return false;
    // Keeps the pair from being optimised away.
    asm volatile("" : : "r"(p) : "memory");
    std::free(p);
    return true;
  });
  paths.emplace_back("clock reads only", [](int64_t) { return true; });

  struct Row {
    int64_t bytes;
    std::vector<Percentiles> by_path;
  };
  std::vector<Row> rows;
  for (int64_t bytes : sizes) {
    Measure(paths, bytes, pairs, block);
    Row row{bytes, {}};
    for (Path& p : paths) row.by_path.push_back(Summarise(p.ns));
    rows.push_back(std::move(row));
    std::fprintf(stderr, "alloc_bench: %s done\n", SizeName(bytes).c_str());
  }
  deltad_allocator_usage usage;
  deltad_allocator_stats(&usage);
  if (usage.allocated_bytes != 0 || usage.blocks != 0) {
    Die(absl::StrCat("the allocator still holds ", usage.allocated_bytes,
                     " bytes in ", usage.blocks, " blocks"));
  }

  std::ostringstream md;
  md << "## alloc_bench: the allocator's alloc/free pair\n\n"
     << "Command: `" << command << "`  \n"
     << "Machine: " << deltad::bench::CpuModel() << ", "
     << std::thread::hardware_concurrency() << " cores, no GPU  \n"
     << "Date: " << deltad::bench::Today() << "\n\n"
     << "`deltad_torch_malloc` + `deltad_torch_free` (the entry points "
        "PyTorch's CUDAPluggableAllocator calls) on a client with the "
        "\"sim-chunks\" device (memfd chunks of 2 MiB mapped into one "
        "reserved range, as a GPU's chunks are), no daemon, a budget of "
     << SizeName(budget)
     << ", attached as the process allocator; beside it, in the same run, "
        "the layers below (`Client::AllocateRaw` + `FreeRaw`, then the "
        "device's `ChunkArena` alone, each on a device of its own) and "
        "glibc `malloc` + `free` of the same size. Each pair is timed alone "
        "(two steady_clock reads, whose cost is the last column), "
     << pairs << " pairs per size and path after 100 warm-up pairs, in "
     << "blocks of " << block
     << " alternating between the paths. One thread: PyTorch's caching "
        "allocator calls the entry points under its own lock. Repeating one "
        "size reuses the run of chunks the last free left mapped (sizes of "
        "half a chunk and more) or the shared page of its size class "
        "(smaller ones).\n\n"
     << "| size | deltad p50 (ns) | deltad p99 (ns) | Client p50 (ns) | "
        "arena p50 (ns) | malloc p50 (ns) | malloc p99 (ns) | clock p50 "
        "(ns) | target | result |\n"
     << "|---:|---:|---:|---:|---:|---:|---:|---:|---|---|\n";
  bool all_met = true;
  for (const Row& r : rows) {
    const Percentiles& d = r.by_path[0];
    const bool met = d.p50 <= kTargetNs;
    all_met = all_met && met;
    md << absl::StrFormat(
        "| %s | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f | p50 <= "
        "%.0f ns | %s |\n",
        SizeName(r.bytes), d.p50, d.p99, r.by_path[1].p50, r.by_path[2].p50,
        r.by_path[3].p50, r.by_path[3].p99, r.by_path[4].p50, kTargetNs,
        deltad::bench::Verdict(met));
  }
  md << "\n";
  deltad_allocator_detach();
  deltad_client_close(client);
  const std::string doc = absl::GetFlag(FLAGS_update_doc);
  if (!deltad::bench::PrintReport(md.str(), doc, "alloc_bench")) {
    Die(absl::StrCat("could not write ", doc));
  }
  (void)all_met;  // a miss is in the table; the run itself succeeded
  return 0;
}
