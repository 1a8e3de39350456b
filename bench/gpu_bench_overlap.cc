#include "bench/gpu_bench_overlap.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "bench/gpu_bench_support.h"
#include "common/cuda_spin_kernel.h"

namespace deltad::bench {

std::vector<OverlapRow> MeasureOverlap(client::CudaDevice& device,
                                       int64_t bytes, int reps) {
  absl::StatusOr<std::unique_ptr<common::SpinKernel>> spin =
      common::SpinKernel::Load(device.ordinal());
  Check(spin.status());
  cudaStream_t compute = nullptr;
  CheckRt(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking),
          "cudaStreamCreateWithFlags");
  device.SetComputeStream(compute);
  absl::StatusOr<void*> p = device.Allocate(bytes);
  Check(p.status());
  HostBuffer host(bytes);
  Check(device.RegisterHost(host.data, bytes));

  const auto kernel_ms = [&](int64_t cycles) {
    const auto t0 = Clock::now();
    Check((*spin)->Launch(compute, cycles));
    CheckRt(cudaStreamSynchronize(compute), "cudaStreamSynchronize");
    return Millis(Clock::now() - t0);
  };
  // The kernel is sized to half the copy: the D2H case must launch it just
  // after the copy has ordered itself on the compute stream (or the copy
  // would wait for it), and that short delay then hides inside the copy.
  (void)kernel_ms(1'000'000);  // JIT and first-launch costs
  constexpr int64_t kProbeCycles = 20'000'000;
  const double cycles_per_ms =
      static_cast<double>(kProbeCycles) / kernel_ms(kProbeCycles);
  device.CopyToHost(host.data, *p, bytes);
  const auto c0 = Clock::now();
  device.CopyToHost(host.data, *p, bytes);
  const double one_copy_ms = Millis(Clock::now() - c0);
  const auto cycles = static_cast<int64_t>(cycles_per_ms * one_copy_ms / 2);

  std::vector<OverlapRow> rows;
  for (bool d2h : {true, false}) {
    Note(absl::StrCat("overlap, ", SizeName(bytes), d2h ? " D2H" : " H2D"));
    std::vector<double> k, c, both;
    for (int i = 0; i < reps; ++i) {
      k.push_back(kernel_ms(cycles));
      const auto t0 = Clock::now();
      if (d2h) {
        device.CopyToHost(host.data, *p, bytes);
      } else {
        device.CopyToDevice(*p, host.data, bytes);
      }
      c.push_back(Millis(Clock::now() - t0));
      CheckRt(cudaStreamSynchronize(compute), "cudaStreamSynchronize");

      if (d2h) {
        // The copy from another thread, as the executor makes it; the
        // kernel queued once the copy has had time to order itself.
        std::atomic<bool> started{false};
        Clock::time_point copy_end;
        const auto start = Clock::now();
        std::thread copier([&] {
          started.store(true);
          device.CopyToHost(host.data, *p, bytes);
          copy_end = Clock::now();
        });
        while (!started.load()) std::this_thread::yield();
        std::this_thread::sleep_for(std::chrono::microseconds(200));
        Check((*spin)->Launch(compute, cycles));
        CheckRt(cudaStreamSynchronize(compute), "cudaStreamSynchronize");
        const auto kernel_end = Clock::now();
        copier.join();
        both.push_back(Millis(std::max(kernel_end, copy_end) - start));
      } else {
        // Queued compute does not hold a reload back: one thread will do.
        const auto start = Clock::now();
        Check((*spin)->Launch(compute, cycles));
        device.CopyToDevice(*p, host.data, bytes);
        CheckRt(cudaStreamSynchronize(compute), "cudaStreamSynchronize");
        both.push_back(Millis(Clock::now() - start));
      }
    }
    Check(device.last_error());
    rows.push_back(OverlapRow{
        .copy = absl::StrCat(SizeName(bytes),
                             d2h ? " D2H (CopyToHost)" : " H2D (CopyToDevice)"),
        .kernel_ms = Median(k),
        .copy_ms = Median(c),
        .both_ms = Median(both)});
  }
  device.UnregisterHost(host.data);
  device.Free(*p, bytes);
  device.SetComputeStream(nullptr);
  CheckRt(cudaStreamDestroy(compute), "cudaStreamDestroy");
  return rows;
}

}  // namespace deltad::bench
