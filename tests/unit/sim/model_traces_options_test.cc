// The options and devices BuildModelTrace refuses, and the least it accepts.

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "policies/sim/device_profile.h"
#include "policies/sim/model_traces.h"
#include "policies/sim/trace.h"
#include "tests/unit/sim/model_traces_test_helpers.h"

namespace deltad::sim {
namespace {

using ::testing::HasSubstr;

struct BadOptionsCase {
  std::string model;
  ModelOptions options;
  std::vector<std::string> message;
};

TEST(ModelTraces, RejectsBadOptionsSayingWhatIsWrong) {
  auto with = [](auto edit) {
    ModelOptions o;
    edit(o);
    return o;
  };
  const std::vector<BadOptionsCase> cases = {
      {"alexnet", {}, {"unknown model 'alexnet'", "resnet50", "unet", "gpt"}},
      {"resnet50",
       with([](ModelOptions& o) { o.batch = 0; }),
       {"batch must be positive", "0"}},
      {"gpt",
       with([](ModelOptions& o) { o.batch = -3; }),
       {"batch must be positive", "-3"}},
      {"resnet50",
       with([](ModelOptions& o) { o.height = -1; }),
       {"height and width must be positive"}},
      {"vgg16",
       with([](ModelOptions& o) { o.height = o.width = 16; }),
       {"vgg16", "16x16", "too small", "pool5"}},
      {"densenet121",
       with([](ModelOptions& o) { o.height = o.width = 8; }),
       {"densenet121", "too small", "transition2.pool"}},
      {"unet",
       with([](ModelOptions& o) { o.height = 100; }),
       {"divisible by 16", "100x224"}},
      {"gpt",
       with([](ModelOptions& o) { o.gpt_heads = 5; }),
       {"gpt_heads (5) must divide gpt_hidden (768)"}},
      {"gpt",
       with([](ModelOptions& o) { o.gpt_seq = 0; }),
       {"gpt_seq must be positive"}},
      {"gpt",
       with([](ModelOptions& o) { o.gpt_layers = 100000; }),
       {"gpt_layers must be at most"}},
      {"gpt",
       with([](ModelOptions& o) {
         o.batch = 1 << 30;
         o.gpt_seq = 1 << 30;
       }),
       {"overflows 64 bits"}},
  };
  for (const BadOptionsCase& c : cases) {
    SCOPED_TRACE(c.model);
    const absl::StatusOr<Trace> t = BuildModelTrace(c.model, c.options, A100());
    ASSERT_FALSE(t.ok());
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    for (const std::string& part : c.message) {
      EXPECT_THAT(t.status().message(), HasSubstr(part));
    }
  }
}

TEST(ModelTraces, SmallestInputsEachNetworkAccepts) {
  ModelOptions o;
  o.batch = 1;
  o.height = o.width = 32;  // VGG's five pools need 32
  EXPECT_TRUE(BuildModelTrace("vgg16", o, A100()).ok());
  o.height = o.width = 31;
  EXPECT_FALSE(BuildModelTrace("vgg16", o, A100()).ok());
  o.height = o.width = 16;
  EXPECT_TRUE(BuildModelTrace("unet", o, A100()).ok());
  o.height = o.width = 1;  // strided convolutions with padding never vanish
  EXPECT_TRUE(BuildModelTrace("resnet50", o, A100()).ok());
  o.gpt_layers = o.gpt_hidden = o.gpt_heads = o.gpt_seq = o.gpt_vocab = 1;
  EXPECT_TRUE(BuildModelTrace("gpt", o, A100()).ok());
}

TEST(ModelTraces, RejectsADeviceWithoutRates) {
  DeviceProfile device = A100();
  device.fp16_flops_per_s = 0;
  ModelOptions o;
  o.dtype = DType::kFp16;
  const absl::StatusOr<Trace> t = BuildModelTrace("resnet50", o, device);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr("fp16"));
  o.dtype = DType::kFp32;
  EXPECT_TRUE(BuildModelTrace("resnet50", o, device).ok());
}

}  // namespace
}  // namespace deltad::sim
