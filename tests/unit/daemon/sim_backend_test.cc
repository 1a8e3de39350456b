#include "daemon/backend/sim_backend.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gtest/gtest.h"

namespace deltad::daemon {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kGiB = int64_t{1} << 30;

std::unique_ptr<SimBackend> Make(SimBackendOptions options = {}) {
  absl::StatusOr<std::unique_ptr<SimBackend>> backend =
      SimBackend::Create(std::move(options));
  EXPECT_TRUE(backend.ok()) << backend.status();
  return backend.ok() ? *std::move(backend) : nullptr;
}

SimBackendOptions Small(int gpus, int64_t memory_bytes) {
  SimBackendOptions options;
  options.gpus = gpus;
  options.memory_bytes = memory_bytes;
  return options;
}

bool MessageHas(const absl::Status& s, const std::string& part) {
  return std::string(s.message()).find(part) != std::string::npos;
}

bool FdIsOpen(int fd) { return fcntl(fd, F_GETFD) != -1 || errno != EBADF; }

// Sends `fd` through a Unix socket pair and returns the descriptor received,
// as the daemon passes a chunk to its client.
int PassThroughSocket(int fd) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) return -1;
  char byte = 'x';
  iovec iov{.iov_base = &byte, .iov_len = 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
  cmsg->cmsg_level = SOL_SOCKET;
  cmsg->cmsg_type = SCM_RIGHTS;
  cmsg->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(cmsg), &fd, sizeof(int));
  int received = -1;
  if (sendmsg(sv[0], &msg, 0) == 1) {
    msghdr in{};
    char in_byte = 0;
    iovec in_iov{.iov_base = &in_byte, .iov_len = 1};
    alignas(cmsghdr) char in_control[CMSG_SPACE(sizeof(int))] = {};
    in.msg_iov = &in_iov;
    in.msg_iovlen = 1;
    in.msg_control = in_control;
    in.msg_controllen = sizeof(in_control);
    if (recvmsg(sv[1], &in, 0) == 1) {
      cmsghdr* c = CMSG_FIRSTHDR(&in);
      if (c != nullptr && c->cmsg_type == SCM_RIGHTS) {
        std::memcpy(&received, CMSG_DATA(c), sizeof(int));
      }
    }
  }
  close(sv[0]);
  close(sv[1]);
  return received;
}

// --- Options
// --------------------------------------------------------------------

TEST(SimBackendCreate, AcceptsDefaultsOfEightGpusOf80GiB) {
  std::unique_ptr<SimBackend> backend = Make();
  ASSERT_NE(backend, nullptr);
  EXPECT_EQ(backend->name(), "sim");
  ASSERT_EQ(backend->gpus().size(), 8u);
  EXPECT_EQ(backend->gpus()[0].memory_bytes, 80 * kGiB);
  EXPECT_EQ(backend->gpus()[0].chunk_granularity, 2 * kMiB);
}

TEST(SimBackendCreate, RejectsInvalidOptionsNamingTheOption) {
  struct Case {
    const char* what;
    void (*mutate)(SimBackendOptions&);
    const char* message_part;
  };
  const Case cases[] = {
      {"zero gpus", [](SimBackendOptions& o) { o.gpus = 0; }, "gpus"},
      {"negative gpus", [](SimBackendOptions& o) { o.gpus = -1; }, "gpus"},
      {"65 gpus", [](SimBackendOptions& o) { o.gpus = 65; }, "gpus"},
      {"zero memory", [](SimBackendOptions& o) { o.memory_bytes = 0; },
       "memory_bytes"},
      {"negative memory", [](SimBackendOptions& o) { o.memory_bytes = -kGiB; },
       "memory_bytes"},
      {"zero chunk", [](SimBackendOptions& o) { o.chunk_bytes = 0; },
       "chunk_bytes"},
      {"chunk not a page multiple",
       [](SimBackendOptions& o) { o.chunk_bytes = 2 * kMiB + 1; }, "page size"},
      {"chunk larger than memory",
       [](SimBackendOptions& o) {
         o.memory_bytes = 2 * kMiB;
         o.chunk_bytes = 4 * kMiB;
       },
       "larger than memory_bytes"},
      {"zero d2h", [](SimBackendOptions& o) { o.d2h_bytes_per_s = 0; },
       "d2h_bytes_per_s"},
      {"NaN d2h",
       [](SimBackendOptions& o) {
         o.d2h_bytes_per_s = std::numeric_limits<double>::quiet_NaN();
       },
       "d2h_bytes_per_s"},
      {"negative h2d", [](SimBackendOptions& o) { o.h2d_bytes_per_s = -1; },
       "h2d_bytes_per_s"},
      {"infinite h2d",
       [](SimBackendOptions& o) {
         o.h2d_bytes_per_s = std::numeric_limits<double>::infinity();
       },
       "h2d_bytes_per_s"},
      {"empty name", [](SimBackendOptions& o) { o.name.clear(); }, "name"},
  };
  for (const Case& c : cases) {
    SimBackendOptions options;
    c.mutate(options);
    absl::StatusOr<std::unique_ptr<SimBackend>> backend =
        SimBackend::Create(options);
    ASSERT_FALSE(backend.ok()) << c.what;
    EXPECT_EQ(backend.status().code(), absl::StatusCode::kInvalidArgument)
        << c.what;
    EXPECT_TRUE(MessageHas(backend.status(), c.message_part))
        << c.what << ": " << backend.status();
  }
}

TEST(SimBackendCreate, AcceptsSixtyFourGpus) {
  SimBackendOptions options;
  options.gpus = 64;
  std::unique_ptr<SimBackend> backend = Make(options);
  ASSERT_NE(backend, nullptr);
  EXPECT_EQ(backend->gpus().size(), 64u);
}

// --- gpus()
// ---------------------------------------------------------------------

TEST(SimBackendGpus, ReportCountMemoryBandwidthAndDistinctIds) {
  SimBackendOptions options;
  options.gpus = 4;
  options.memory_bytes = 16 * kGiB;
  options.d2h_bytes_per_s = 12e9;
  options.h2d_bytes_per_s = 13e9;
  options.name = "test GPU";
  std::unique_ptr<SimBackend> backend = Make(options);
  ASSERT_NE(backend, nullptr);
  const std::vector<GpuInfo>& gpus = backend->gpus();
  ASSERT_EQ(gpus.size(), 4u);
  // NVIDIA's layout: "GPU-" then 8-4-4-4-12 groups.
  const std::regex uuid_form(
      "GPU-[0-9a-z]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}");
  const std::regex pci_form("[0-9A-F]{8}:[0-9A-F]{2}:[0-9A-F]{2}\\.[0-7]");
  std::set<std::string> uuids;
  std::set<std::string> pci_ids;
  for (int i = 0; i < 4; ++i) {
    const GpuInfo& gpu = gpus[i];
    EXPECT_EQ(gpu.index, i);
    EXPECT_EQ(gpu.name, "test GPU");
    EXPECT_EQ(gpu.memory_bytes, 16 * kGiB);
    EXPECT_EQ(gpu.d2h_bytes_per_s, 12e9);
    EXPECT_EQ(gpu.h2d_bytes_per_s, 13e9);
    EXPECT_EQ(gpu.chunk_granularity, 2 * kMiB);
    EXPECT_EQ(gpu.numa_node, -1);
    EXPECT_TRUE(std::regex_match(gpu.uuid, uuid_form)) << gpu.uuid;
    EXPECT_TRUE(std::regex_match(gpu.pci_bus_id, pci_form)) << gpu.pci_bus_id;
    EXPECT_NE(gpu.uuid.find("sim"), std::string::npos) << gpu.uuid;
    uuids.insert(gpu.uuid);
    pci_ids.insert(gpu.pci_bus_id);
  }
  EXPECT_EQ(uuids.size(), 4u);
  EXPECT_EQ(pci_ids.size(), 4u);
}

TEST(SimBackendGpus, IdsAreStableAcrossBackends) {
  std::unique_ptr<SimBackend> a = Make();
  std::unique_ptr<SimBackend> b = Make();
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  for (size_t i = 0; i < a->gpus().size(); ++i) {
    EXPECT_EQ(a->gpus()[i].uuid, b->gpus()[i].uuid);
    EXPECT_EQ(a->gpus()[i].pci_bus_id, b->gpus()[i].pci_bus_id);
  }
}

// --- CreateChunk
// ----------------------------------------------------------------

TEST(SimBackendCreateChunk, RoundsUpToGranularity) {
  std::unique_ptr<SimBackend> backend = Make(Small(2, kGiB));
  ASSERT_NE(backend, nullptr);
  struct Case {
    int64_t asked;
    int64_t expected;
  };
  int64_t total = 0;
  for (Case c : {Case{1, 2 * kMiB}, Case{2 * kMiB, 2 * kMiB},
                 Case{2 * kMiB + 1, 4 * kMiB}, Case{5 * kMiB, 6 * kMiB}}) {
    absl::StatusOr<DeviceChunk> chunk = backend->CreateChunk(1, c.asked);
    ASSERT_TRUE(chunk.ok()) << chunk.status();
    EXPECT_EQ(chunk->bytes, c.expected) << c.asked;
    EXPECT_EQ(chunk->gpu, 1);
    struct stat st;
    ASSERT_EQ(fstat(chunk->fd, &st), 0);
    EXPECT_EQ(st.st_size, c.expected) << c.asked;
    total += c.expected;
  }
  EXPECT_EQ(backend->allocated_bytes(1), total);
  EXPECT_EQ(backend->allocated_bytes(0), 0);
}

TEST(SimBackendCreateChunk, RejectsUnknownGpuAndNonPositiveSize) {
  std::unique_ptr<SimBackend> backend = Make(Small(2, kGiB));
  ASSERT_NE(backend, nullptr);
  for (int gpu : {-1, 2, 100}) {
    absl::StatusOr<DeviceChunk> chunk = backend->CreateChunk(gpu, kMiB);
    ASSERT_FALSE(chunk.ok()) << gpu;
    EXPECT_EQ(chunk.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(MessageHas(chunk.status(), "does not exist")) << chunk.status();
  }
  for (int64_t bytes :
       {int64_t{0}, int64_t{-1}, std::numeric_limits<int64_t>::min()}) {
    absl::StatusOr<DeviceChunk> chunk = backend->CreateChunk(0, bytes);
    ASSERT_FALSE(chunk.ok()) << bytes;
    EXPECT_EQ(chunk.status().code(), absl::StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(backend->allocated_bytes(0), 0);
  EXPECT_EQ(backend->allocated_bytes(-1), 0);
  EXPECT_EQ(backend->allocated_bytes(2), 0);
}

TEST(SimBackendCreateChunk, ExhaustionNamesGpuFreeBytesAndAsked) {
  std::unique_ptr<SimBackend> backend = Make(Small(4, 8 * kMiB));
  ASSERT_NE(backend, nullptr);
  ASSERT_TRUE(backend->CreateChunk(3, 6 * kMiB).ok());
  absl::StatusOr<DeviceChunk> chunk = backend->CreateChunk(3, 3 * kMiB);
  ASSERT_FALSE(chunk.ok());
  EXPECT_EQ(chunk.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(MessageHas(chunk.status(), "GPU 3 has 2097152 bytes free"))
      << chunk.status();
  EXPECT_TRUE(MessageHas(chunk.status(), "asked 3145728 bytes"))
      << chunk.status();
  EXPECT_TRUE(MessageHas(chunk.status(), "4194304")) << chunk.status();
  // A failed create reserves nothing; what is free still fits.
  EXPECT_EQ(backend->allocated_bytes(3), 6 * kMiB);
  EXPECT_TRUE(backend->CreateChunk(3, 2 * kMiB).ok());
  EXPECT_EQ(backend->allocated_bytes(3), 8 * kMiB);
  // Each GPU has its own budget.
  EXPECT_TRUE(backend->CreateChunk(2, 8 * kMiB).ok());
}

TEST(SimBackendCreateChunk, HugeRequestIsExhaustedNotOverflowed) {
  std::unique_ptr<SimBackend> backend = Make(Small(1, 8 * kMiB));
  ASSERT_NE(backend, nullptr);
  for (int64_t bytes : {8 * kMiB + 1, std::numeric_limits<int64_t>::max()}) {
    absl::StatusOr<DeviceChunk> chunk = backend->CreateChunk(0, bytes);
    ASSERT_FALSE(chunk.ok()) << bytes;
    EXPECT_EQ(chunk.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_TRUE(MessageHas(chunk.status(), "GPU 0 has 8388608 bytes free"))
        << chunk.status();
  }
  EXPECT_EQ(backend->allocated_bytes(0), 0);
}

TEST(SimBackendCreateChunk, IdsAreUniqueAndNeverZero) {
  std::unique_ptr<SimBackend> backend = Make(Small(2, kGiB));
  ASSERT_NE(backend, nullptr);
  std::set<uint64_t> ids;
  for (int i = 0; i < 20; ++i) {
    absl::StatusOr<DeviceChunk> chunk = backend->CreateChunk(i % 2, kMiB);
    ASSERT_TRUE(chunk.ok()) << chunk.status();
    EXPECT_NE(chunk->id, 0u);
    ids.insert(chunk->id);
    if (i % 3 == 0) {
      ASSERT_TRUE(backend->ReleaseChunk(chunk->id).ok());
    }
  }
  EXPECT_EQ(ids.size(), 20u);
}

TEST(SimBackendCreateChunk, ClientCannotResizeTheChunk) {
  std::unique_ptr<SimBackend> backend = Make(Small(1, kGiB));
  ASSERT_NE(backend, nullptr);
  absl::StatusOr<DeviceChunk> chunk = backend->CreateChunk(0, 4 * kMiB);
  ASSERT_TRUE(chunk.ok()) << chunk.status();
  const int client_fd = PassThroughSocket(chunk->fd);
  ASSERT_GE(client_fd, 0);
  // Growing would let a client use memory past its budget.
  EXPECT_NE(ftruncate(client_fd, 64 * kMiB), 0);
  EXPECT_NE(ftruncate(client_fd, kMiB), 0);
  struct stat st;
  ASSERT_EQ(fstat(client_fd, &st), 0);
  EXPECT_EQ(st.st_size, 4 * kMiB);
  close(client_fd);
}

// --- ReleaseChunk
// ---------------------------------------------------------------

TEST(SimBackendReleaseChunk, FreesAccountingAndClosesFd) {
  std::unique_ptr<SimBackend> backend = Make(Small(1, 8 * kMiB));
  ASSERT_NE(backend, nullptr);
  absl::StatusOr<DeviceChunk> chunk = backend->CreateChunk(0, 8 * kMiB);
  ASSERT_TRUE(chunk.ok()) << chunk.status();
  EXPECT_EQ(backend->allocated_bytes(0), 8 * kMiB);
  EXPECT_FALSE(backend->CreateChunk(0, 1).ok());
  ASSERT_TRUE(FdIsOpen(chunk->fd));

  ASSERT_TRUE(backend->ReleaseChunk(chunk->id).ok());
  EXPECT_FALSE(FdIsOpen(chunk->fd));
  EXPECT_EQ(backend->allocated_bytes(0), 0);
  absl::StatusOr<DeviceChunk> again = backend->CreateChunk(0, 8 * kMiB);
  EXPECT_TRUE(again.ok()) << again.status();
}

TEST(SimBackendReleaseChunk, UnknownOrReleasedIdIsNotFound) {
  std::unique_ptr<SimBackend> backend = Make(Small(1, 8 * kMiB));
  ASSERT_NE(backend, nullptr);
  absl::StatusOr<DeviceChunk> chunk = backend->CreateChunk(0, kMiB);
  ASSERT_TRUE(chunk.ok()) << chunk.status();
  ASSERT_TRUE(backend->ReleaseChunk(chunk->id).ok());
  for (uint64_t id : {chunk->id, uint64_t{0}, uint64_t{12345}}) {
    absl::Status s = backend->ReleaseChunk(id);
    EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << id << ": " << s;
    EXPECT_TRUE(MessageHas(s, std::to_string(id))) << s;
  }
  EXPECT_EQ(backend->allocated_bytes(0), 0);
}

TEST(SimBackendReleaseChunk, DestructorClosesLiveChunks) {
  std::unique_ptr<SimBackend> backend = Make(Small(1, 8 * kMiB));
  ASSERT_NE(backend, nullptr);
  absl::StatusOr<DeviceChunk> chunk = backend->CreateChunk(0, kMiB);
  ASSERT_TRUE(chunk.ok()) << chunk.status();
  ASSERT_TRUE(FdIsOpen(chunk->fd));
  backend.reset();
  EXPECT_FALSE(FdIsOpen(chunk->fd));
}

// --- Mapping
// --------------------------------------------------------------------

TEST(SimBackendChunk, FdMapsTheSameMemoryInASecondMapping) {
  std::unique_ptr<SimBackend> backend = Make(Small(1, kGiB));
  ASSERT_NE(backend, nullptr);
  absl::StatusOr<DeviceChunk> chunk = backend->CreateChunk(0, 3 * kMiB);
  ASSERT_TRUE(chunk.ok()) << chunk.status();
  const size_t size = static_cast<size_t>(chunk->bytes);
  // The client's copy of the fd, as SCM_RIGHTS delivers it.
  const int client_fd = PassThroughSocket(chunk->fd);
  ASSERT_GE(client_fd, 0);

  void* writer =
      mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, chunk->fd, 0);
  ASSERT_NE(writer, MAP_FAILED) << std::strerror(errno);
  void* reader = mmap(nullptr, size, PROT_READ, MAP_SHARED, client_fd, 0);
  ASSERT_NE(reader, MAP_FAILED) << std::strerror(errno);
  ASSERT_NE(writer, reader);

  std::vector<unsigned char> pattern(size);
  std::mt19937 rng(7);
  for (unsigned char& b : pattern) b = static_cast<unsigned char>(rng());
  std::memcpy(writer, pattern.data(), size);
  EXPECT_EQ(std::memcmp(reader, pattern.data(), size), 0);

  // The memory outlives the backend's fd while the client maps it.
  ASSERT_TRUE(backend->ReleaseChunk(chunk->id).ok());
  EXPECT_EQ(std::memcmp(reader, pattern.data(), size), 0);

  munmap(writer, size);
  munmap(reader, size);
  close(client_fd);
}

TEST(SimBackendChunk, EightGpusOf80GiBCostNothingUntilTouched) {
  std::unique_ptr<SimBackend> backend = Make();  // 8 x 80 GiB.
  ASSERT_NE(backend, nullptr);
  std::vector<DeviceChunk> chunks;
  for (int gpu = 0; gpu < 8; ++gpu) {
    absl::StatusOr<DeviceChunk> chunk = backend->CreateChunk(gpu, 80 * kGiB);
    ASSERT_TRUE(chunk.ok()) << chunk.status();
    EXPECT_EQ(backend->allocated_bytes(gpu), 80 * kGiB);
    absl::StatusOr<DeviceChunk> more = backend->CreateChunk(gpu, 1);
    EXPECT_EQ(more.status().code(), absl::StatusCode::kResourceExhausted);
    chunks.push_back(*chunk);
  }
  // The memfd has its full size but no pages behind it: st_blocks counts
  // what the file really holds, independent of what else runs on the host.
  for (const DeviceChunk& chunk : chunks) {
    struct stat st;
    ASSERT_EQ(fstat(chunk.fd, &st), 0);
    EXPECT_EQ(st.st_size, 80 * kGiB);
    EXPECT_EQ(st.st_blocks, 0);
  }
  // Touching one page in the middle allocates about that page only.
  const long page = sysconf(_SC_PAGESIZE);
  void* p = mmap(nullptr, page, PROT_READ | PROT_WRITE, MAP_SHARED,
                 chunks[5].fd, 40 * kGiB);
  ASSERT_NE(p, MAP_FAILED) << std::strerror(errno);
  static_cast<char*>(p)[0] = 1;
  struct stat st;
  ASSERT_EQ(fstat(chunks[5].fd, &st), 0);
  EXPECT_GT(st.st_blocks, 0);
  EXPECT_LE(st.st_blocks * 512, 4 * kMiB);  // A huge page at most.
  munmap(p, page);
}

// --- Concurrency
// ----------------------------------------------------------------

TEST(SimBackendConcurrency, ConcurrentCreatesNeverOverAllocate) {
  constexpr int kChunksThatFit = 64;
  constexpr int kThreads = 8;
  constexpr int kTriesPerThread = 24;  // 192 tries for 64 chunks per GPU.
  std::unique_ptr<SimBackend> backend =
      Make(Small(2, kChunksThatFit * 2 * kMiB));
  ASSERT_NE(backend, nullptr);
  std::atomic<int> created[2] = {0, 0};
  std::atomic<int> exhausted{0};
  std::atomic<int> other_errors{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kTriesPerThread; ++i) {
        const int gpu = (t + i) % 2;
        absl::StatusOr<DeviceChunk> chunk = backend->CreateChunk(gpu, kMiB);
        if (chunk.ok()) {
          created[gpu].fetch_add(1);
        } else if (chunk.status().code() ==
                   absl::StatusCode::kResourceExhausted) {
          exhausted.fetch_add(1);
        } else {
          other_errors.fetch_add(1);
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(other_errors.load(), 0);
  for (int gpu = 0; gpu < 2; ++gpu) {
    EXPECT_EQ(created[gpu].load(), kChunksThatFit) << gpu;
    EXPECT_EQ(backend->allocated_bytes(gpu), kChunksThatFit * 2 * kMiB);
  }
  EXPECT_EQ(exhausted.load(), kThreads * kTriesPerThread - 2 * kChunksThatFit);
}

TEST(SimBackendConcurrency, CreateAndReleaseFromThreadsBalances) {
  std::unique_ptr<SimBackend> backend = Make(Small(1, 32 * kMiB));
  ASSERT_NE(backend, nullptr);
  std::atomic<int> over_budget{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 200; ++i) {
        absl::StatusOr<DeviceChunk> chunk = backend->CreateChunk(0, 4 * kMiB);
        if (backend->allocated_bytes(0) > 32 * kMiB) over_budget.fetch_add(1);
        if (chunk.ok()) {
          EXPECT_TRUE(backend->ReleaseChunk(chunk->id).ok());
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(over_budget.load(), 0);
  EXPECT_EQ(backend->allocated_bytes(0), 0);
}

}  // namespace
}  // namespace deltad::daemon
