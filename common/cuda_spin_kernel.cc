#include "common/cuda_spin_kernel.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace deltad::common {
namespace {

constexpr char kEntry[] = "deltad_spin";

// Reads %clock64 until it has advanced `cycles` past its first reading.
// The counter is per SM and the kernel runs on one, so the difference is
// exact (it wraps after centuries). PTX ISA 6.3 is the first with sm_75.
constexpr char kPtx[] = R"ptx(
.version 6.3
.target sm_75
.address_size 64

.visible .entry deltad_spin(
    .param .u64 deltad_spin_cycles
)
{
    .reg .pred %p<2>;
    .reg .b64 %rd<5>;

    ld.param.u64 %rd1, [deltad_spin_cycles];
    mov.u64 %rd2, %clock64;
$L_spin:
    mov.u64 %rd3, %clock64;
    sub.s64 %rd4, %rd3, %rd2;
    setp.lt.u64 %p1, %rd4, %rd1;
    @%p1 bra $L_spin;
    ret;
}
)ptx";

}  // namespace

const char* SpinKernel::Ptx() { return kPtx; }

absl::StatusOr<std::unique_ptr<SpinKernel>> SpinKernel::Load(int ordinal) {
  absl::StatusOr<PrimaryContext> context = PrimaryContext::Retain(ordinal);
  if (!context.ok()) return context.status();
  const CudaDriver& d = context->driver();
  ScopedContext scope(*context);
  if (!scope.status().ok()) return scope.status();
  CUmodule module = nullptr;
  if (absl::Status s = CudaCheck(
          d, d.cuModuleLoadData(&module, kPtx),
          absl::StrCat("JIT-compiling the spin kernel's PTX for CUDA device ",
                       ordinal));
      !s.ok()) {
    return s;
  }
  CUfunction function = nullptr;
  if (absl::Status s =
          CudaCheck(d, d.cuModuleGetFunction(&function, module, kEntry),
                    "finding the spin kernel in its module");
      !s.ok()) {
    (void)d.cuModuleUnload(module);
    return s;
  }
  return std::unique_ptr<SpinKernel>(
      new SpinKernel(std::move(*context), module, function));
}

SpinKernel::~SpinKernel() {
  // The module belongs to the primary context, which must be current; an
  // error here means the driver is already torn down (exit).
  ScopedContext scope(context_);
  if (scope.status().ok()) (void)context_.driver().cuModuleUnload(module_);
}

absl::Status SpinKernel::Launch(CUstream stream, int64_t cycles) const {
  if (cycles < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("spin cycles must be >= 0, got ", cycles));
  }
  ScopedContext scope(context_);
  if (!scope.status().ok()) return scope.status();
  uint64_t arg = static_cast<uint64_t>(cycles);
  void* params[] = {&arg};
  const CudaDriver& d = context_.driver();
  return CudaCheck(
      d,
      d.cuLaunchKernel(function_, 1, 1, 1, 1, 1, 1, 0, stream, params, nullptr),
      "launching the spin kernel");
}

}  // namespace deltad::common
