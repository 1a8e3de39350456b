// The cuda backend and the cuda device on a real GPU: a daemon in this
// process serves budgets as CUDA chunks, and training processes (this binary
// re-run as a child, see main) map them, move real bytes and are killed.
// Every test skips, saying why, when there is no usable GPU.
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/cuda_device.h"
#include "common/cuda_driver.h"
#include "common/cuda_spin_kernel.h"
#include "daemon/backend/cuda_backend.h"
#include "daemon/config.h"
#include "daemon/server.h"
#include "gtest/gtest.h"
#include "tests/integration/child_process.h"

namespace deltad {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

std::string self_path;  // this binary, for the children

// --- the child: one training process --------------------------------------

// The bytes of tensor `id`: the same in the child that writes them and the
// one that checks them.
std::vector<unsigned char> Pattern(uint64_t id, int64_t bytes) {
  std::vector<unsigned char> out(static_cast<size_t>(bytes));
  std::mt19937_64 rng(id * 0x9e3779b97f4a7c15ULL);
  for (size_t i = 0; i + 8 <= out.size(); i += 8) {
    const uint64_t v = rng();
    std::memcpy(out.data() + i, &v, 8);
  }
  return out;
}

// child <socket> <budget MiB> <tensor MiB> <tensors> <hold>: tracks the
// tensors (uncomputable, so every release is an offload), reads every one
// back through the client (reloads) and compares it with what was written.
// With hold=1 it then prints READY and waits to be killed.
int RunChild(int argc, char** argv) {
  int64_t budget_mib = 0, tensor_mib = 0, tensors = 0, hold = 0;
  if (argc != 7 || !absl::SimpleAtoi(argv[3], &budget_mib) ||
      !absl::SimpleAtoi(argv[4], &tensor_mib) ||
      !absl::SimpleAtoi(argv[5], &tensors) ||
      !absl::SimpleAtoi(argv[6], &hold)) {
    std::fprintf(stderr, "child: bad arguments\n");
    return 2;
  }
  auto device = client::CudaDevice::Create(0);
  if (!device.ok()) {
    std::fprintf(stderr, "child: %s\n", device.status().ToString().c_str());
    return 1;
  }
  client::CudaDevice* cuda = device->get();
  client::ClientOptions o;
  o.link.socket_path = argv[2];
  o.link.requested_budget_bytes = budget_mib * kMiB;
  o.link.label = "gpu-test";
  o.fallback_budget_bytes = budget_mib * kMiB;
  o.fallback_host_bytes = tensors * tensor_mib * kMiB;
  o.reconnect_interval_ms = 0;
  auto c = client::Client::Connect(o, std::move(*device));
  if (!c.ok() || !(*c)->connected()) {
    std::fprintf(stderr, "child: not connected\n");
    return 1;
  }
  client::Client& cl = **c;
  const int64_t bytes = tensor_mib * kMiB;
  for (int64_t id = 1; id <= tensors; ++id) {
    client::TensorInfo t;
    t.id = static_cast<uint64_t>(id);
    t.bytes = bytes;
    t.uncomputable = true;
    auto p = cl.Track(t, nullptr);
    if (!p.ok()) {
      std::fprintf(stderr, "child: %s\n", p.status().ToString().c_str());
      return 1;
    }
    const std::vector<unsigned char> data = Pattern(t.id, bytes);
    if (cudaMemcpy(*p, data.data(), bytes, cudaMemcpyHostToDevice) !=
        cudaSuccess) {
      std::fprintf(stderr, "child: cudaMemcpy to tensor %ld failed\n",
                   static_cast<long>(id));
      return 1;
    }
    cl.Unpin(t.id);
  }
  std::vector<unsigned char> back(static_cast<size_t>(bytes));
  int64_t bad = 0;
  for (int64_t id = 1; id <= tensors; ++id) {
    auto p = cl.Pin(static_cast<uint64_t>(id));
    if (!p.ok()) {
      std::fprintf(stderr, "child: %s\n", p.status().ToString().c_str());
      return 1;
    }
    if (cudaMemcpy(back.data(), *p, bytes, cudaMemcpyDeviceToHost) !=
            cudaSuccess ||
        back != Pattern(static_cast<uint64_t>(id), bytes)) {
      ++bad;
    }
    cl.Unpin(static_cast<uint64_t>(id));
  }
  const client::ClientStats s = cl.Stats();
  std::printf("offloads %ld reloads %ld bad %ld copy_error %s\n",
              static_cast<long>(s.offloads), static_cast<long>(s.reloads),
              static_cast<long>(bad), cuda->last_error().ToString().c_str());
  std::fflush(stdout);
  if (bad != 0 || !cuda->last_error().ok()) return 1;
  if (hold != 0) {
    std::printf("READY\n");
    std::fflush(stdout);
    for (;;) pause();
  }
  return 0;
}

// --- the tests
// ----------------------------------------------------------------

std::string WhyNoGpu() { return daemon::CudaBackend::ProbeCuda(); }

// The daemon's budget for GPU 0, small next to any GPU's memory: with the
// default gpu_share (0.9 of, say, 80 GB) a session borrows beyond its share
// while the GPU's budget has room (GpuPolicy::MakeRoom releases only what
// the GPU lacks), so the children's 1 GiB would all stay on the device and
// nothing would be offloaded.
constexpr int64_t kGpuBudgetBytes = 512 * kMiB;

// GPU 0's memory, as the cuda backend reads it (no context needed).
int64_t Gpu0MemoryBytes() {
  absl::StatusOr<const common::CudaDriver*> driver = common::CudaDriver::Get();
  if (!driver.ok()) return 0;
  const common::CudaDriver& d = **driver;
  CUdevice device = 0;
  size_t total = 0;
  if (d.cuDeviceGet(&device, 0) != CUDA_SUCCESS ||
      d.cuDeviceTotalMem(&total, device) != CUDA_SUCCESS) {
    return 0;
  }
  return static_cast<int64_t>(total);
}

#define SKIP_WITHOUT_GPU()                                  \
  do {                                                      \
    if (const std::string why = WhyNoGpu(); !why.empty()) { \
      GTEST_SKIP() << "no CUDA GPU: " << why;               \
    }                                                       \
  } while (0)

class GpuTest : public ::testing::Test {
 protected:
  void TearDown() override {
    server_.reset();
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }

  void StartDaemon() {
    dir_ = std::filesystem::temp_directory_path() /
           ("deltad-gpu-test-" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
    socket_ = (dir_ / "d.sock").string();
    v1::DaemonConfig c;
    c.set_socket_path(socket_);
    c.set_metrics_address("127.0.0.1:0");
    c.set_backend("cuda");
    c.mutable_cuda()->set_measure_bandwidth(false);
    const int64_t memory = Gpu0MemoryBytes();
    ASSERT_GT(memory, kGpuBudgetBytes);
    // Half a MiB over, so that the budget, rounded down to whole chunks,
    // is kGpuBudgetBytes.
    c.set_gpu_share(static_cast<double>(kGpuBudgetBytes + kMiB / 2) /
                    static_cast<double>(memory));
    c.set_min_session_bytes(64 * kMiB);
    c.set_host_pool_bytes(4096 * kMiB);
    c.set_host_slab_bytes(64 * kMiB);
    c.set_default_host_quota_bytes(1024 * kMiB);
    c = daemon::WithDefaults(c);
    ASSERT_TRUE(daemon::ValidateConfig(c).ok());
    auto s = daemon::Server::Start(c);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
    const int64_t budget = server_->node().Status().gpus(0).budget_bytes();
    ASSERT_GT(budget, kGpuBudgetBytes / 2);
    ASSERT_LE(budget, kGpuBudgetBytes + kMiB);
  }

  std::unique_ptr<testing_util::ChildProcess> Child(int64_t budget_mib,
                                                    int64_t tensor_mib,
                                                    int64_t tensors, bool hold,
                                                    const std::string& out) {
    testing_util::SpawnOptions o;
    o.output_file = (dir_ / out).string();
    auto child = testing_util::ChildProcess::Spawn(
        {self_path, "--child", socket_, std::to_string(budget_mib),
         std::to_string(tensor_mib), std::to_string(tensors), hold ? "1" : "0"},
        o);
    EXPECT_TRUE(child.ok()) << child.status();
    return child.ok() ? std::move(*child) : nullptr;
  }

  std::string Output(const std::string& out) const {
    std::FILE* f = std::fopen((dir_ / out).c_str(), "r");
    if (f == nullptr) return "";
    std::string text;
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) text.append(buf, n);
    std::fclose(f);
    return text;
  }

  bool Eventually(const std::function<bool()>& pred,
                  absl::Duration within = absl::Seconds(30)) {
    const absl::Time end = absl::Now() + within;
    while (absl::Now() < end) {
      if (pred()) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return pred();
  }

  std::filesystem::path dir_;
  std::string socket_;
  std::unique_ptr<daemon::Server> server_;
};

TEST_F(GpuTest, TwoProcessesMapChunksOfOneBudgetAndKeepTheirBytes) {
  SKIP_WITHOUT_GPU();
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  // 1 GiB of 64 MiB tensors each within 256 MiB, on a GPU budget of
  // 512 MiB: most go to the host and come back.
  auto a = Child(256, 64, 16, /*hold=*/false, "a.out");
  auto b = Child(256, 64, 16, /*hold=*/false, "b.out");
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  bool both_mapped = false;
  EXPECT_TRUE(Eventually([&] {
    const v1::NodeStatusResponse s = server_->node().Status();
    if (s.sessions_size() == 2 && s.sessions(0).chunk_bytes() > 0 &&
        s.sessions(1).chunk_bytes() > 0) {
      both_mapped = true;
      EXPECT_LE(s.gpus(0).chunk_bytes(), s.gpus(0).budget_bytes());
    }
    return both_mapped || (!a->Running() && !b->Running());
  }));
  EXPECT_TRUE(both_mapped) << "the two sessions never held chunks at once";
  const auto a_exit = a->Wait(absl::Seconds(120));
  const auto b_exit = b->Wait(absl::Seconds(120));
  ASSERT_TRUE(a_exit.has_value() && b_exit.has_value());
  EXPECT_TRUE(a_exit->ok()) << a_exit->ToString() << "\n" << Output("a.out");
  EXPECT_TRUE(b_exit->ok()) << b_exit->ToString() << "\n" << Output("b.out");
  EXPECT_NE(Output("a.out").find(" bad 0 "), std::string::npos)
      << Output("a.out");
  EXPECT_EQ(Output("a.out").find("offloads 0 "), std::string::npos)
      << "nothing was offloaded: " << Output("a.out");
  EXPECT_TRUE(Eventually(
      [&] { return server_->node().Status().gpus(0).chunk_bytes() == 0; }));
}

TEST_F(GpuTest, AKilledProcessWithChunksMappedIsReclaimedWithinASecond) {
  SKIP_WITHOUT_GPU();
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  auto held = Child(512, 64, 4, /*hold=*/true, "held.out");
  ASSERT_NE(held, nullptr);
  ASSERT_TRUE(Eventually([&] {
    return Output("held.out").find("READY") != std::string::npos ||
           !held->Running();
  }));
  ASSERT_TRUE(held->Running()) << Output("held.out");
  ASSERT_GT(server_->node().Status().gpus(0).chunk_bytes(), 0);
  held->Signal(SIGKILL);
  // The second counts from the process's end: the kernel closes its
  // sockets only as it exits, after tearing down its GPU mappings and along
  // with the driver's files (its CUDA context), which on a large GPU can
  // take a good part of a second by itself.
  const auto killed = held->Wait(absl::Seconds(30));
  ASSERT_TRUE(killed.has_value()) << "the killed child did not end";
  EXPECT_EQ(killed->signal, SIGKILL) << killed->ToString();
  EXPECT_TRUE(Eventually(
      [&] {
        const v1::NodeStatusResponse s = server_->node().Status();
        return s.sessions_size() == 0 && s.gpus(0).chunk_bytes() == 0;
      },
      absl::Seconds(1)));
  // And the memory is the GPU's again: a session that asks for it gets it.
  auto next = Child(512, 64, 4, /*hold=*/false, "next.out");
  ASSERT_NE(next, nullptr);
  const auto exit = next->Wait(absl::Seconds(60));
  ASSERT_TRUE(exit.has_value());
  EXPECT_TRUE(exit->ok()) << Output("next.out");
}

TEST_F(GpuTest, ADeviceCannotAllocateBeyondTheChunksItHolds) {
  SKIP_WITHOUT_GPU();
  auto device = client::CudaDevice::Create(0);
  ASSERT_TRUE(device.ok()) << device.status();
  client::CudaDevice& d = **device;
  const int64_t chunk = d.chunk_granularity();
  ASSERT_TRUE(d.AddLocalChunks(32 * chunk).ok());
  EXPECT_EQ(d.chunk_bytes_held(), 32 * chunk);
  auto all = d.Allocate(32 * chunk);
  ASSERT_TRUE(all.ok()) << all.status();
  auto more = d.Allocate(1);
  EXPECT_EQ(more.status().code(), absl::StatusCode::kResourceExhausted);
  d.Free(*all, 32 * chunk);
  EXPECT_TRUE(d.Allocate(1).ok());
}

TEST_F(GpuTest, AReloadRunsWhileAKernelComputes) {
  SKIP_WITHOUT_GPU();
  auto device = client::CudaDevice::Create(0);
  ASSERT_TRUE(device.ok()) << device.status();
  client::CudaDevice& d = **device;
  const int64_t bytes = 64 * kMiB;
  ASSERT_TRUE(d.AddLocalChunks(bytes).ok());
  auto dst = d.Allocate(bytes);
  ASSERT_TRUE(dst.ok()) << dst.status();
  std::vector<unsigned char> host = Pattern(7, bytes);
  ASSERT_TRUE(d.RegisterHost(host.data(), bytes).ok());

  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  cudaStream_t compute;
  ASSERT_EQ(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking),
            cudaSuccess);
  cudaEvent_t kernel_done;
  ASSERT_EQ(cudaEventCreate(&kernel_done), cudaSuccess);
  auto spin = common::SpinKernel::Load(0);
  ASSERT_TRUE(spin.ok()) << spin.status();
  // About a second at any clock a GPU runs at: far longer than the copy.
  ASSERT_TRUE((*spin)->Launch(compute, int64_t{2'000'000'000}).ok());
  ASSERT_EQ(cudaEventRecord(kernel_done, compute), cudaSuccess);
  d.SetComputeStream(compute);
  // The reload goes on its own stream: it does not wait for the kernel.
  d.CopyToDevice(*dst, host.data(), bytes);
  EXPECT_EQ(cudaEventQuery(kernel_done), cudaErrorNotReady)
      << "the copy waited for the kernel";
  ASSERT_EQ(cudaStreamSynchronize(compute), cudaSuccess);
  std::vector<unsigned char> back(static_cast<size_t>(bytes));
  d.CopyToHost(back.data(), *dst, bytes);
  EXPECT_TRUE(d.last_error().ok()) << d.last_error();
  EXPECT_EQ(back, host);
  d.UnregisterHost(host.data());
  d.Free(*dst, bytes);
  cudaEventDestroy(kernel_done);
  cudaStreamDestroy(compute);
}

}  // namespace
}  // namespace deltad

int main(int argc, char** argv) {
  deltad::self_path = std::filesystem::canonical("/proc/self/exe").string();
  if (argc > 1 && std::strcmp(argv[1], "--child") == 0) {
    return deltad::RunChild(argc, argv);
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
