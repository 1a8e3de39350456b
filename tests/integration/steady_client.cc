#include "tests/integration/steady_client.h"

#include <unistd.h>

#include <cstdio>
#include <utility>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace deltad::testing_util {

using ::testing::HasSubstr;

absl::StatusOr<Report> SteadyClient::Ask(const std::string& command) {
  const std::string line = command + "\n";
  if (::write(process->stdin_fd(), line.data(), line.size()) !=
      static_cast<ssize_t>(line.size())) {
    return absl::UnavailableError("the client's stdin is closed");
  }
  auto answer = LineStarting(*process, "report ", absl::Seconds(30));
  if (!answer.ok()) return answer.status();
  Report r;
  if (std::sscanf(answer->c_str(),
                  "report connected %d session %llu device_bytes %lld "
                  "tensors %lld lost %lld reconnects %lld steps %lld "
                  "budget %lld sync_releases %*d chunks %lld sent_again %lld",
                  &r.connected, &r.session, &r.device_bytes, &r.tensors,
                  &r.lost, &r.reconnects, &r.steps, &r.budget, &r.chunks,
                  &r.sent_again) != 10) {
    return absl::InternalError("unreadable report: " + *answer);
  }
  return r;
}

void SteadyClient::ExpectEveryTensorIntact() {
  process->CloseStdin();
  auto verified = LineStarting(*process, "verified ", absl::Seconds(60));
  ASSERT_TRUE(verified.ok()) << verified.status() << "\n"
                             << ReadFileOrEmpty(errors);
  EXPECT_THAT(*verified, HasSubstr(" bad 0"));
  const ExitStatus exit = process->WaitOrKill(absl::Seconds(30));
  EXPECT_TRUE(exit.ok()) << exit.ToString() << "\n" << ReadFileOrEmpty(errors);
}

SteadyClient StartSteadyClient(const std::string& dir, const std::string& name,
                               const std::string& socket,
                               const std::vector<std::string>& flags) {
  SteadyClient c;
  SpawnOptions options;
  options.pipe_stdout = true;
  options.pipe_stdin = true;
  c.errors = dir + "/" + name + ".err";
  options.output_file = c.errors;
  std::vector<std::string> argv = {DELTAD_STEADY_CLIENT_BINARY,
                                   "--socket=" + socket};
  argv.insert(argv.end(), flags.begin(), flags.end());
  auto p = ChildProcess::Spawn(argv, options);
  EXPECT_TRUE(p.ok()) << p.status();
  if (!p.ok()) return c;
  c.process = std::move(*p);
  auto started = LineStarting(*c.process, "started", absl::Seconds(60));
  EXPECT_TRUE(started.ok()) << started.status() << "\n"
                            << ReadFileOrEmpty(c.errors);
  return c;
}

bool Progressed(SteadyClient& client, const Report& from, long long steps) {
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (absl::Now() < deadline) {
    auto r = client.Ask("report");
    if (!r.ok()) return false;
    if (r->steps >= from.steps + steps) return true;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return false;
}

}  // namespace deltad::testing_util
