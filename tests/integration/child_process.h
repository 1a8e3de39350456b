#ifndef DELTAD_TESTS_INTEGRATION_CHILD_PROCESS_H_
#define DELTAD_TESTS_INTEGRATION_CHILD_PROCESS_H_

#include <sys/types.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/unix_socket.h"

// A child process for integration tests: started with fork/exec, waited for
// with a timeout, and never left running behind a test. Linux only.
namespace deltad::testing_util {

// How a child ended, as waitpid reported it.
struct ExitStatus {
  bool exited = false;     // returned from main or called exit()
  int code = -1;           // exit code when `exited`
  int signal = 0;          // the signal that killed it, when not `exited`
  bool timed_out = false;  // did not end in time, and was killed for it

  bool ok() const { return exited && code == 0 && !timed_out; }
  // "exit code 0", "killed by signal 9 (Killed)", "...; timed out".
  std::string ToString() const;
};

struct SpawnOptions {
  // stdout and stderr both go to this file (created, truncated) when set;
  // else they are the test's own.
  std::string output_file;
  // Pipes to the child's stdin and from its stdout (the latter instead of
  // output_file for stdout). Without a stdin pipe the child reads
  // /dev/null.
  bool pipe_stdin = false;
  bool pipe_stdout = false;
  // "NAME=value" entries the child's environment gets beside the test's
  // (a name given here replaces the test's).
  std::vector<std::string> env;
};

// Owns one child process. The destructor kills it (SIGKILL) and reaps it,
// so a failing test leaves nothing running. The child also gets SIGKILL
// when the thread that spawned it exits (PR_SET_PDEATHSIG), which covers a
// test process that crashes; so spawn from a thread that outlives the child
// (a test body's thread does).
//
// Not thread safe: one owner.
class ChildProcess {
 public:
  // Runs argv[0] (a path, not searched in PATH) with `argv`. Only
  // async-signal-safe calls happen between fork and exec, as the test
  // process has threads (gRPC's). An exec that fails shows as exit code 127.
  static absl::StatusOr<std::unique_ptr<ChildProcess>> Spawn(
      const std::vector<std::string>& argv, const SpawnOptions& options = {});

  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;
  ~ChildProcess();  // Kill()

  pid_t pid() const { return pid_; }
  // Whether it has not ended yet (reaps it when it has).
  bool Running();
  // Sends `signal`; nothing when it has ended already.
  void Signal(int signal);
  // Waits up to `timeout` for it to end. On timeout it keeps running and
  // the result is empty.
  std::optional<ExitStatus> Wait(absl::Duration timeout);
  // Waits up to `timeout`, then kills it (timed_out set).
  ExitStatus WaitOrKill(absl::Duration timeout);
  // SIGKILL and reap; idempotent. Returns how it ended.
  ExitStatus Kill();

  // The parent's ends of the pipes asked for in SpawnOptions (-1 if none).
  int stdin_fd() const { return stdin_.get(); }
  int stdout_fd() const { return stdout_.get(); }
  // Closes the child's stdin: EOF for a child that reads it.
  void CloseStdin() { stdin_.reset(); }
  // One line from the child's stdout pipe, without its newline, waiting at
  // most `timeout`. DEADLINE_EXCEEDED on timeout, UNAVAILABLE at EOF.
  absl::StatusOr<std::string> ReadLine(absl::Duration timeout);

 private:
  ChildProcess() = default;
  void Reaped(int wait_status);

  pid_t pid_ = -1;
  std::optional<ExitStatus> ended_;
  common::UniqueFd stdin_;
  common::UniqueFd stdout_;
  std::string stdout_buffer_;  // read from the pipe, not yet a whole line
};

// The next line of `p`'s stdout pipe that starts with `prefix`, within
// `timeout`; otherwise an error that quotes the lines it printed meanwhile.
absl::StatusOr<std::string> LineStarting(ChildProcess& p,
                                         const std::string& prefix,
                                         absl::Duration timeout);

// The whole content of a file; empty when it cannot be read.
std::string ReadFileOrEmpty(const std::string& path);

// What `read` returns once it contains `wanted`, or after `timeout`: for
// a line a process writes after something the test saw elsewhere (a client
// logging an order the daemon's status already shows as sent, the daemon
// logging what its metrics already count).
std::string OnceItHolds(const std::function<std::string()>& read,
                        const std::string& wanted,
                        absl::Duration timeout = absl::Seconds(10));

}  // namespace deltad::testing_util

#endif  // DELTAD_TESTS_INTEGRATION_CHILD_PROCESS_H_
