// Loading DTR's measured results and matching log names to their models.

#include "policies/sim/dtr_measured.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "tests/unit/sim/dtr_log_test_helpers.h"

namespace deltad::sim {
namespace {

using ::testing::HasSubstr;

TEST(DtrMeasuredTest, LoadsRunsAndSkipsMetadataFailuresAndTypos) {
  const std::string run = R"(
    {"specific_params": {"type": "baseline", "batch_size": 64},
     "summary": [{"time": {"mean": 10.5, "median": 10.0},
                  "total_mem": {"mean": 900.0, "median": 1000.0}}]},
    {"specific_params": {"type": "dtr", "batch_size": 64,
                         "memory_budget": 4000000000.0},
     "summary": [{"time": {"mean": 20.5, "median": 20.0},
                  "total_mem": {"mean": 400.0, "median": 401.0}}]},
    {"specific_params": {"type": "dtr", "batch_size": 64,
                         "memory_budget": 2000000000.0},
     "summary": "error"})";
  const std::string path = WriteFile(
      "measured.json",
      {absl::StrCat(R"({"timestamp": "03-06-2021-1702", "inceptionv4": [)", run,
                    R"(], "inceptiov4": [)", run, R"(], "unet": [)", run,
                    "]}")});
  absl::StatusOr<std::vector<DtrMeasurement>> m = LoadDtrMeasurements(path);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->size(), 4u);  // inceptiov4 is a copy; the failed runs skipped
  const DtrMeasurement& base = (*m)[0];
  EXPECT_EQ(base.model, "inceptionv4");
  EXPECT_EQ(base.type, "baseline");
  EXPECT_EQ(base.budget_bytes, 0);
  EXPECT_EQ(base.batch, 64);
  EXPECT_DOUBLE_EQ(base.median_ms, 10.0);
  EXPECT_DOUBLE_EQ(base.mean_ms, 10.5);
  EXPECT_DOUBLE_EQ(base.total_mem_mb, 1000.0);
  EXPECT_EQ((*m)[1].type, "dtr");
  EXPECT_EQ((*m)[1].budget_bytes, 4'000'000'000);
  EXPECT_EQ((*m)[3].model, "unet");
  EXPECT_EQ(FindDtrBaseline(*m, "unet", 64), &(*m)[2]);
  EXPECT_EQ(FindDtrBaseline(*m, "unet", 32), nullptr);

  // A misspelt key alone stands for its model.
  absl::StatusOr<std::vector<DtrMeasurement>> typo = LoadDtrMeasurements(
      WriteFile("typo.json", {absl::StrCat(R"({"inceptiov4": [)", run, "]}")}));
  ASSERT_TRUE(typo.ok()) << typo.status();
  ASSERT_EQ(typo->size(), 2u);
  EXPECT_EQ((*typo)[0].model, "inceptionv4");
}

TEST(DtrMeasuredTest, ErrorsNameTheRunAndTheKey) {
  absl::StatusOr<std::vector<DtrMeasurement>> m = LoadDtrMeasurements(WriteFile(
      "no_budget.json", {R"({"unet": [{"specific_params": {"type": "dtr",
                    "batch_size": 6}, "summary": "error"}]})"}));
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(m.status().message(),
              HasSubstr("no_budget.json: model 'unet' run 0: expected key "
                        "\"memory_budget\" in specific_params"));

  m = LoadDtrMeasurements(WriteFile(
      "no_median.json",
      {R"({"unet": [{"specific_params": {"type": "baseline", "batch_size": 6},
           "summary": [{"time": {"mean": 1.0}, "total_mem": {"median": 2}}]}]})"}));
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(m.status().message(),
              HasSubstr("run 0: expected key \"median\" in summary.time"));

  m = LoadDtrMeasurements(WriteFile("broken.json", {"{\"unet\": ["}));
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(m.status().message(), HasSubstr("broken.json: expected a JSON"));

  EXPECT_EQ(LoadDtrMeasurements("/no/such/file.json").status().code(),
            absl::StatusCode::kNotFound);
}

TEST(DtrMeasuredTest, LogNamesMapToModelKeys) {
  absl::StatusOr<DtrLogModel> m = DtrModelFromLogName(
      "/x/y/inceptionv4-64-10000000000.0-2020-10-1-10-55-0-default.log");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->model, "inceptionv4");
  EXPECT_EQ(m->batch, 64);
  EXPECT_TRUE(m->same_config_as_measured);
  m = DtrModelFromLogName("unroll_gan-512-10000000000.0-2020-default.log");
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->model, "unroll_gan");
  EXPECT_EQ(m->batch, 512);
  EXPECT_FALSE(m->same_config_as_measured);
  m = DtrModelFromLogName("inceptiov4-64-1.0-default.log");
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->model, "inceptionv4");
  EXPECT_FALSE(DtrModelFromLogName("model.log").ok());
  EXPECT_FALSE(DtrModelFromLogName("unet-six-8.0-default.log").ok());
}

}  // namespace
}  // namespace deltad::sim
