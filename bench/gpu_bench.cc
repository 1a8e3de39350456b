// gpu_bench: the client's CUDA device path on a real GPU, next to plain CUDA.
//
//  (a) copies: CudaDevice::CopyToHost / CopyToDevice (the executor's path:
//      copy streams of their own, ordered against the compute stream by
//      events, host memory pinned with cudaHostRegister) beside a bare
//      cudaMemcpyAsync between cudaMallocHost and cudaMalloc memory, at
//      several sizes; the target is >= 0.9 of the bare bandwidth;
//  (b) chunk mapping: CudaChunkMapper Map (cuMemMap + cuMemSetAccess) and
//      Unmap (cuMemUnmap) of one chunk, p50/p99;
//  (c) allocation: ChunkArena Allocate + Free through a CudaDevice holding
//      local chunks, beside cudaMalloc + cudaFree of the same sizes;
//  (d) copy/compute overlap: a spin kernel on the compute stream and a copy
//      through CudaDevice on its own stream, alone and together.
// Without a usable GPU it prints one line and exits 77 (a skip, to ctest
// and scripts). --update_doc=FILE rewrites this benchmark's section of
// docs/BENCHMARKS.md.

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/gpu_bench_overlap.h"
#include "bench/gpu_bench_support.h"
#include "bench/report.h"
#include "client/chunk_arena.h"
#include "client/cuda_chunk_mapper.h"
#include "client/cuda_device.h"
#include "common/cuda_driver.h"
#include "common/cuda_spin_kernel.h"

ABSL_FLAG(int, device, 0, "CUDA device ordinal to measure");
ABSL_FLAG(std::string, copy_sizes_mib, "1,16,256",
          "copy sizes for (a), in MiB, comma-separated");
ABSL_FLAG(int, copy_reps, 20, "timed copies per size, direction and path");
ABSL_FLAG(std::string, map_sizes_mib, "2,32",
          "chunk sizes for (b), in MiB (multiples of the granularity)");
ABSL_FLAG(int, map_reps, 1000, "timed Map + Unmap pairs per chunk size");
ABSL_FLAG(int, alloc_rounds, 200,
          "rounds of (c), each allocating a batch of 8 and freeing it");
ABSL_FLAG(int64_t, overlap_mib, 256, "copy size for (d), in MiB");
ABSL_FLAG(int, overlap_reps, 5, "repetitions of each case of (d)");
ABSL_FLAG(std::string, update_doc, "",
          "rewrite the gpu_bench section of this Markdown file");

namespace deltad::bench {
namespace {

// --- (a) copies.

struct CopyRow {
  int64_t bytes = 0;
  bool d2h = true;
  double deltad_gbps = 0;
  double raw_gbps = 0;
  double ratio() const { return raw_gbps > 0 ? deltad_gbps / raw_gbps : 0; }
};

std::vector<CopyRow> MeasureCopies(client::CudaDevice& device,
                                   const std::vector<int64_t>& sizes,
                                   int reps) {
  const int64_t largest = *std::max_element(sizes.begin(), sizes.end());
  // deltad's path: arena memory, heap memory registered once.
  absl::StatusOr<void*> arena_ptr = device.Allocate(largest);
  Check(arena_ptr.status());
  HostBuffer host(largest);
  Check(device.RegisterHost(host.data, largest));
  // The bare path: the fastest memory CUDA offers, one stream.
  void* pinned = nullptr;
  void* raw_device = nullptr;
  cudaStream_t stream = nullptr;
  CheckRt(cudaMallocHost(&pinned, static_cast<size_t>(largest)),
          "cudaMallocHost");
  CheckRt(cudaMalloc(&raw_device, static_cast<size_t>(largest)), "cudaMalloc");
  CheckRt(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
          "cudaStreamCreateWithFlags");
  CheckRt(cudaMemset(raw_device, 0, static_cast<size_t>(largest)),
          "cudaMemset");
  CheckRt(cudaMemset(*arena_ptr, 0, static_cast<size_t>(largest)),
          "cudaMemset");
  std::memset(pinned, 0x5a, static_cast<size_t>(largest));

  std::vector<CopyRow> rows;
  for (bool d2h : {true, false}) {
    for (int64_t bytes : sizes) {
      Note(absl::StrCat("copies of ", SizeName(bytes), d2h ? " D2H" : " H2D"));
      std::vector<double> ours;
      std::vector<double> raw;
      // Alternating, after one warm-up each, so drift hits both alike.
      for (int i = -1; i < reps; ++i) {
        auto t0 = Clock::now();
        if (d2h) {
          device.CopyToHost(host.data, *arena_ptr, bytes);
        } else {
          device.CopyToDevice(*arena_ptr, host.data, bytes);
        }
        auto t1 = Clock::now();
        CheckRt(
            cudaMemcpyAsync(
                d2h ? pinned : raw_device, d2h ? raw_device : pinned,
                static_cast<size_t>(bytes),
                d2h ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice, stream),
            "cudaMemcpyAsync");
        CheckRt(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
        auto t2 = Clock::now();
        if (i >= 0) {
          ours.push_back(Micros(t1 - t0));
          raw.push_back(Micros(t2 - t1));
        }
      }
      Check(device.last_error());
      CopyRow row{.bytes = bytes, .d2h = d2h};
      row.deltad_gbps = static_cast<double>(bytes) / Median(ours) / 1e3;
      row.raw_gbps = static_cast<double>(bytes) / Median(raw) / 1e3;
      rows.push_back(row);
    }
  }
  CheckRt(cudaStreamDestroy(stream), "cudaStreamDestroy");
  CheckRt(cudaFree(raw_device), "cudaFree");
  CheckRt(cudaFreeHost(pinned), "cudaFreeHost");
  device.UnregisterHost(host.data);
  device.Free(*arena_ptr, largest);
  return rows;
}

// --- (b) chunk mapping.

struct MapRow {
  int64_t bytes = 0;
  Percentiles map_us;
  Percentiles unmap_us;
  Percentiles both_us;
};

// A chunk as the daemon's cuda backend makes one: cuMemCreate, exported as
// a POSIX fd.
int ExportedChunk(const common::PrimaryContext& context, int64_t bytes) {
  const common::CudaDriver& d = context.driver();
  common::ScopedContext scope(context);
  Check(scope.status());
  const CUmemAllocationProp prop = common::ChunkProperties(context.device());
  CUmemGenericAllocationHandle handle = 0;
  Check(common::CudaCheck(
      d, d.cuMemCreate(&handle, static_cast<size_t>(bytes), &prop, 0),
      "cuMemCreate"));
  absl::StatusOr<common::UniqueFd> fd =
      common::ExportChunk(d, handle, "a benchmark chunk");
  (void)d.cuMemRelease(handle);  // the fd holds it
  Check(fd.status());
  return fd->release();
}

std::vector<MapRow> MeasureMapping(int ordinal,
                                   const std::vector<int64_t>& sizes,
                                   int reps) {
  absl::StatusOr<std::unique_ptr<client::CudaChunkMapper>> mapper =
      client::CudaChunkMapper::Create(ordinal);
  Check(mapper.status());
  std::vector<MapRow> rows;
  for (int64_t bytes : sizes) {
    if (bytes % (*mapper)->granularity() != 0) {
      Die(absl::StrCat("--map_sizes_mib: ", SizeName(bytes),
                       " is not a multiple of the ",
                       SizeName((*mapper)->granularity()), " granularity"));
    }
    Note(absl::StrCat(reps, " maps and unmaps of a ", SizeName(bytes),
                      " chunk"));
    const int fd = ExportedChunk((*mapper)->context(), bytes);
    absl::StatusOr<uint64_t> handle = (*mapper)->Import(fd, bytes);
    Check(handle.status());
    absl::StatusOr<uintptr_t> base = (*mapper)->Reserve(bytes, bytes);
    Check(base.status());
    MapRow row;
    row.bytes = bytes;
    std::vector<double> map_us, unmap_us, both_us;
    for (int i = -10; i < reps; ++i) {  // 10 warm-up pairs
      const auto t0 = Clock::now();
      Check((*mapper)->Map(*handle, *base, bytes));
      const auto t1 = Clock::now();
      Check((*mapper)->Unmap(*base, bytes));
      const auto t2 = Clock::now();
      if (i >= 0) {
        map_us.push_back(Micros(t1 - t0));
        unmap_us.push_back(Micros(t2 - t1));
        both_us.push_back(Micros(t2 - t0));
      }
    }
    row.map_us = Summarise(map_us);
    row.unmap_us = Summarise(unmap_us);
    row.both_us = Summarise(both_us);
    rows.push_back(row);
    (*mapper)->Unreserve(*base, bytes);
    (*mapper)->Release(*handle);
    close(fd);
  }
  return rows;
}

// --- (c) allocation.

struct AllocRow {
  std::string sizes;
  double arena_us = 0;  // per Allocate + Free pair
  double cuda_us = 0;   // per cudaMalloc + cudaFree pair
};

AllocRow MeasureAllocation(client::CudaDevice& device, const std::string& name,
                           const std::vector<int64_t>& sizes, int rounds) {
  Note(absl::StrCat("allocation, ", name));
  std::mt19937_64 rng(42);
  std::vector<int64_t> sequence;
  for (int i = 0; i < rounds * kAllocBatch; ++i) {
    sequence.push_back(sizes[rng() % sizes.size()]);
  }
  // Each round allocates a batch and frees it in another order, so that
  // both allocators see interleaved lifetimes, not only LIFO.
  std::vector<size_t> order(kAllocBatch);
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::vector<std::vector<size_t>> orders;
  for (int r = 0; r < rounds; ++r) {
    std::shuffle(order.begin(), order.end(), rng);
    orders.push_back(order);
  }
  std::vector<void*> live(kAllocBatch);

  const auto arena_start = Clock::now();
  for (int r = 0; r < rounds; ++r) {
    for (int i = 0; i < kAllocBatch; ++i) {
      absl::StatusOr<void*> p = device.Allocate(sequence[r * kAllocBatch + i]);
      Check(p.status());
      live[i] = *p;
    }
    for (size_t i : orders[r]) {
      device.Free(live[i], sequence[r * kAllocBatch + i]);
    }
  }
  const double arena_us = Micros(Clock::now() - arena_start);

  const auto cuda_start = Clock::now();
  for (int r = 0; r < rounds; ++r) {
    for (int i = 0; i < kAllocBatch; ++i) {
      CheckRt(cudaMalloc(&live[i],
                         static_cast<size_t>(sequence[r * kAllocBatch + i])),
              "cudaMalloc");
    }
    for (size_t i : orders[r]) CheckRt(cudaFree(live[i]), "cudaFree");
  }
  const double cuda_us = Micros(Clock::now() - cuda_start);
  const double pairs = static_cast<double>(sequence.size());
  return AllocRow{
      .sizes = name, .arena_us = arena_us / pairs, .cuda_us = cuda_us / pairs};
}

}  // namespace
}  // namespace deltad::bench

int main(int argc, char** argv) {
  using namespace deltad;
  using namespace deltad::bench;
  const std::string command = CommandLine("gpu_bench", argc, argv);
  absl::ParseCommandLine(argc, argv);
  const int ordinal = absl::GetFlag(FLAGS_device);
  const std::vector<int64_t> copy_sizes =
      ParseMiB(absl::GetFlag(FLAGS_copy_sizes_mib), "copy_sizes_mib");
  const std::vector<int64_t> map_sizes =
      ParseMiB(absl::GetFlag(FLAGS_map_sizes_mib), "map_sizes_mib");
  const int copy_reps = absl::GetFlag(FLAGS_copy_reps);
  const int map_reps = absl::GetFlag(FLAGS_map_reps);
  const int alloc_rounds = absl::GetFlag(FLAGS_alloc_rounds);
  const int64_t overlap_bytes = absl::GetFlag(FLAGS_overlap_mib) * kMiB;
  const int overlap_reps = absl::GetFlag(FLAGS_overlap_reps);
  if (copy_reps < 1 || map_reps < 1 || alloc_rounds < 1 || overlap_bytes <= 0 ||
      overlap_reps < 1) {
    Die("--copy_reps, --map_reps, --alloc_rounds, --overlap_mib and "
        "--overlap_reps must be positive");
  }

  absl::StatusOr<const common::CudaDriver*> driver = common::CudaDriver::Get();
  if (!driver.ok()) {
    std::printf("gpu_bench: no CUDA GPU (%s); nothing measured\n",
                std::string(driver.status().message()).c_str());
    return kExitSkipped;
  }
  absl::StatusOr<std::unique_ptr<client::CudaDevice>> created =
      client::CudaDevice::Create(ordinal);
  if (!created.ok()) {
    std::printf("gpu_bench: no CUDA GPU (%s); nothing measured\n",
                std::string(created.status().message()).c_str());
    return kExitSkipped;
  }
  client::CudaDevice& device = **created;
  const common::CudaDriver& d = **driver;
  char name[256] = {};
  {
    CUdevice dev = 0;
    Check(common::CudaCheck(d, d.cuDeviceGet(&dev, ordinal), "cuDeviceGet"));
    Check(common::CudaCheck(d, d.cuDeviceGetName(name, sizeof name - 1, dev),
                            "cuDeviceGetName"));
  }
  CheckRt(cudaSetDevice(ordinal), "cudaSetDevice");

  // Room for the largest copy, then for a batch of the largest allocation.
  const int64_t largest_copy = std::max(
      *std::max_element(copy_sizes.begin(), copy_sizes.end()), overlap_bytes);
  const int64_t local_bytes =
      std::max(largest_copy, kAllocBatch * 64 * kMiB) + 64 * kMiB;
  Note(absl::StrCat(name, ": ", SizeName(local_bytes), " of local chunks"));
  Check(device.AddLocalChunks(local_bytes));
  const int64_t chunk = device.arena()->chunk_bytes();

  const std::vector<CopyRow> copies =
      MeasureCopies(device, copy_sizes, copy_reps);
  const std::vector<MapRow> maps = MeasureMapping(ordinal, map_sizes, map_reps);
  std::vector<AllocRow> allocs;
  for (const std::vector<int64_t>& sizes : std::vector<std::vector<int64_t>>{
           {4 * kKiB},
           {256 * kKiB},
           {2 * kMiB},
           {16 * kMiB},
           {64 * kMiB},
           {512, 4 * kKiB, 48 * kKiB, 256 * kKiB, 1 * kMiB, 3 * kMiB, 16 * kMiB,
            40 * kMiB}}) {
    std::string label = sizes.size() == 1 ? SizeName(sizes[0])
                                          : "mix of 512 B .. 40 MiB (8 sizes)";
    allocs.push_back(MeasureAllocation(device, label, sizes, alloc_rounds));
  }
  const std::vector<OverlapRow> overlaps =
      MeasureOverlap(device, overlap_bytes, overlap_reps);

  // --- Report.
  std::ostringstream md;
  md << "## gpu_bench: GPU copies, chunk mapping, allocation and overlap\n\n"
     << "Command: `" << command << "`  \n"
     << "Device: " << name << " (CUDA device " << ordinal << ", driver "
     << d.driver_version / 1000 << "." << d.driver_version % 1000 / 10
     << ", runtime " << d.runtime_version / 1000 << "."
     << d.runtime_version % 1000 / 10 << "), "
     << absl::StrFormat("%.1f", 1.0 * device.memory_bytes() / (kMiB * 1024))
     << " GiB; host " << CpuModel() << ", "
     << std::thread::hardware_concurrency() << " cores  \nDate: " << Today()
     << "\n\n"
     << "The client's `CudaDevice` holds " << SizeName(local_bytes)
     << " of local chunks of " << SizeName(chunk)
     << " (cuMemCreate, exported as POSIX fds and mapped by "
        "`CudaChunkMapper` into one `ChunkArena`), as when no daemon grants "
        "chunks.\n\n"
     << "**Copies.** `CopyToHost` and `CopyToDevice` between arena memory "
        "and page-aligned heap memory pinned once with `RegisterHost` "
        "(cudaHostRegister), on the device's own copy streams with the "
        "event ordering against the compute stream, timed on the host until "
        "each returns; beside them a bare `cudaMemcpyAsync` + "
        "`cudaStreamSynchronize` between `cudaMallocHost` and `cudaMalloc` "
        "memory. Median of "
     << copy_reps << " copies each, alternating, after a warm-up.\n\n"
     << "| direction | size | deltad GB/s | bare GB/s | deltad / bare | "
        "target | result |\n"
     << "|---|---:|---:|---:|---:|---|---|\n";
  for (const CopyRow& r : copies) {
    md << absl::StrFormat("| %s | %s | %.2f | %.2f | %.2f | >= 0.90 | %s |\n",
                          r.d2h ? "D2H" : "H2D", SizeName(r.bytes),
                          r.deltad_gbps, r.raw_gbps, r.ratio(),
                          Verdict(r.ratio() >= 0.9));
  }
  md << "\n**Chunk mapping.** `CudaChunkMapper::Map` (cuMemMap + "
        "cuMemSetAccess) and `Unmap` (cuMemUnmap) of one imported chunk at "
        "the start of its reservation, "
     << map_reps << " pairs after 10 warm-up pairs.\n\n"
     << "| chunk | Map p50 (us) | Map p99 (us) | Unmap p50 (us) | Unmap p99 "
        "(us) | Map + Unmap p50 (us) | Map + Unmap p99 (us) |\n"
     << "|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const MapRow& r : maps) {
    md << absl::StrFormat("| %s | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f |\n",
                          SizeName(r.bytes), r.map_us.p50, r.map_us.p99,
                          r.unmap_us.p50, r.unmap_us.p99, r.both_us.p50,
                          r.both_us.p99);
  }
  md << "\n**Allocation.** " << alloc_rounds << " rounds of " << kAllocBatch
     << " allocations freed in a shuffled order: `CudaDevice::Allocate` + "
        "`Free` (the `ChunkArena`: mapping whole chunks for sizes of half a "
        "chunk and more, carving shared chunks below) beside `cudaMalloc` + "
        "`cudaFree` of the same sequence. Time per allocate-and-free pair.\n\n"
     << "| sizes | arena (us) | cudaMalloc (us) | arena / cudaMalloc |\n"
     << "|---|---:|---:|---:|\n";
  for (const AllocRow& r : allocs) {
    md << absl::StrFormat("| %s | %.2f | %.2f | %.2f |\n", r.sizes, r.arena_us,
                          r.cuda_us, r.arena_us / r.cuda_us);
  }
  md << "\n**Copy/compute overlap.** A spin kernel (one thread on one SM "
        "reading %clock64, sized to about half the copy) on the compute "
        "stream and a copy through `CudaDevice` on its own stream: each "
        "alone, then both at once. For D2H the copy is made from a second "
        "thread, as the executor makes it, and the kernel queued 200 us "
        "later (queued before, the copy would rightly wait for it); for "
        "H2D the kernel is queued first. overlap = (kernel + copy - both) / "
        "min(kernel, copy): 1 when the shorter one hides entirely. Median "
        "of "
     << overlap_reps << " runs.\n\n"
     << "| copy | kernel alone (ms) | copy alone (ms) | both (ms) | overlap "
        "|\n"
     << "|---|---:|---:|---:|---:|\n";
  for (const OverlapRow& r : overlaps) {
    md << absl::StrFormat("| %s | %.2f | %.2f | %.2f | %.2f |\n", r.copy,
                          r.kernel_ms, r.copy_ms, r.both_ms, r.overlap());
  }
  md << "\n";
  const std::string doc = absl::GetFlag(FLAGS_update_doc);
  if (!PrintReport(md.str(), doc, "gpu_bench")) {
    Die(absl::StrCat("could not write ", doc));
  }
  if (!doc.empty()) Note(absl::StrCat("updated ", doc));
  return 0;
}
