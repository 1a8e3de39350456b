#ifndef DELTAD_POLICIES_SIM_DTR_MEASURED_H_
#define DELTAD_POLICIES_SIM_DTR_MEASURED_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace deltad::sim {

// One measured run from the DTR paper's results (measured-data-full.json,
// measured-large-input.json beside the logs): what the simulator is held
// against.
struct DtrMeasurement {
  std::string model;         // canonical key, see CanonicalDtrModel()
  std::string type;          // "baseline" or "dtr", as in the data
  int64_t budget_bytes = 0;  // DTR's memory budget; 0 for baseline
  int batch = 0;
  double median_ms = 0;  // time per iteration
  double mean_ms = 0;
  double total_mem_mb = 0;  // median of the runs' total_mem (MB, 1e6 bytes)
};

// Reads the runs of a results file: an object whose array members are the
// models' runs, each with `specific_params` (type, batch_size, memory_budget
// for DTR) and `summary` (a list whose first entry holds time and
// total_mem). Members that are not arrays (timestamp, start_time, ...) are
// metadata and skipped; so are runs whose summary is the string "error"
// (the run failed, e.g. out of memory). Model keys go through
// CanonicalDtrModel(); a misspelt key whose canonical key is also present
// ("inceptiov4" beside "inceptionv4" in measured-data-full.json, a copy of
// the same runs) is skipped so that each run appears once. Errors name the
// file, model and run index and what was expected there.
absl::StatusOr<std::vector<DtrMeasurement>> LoadDtrMeasurements(
    const std::string& json_path);

// Maps a model key of the results to its canonical spelling: "inceptiov4"
// (a typo in the data) becomes "inceptionv4"; other keys are kept.
std::string CanonicalDtrModel(absl::string_view key);

// The model and size parameter of a log, from its file name
// "<model>-<batch>-<budget>-<date>-default.log" (a directory part is
// ignored): "inceptionv4-64-10000000000.0-...log" gives {"inceptionv4", 64}.
// The model part is canonicalised like the results' keys and otherwise kept:
// the logs tv_densenet121, inceptionv4, transformer, unet, lstm, treelstm
// and unroll_gan have keys of that name in the results; resnet32 has none
// (the results hold resnet1202). The number is what the file name carries
// in the batch position: for lstm (128, the sequence length per the
// manifest) and treelstm (6, the tree depth) it differs from the batch_size
// of the measured runs (256, 9), so FindDtrBaseline() finds no run for them.
struct DtrLogModel {
  std::string model;
  int batch = 0;
  // False where the results hold runs of the same model and batch but of
  // another configuration: unroll_gan's log is 10 unrolled steps (manifest)
  // while its runs are 60 steps with 2048-wide layers; the log's op times
  // add up to 2% of that baseline's time and its peak to 2% of its memory.
  bool same_config_as_measured = true;
};
absl::StatusOr<DtrLogModel> DtrModelFromLogName(absl::string_view path);

// The baseline run of `model` at `batch`, or nullptr.
const DtrMeasurement* FindDtrBaseline(
    const std::vector<DtrMeasurement>& measurements, absl::string_view model,
    int batch);

}  // namespace deltad::sim

#endif  // DELTAD_POLICIES_SIM_DTR_MEASURED_H_
