// What the traces' ops cost: times from the device's rates, workspace, and
// both surviving the text format.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "policies/sim/device_profile.h"
#include "policies/sim/model_traces.h"
#include "policies/sim/trace.h"
#include "policies/sim/trace_io.h"
#include "tests/unit/sim/model_traces_test_helpers.h"

namespace deltad::sim {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

bool IsDense(const std::string& op) {
  return op == "conv2d" || op == "conv_transpose2d" || op == "linear" ||
         op == "matmul";
}

TEST(ModelTraces, DenseBackwardTakesTwiceTheForwardTime) {
  for (const std::string& model : ModelNames()) {
    SCOPED_TRACE(model);
    const Trace t = Build(model, 2);
    int dense = 0;
    for (const auto& [f, b] : PairLayers(t)) {
      if (!IsDense(f->name)) continue;
      ++dense;
      EXPECT_EQ(b->time_ns, 2 * f->time_ns) << f->name;
      EXPECT_EQ(b->workspace_bytes, f->workspace_bytes) << f->name;
    }
    EXPECT_GT(dense, 0);
  }
}

TEST(ModelTraces, EveryOpTakesTimeAndHalfPrecisionIsFaster) {
  for (const std::string& model : ModelNames()) {
    SCOPED_TRACE(model);
    const Trace fp32 = Build(model, 4, DType::kFp32);
    int64_t forward = 0;
    int64_t backward = 0;
    for (const TraceOp& op : fp32.ops) {
      EXPECT_GT(op.time_ns, 0) << op.name;
      (op.phase == Phase::kForward ? forward : backward) += op.time_ns;
    }
    EXPECT_EQ(fp32.ComputeNs(), forward + backward);
    EXPECT_GT(backward, forward);
    EXPECT_LT(Build(model, 4, DType::kFp16).ComputeNs(), fp32.ComputeNs());
  }
}

TEST(ModelTraces, TimesFollowTheDeviceRates) {
  const DeviceProfile a100 = A100();
  const Trace t = Build("resnet50", 8);
  const TraceValue* conv1 = Find(t, "conv1");
  ASSERT_NE(conv1, nullptr);
  const double macs = 8.0 * 64 * 112 * 112 * 3 * 7 * 7;
  EXPECT_EQ(
      t.ops[conv1->op].time_ns,
      static_cast<int64_t>(std::ceil(2 * macs / a100.fp32_flops_per_s * 1e9)));
  // The stem's ReLU reads and writes the batch norm output once.
  const TraceOp* relu = nullptr;
  for (const TraceOp& op : t.ops) {
    if (op.name == "relu") {
      relu = &op;
      break;
    }
  }
  ASSERT_NE(relu, nullptr);
  EXPECT_EQ(relu->time_ns,
            static_cast<int64_t>(
                std::ceil(2.0 * conv1->bytes / a100.memory_bytes_per_s * 1e9)));
  // A faster device runs the same trace in less time.
  absl::StatusOr<DeviceProfile> titan = FindDeviceProfile("titan-v");
  ASSERT_TRUE(titan.ok());
  ModelOptions o;
  o.batch = 8;
  EXPECT_GT(Build("resnet50", o, *titan).ComputeNs(), t.ComputeNs());
}

TEST(ModelTraces, ConvolutionsHaveABoundedWorkspace) {
  const Trace t = Build("vgg16", 32);
  int convs = 0;
  bool capped = false;
  for (const TraceOp& op : t.ops) {
    if (op.name != "conv2d") {
      if (op.phase == Phase::kForward) {
        EXPECT_EQ(op.workspace_bytes, 0) << op.name;
      }
      continue;
    }
    ++convs;
    const int64_t out = t.values[op.outputs[0]].bytes;
    EXPECT_EQ(op.workspace_bytes, std::min(out, 64 * kMiB));
    capped = capped || out > 64 * kMiB;
  }
  EXPECT_EQ(convs, 13);
  EXPECT_TRUE(capped);
}

TEST(ModelTraces, TracesSurviveTheTextFormat) {
  for (const std::string& model : ModelNames()) {
    SCOPED_TRACE(model);
    const Trace t = Build(model, 2);
    absl::StatusOr<Trace> parsed = ParseTrace(FormatTrace(t));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    ASSERT_EQ(parsed->ops.size(), t.ops.size());
    EXPECT_EQ(parsed->ComputeNs(), t.ComputeNs());
    EXPECT_EQ(WalkLiveMemory(*parsed).all, WalkLiveMemory(t).all);
  }
}

}  // namespace
}  // namespace deltad::sim
