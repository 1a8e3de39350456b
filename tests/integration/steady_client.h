#ifndef DELTAD_TESTS_INTEGRATION_STEADY_CLIENT_H_
#define DELTAD_TESTS_INTEGRATION_STEADY_CLIENT_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "tests/integration/child_process.h"

// The steady client (steady_client_main.cc: a training process that never
// stops allocating, freeing and checking its tensors' bytes, reporting on
// request) as the integration tests drive it.
namespace deltad::testing_util {

// The steady client's "report" line.
struct Report {
  int connected = 0;
  unsigned long long session = 0;
  long long device_bytes = 0;
  long long tensors = 0;
  long long lost = 0;
  long long reconnects = 0;
  long long steps = 0;
  long long budget = 0;
  long long chunks = 0;  // device chunk bytes it maps
  // Calls for room sent again because the daemon answered late.
  long long sent_again = 0;
};

struct SteadyClient {
  std::unique_ptr<ChildProcess> process;
  std::string errors;  // the file its stderr goes to

  // Sends `command` and reads the report it answers with.
  absl::StatusOr<Report> Ask(const std::string& command);
  // Closes its stdin and waits for its verdict on its tensors' bytes.
  void ExpectEveryTensorIntact();
};

// Starts one on `socket` with its flags after the defaults; its stderr
// goes to <dir>/<name>.err. Returns once it says "started".
SteadyClient StartSteadyClient(const std::string& dir, const std::string& name,
                               const std::string& socket,
                               const std::vector<std::string>& flags = {});

// The client has run for `steps` more steps than `from` says, within a
// minute.
bool Progressed(SteadyClient& client, const Report& from, long long steps);

}  // namespace deltad::testing_util

#endif  // DELTAD_TESTS_INTEGRATION_STEADY_CLIENT_H_
