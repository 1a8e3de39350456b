#include "tests/integration/child_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace deltad::testing_util {

std::string ExitStatus::ToString() const {
  std::string s =
      exited ? absl::StrCat("exit code ", code)
             : absl::StrCat("killed by signal ", signal, " (",
                            signal > 0 ? ::strsignal(signal) : "?", ")");
  if (timed_out) absl::StrAppend(&s, "; timed out");
  return s;
}

std::string ReadFileOrEmpty(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream out;
  out << in.rdbuf();
  return out.str();
}

std::string OnceItHolds(const std::function<std::string()>& read,
                        const std::string& wanted, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    std::string content = read();
    if (absl::StrContains(content, wanted) || absl::Now() >= deadline) {
      return content;
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
}

namespace {

// The child's side between fork and exec: async-signal-safe calls only.
[[noreturn]] void ExecChild(char* const* argv, char* const* envp, pid_t parent,
                            int stdin_fd, int stdout_fd, int stderr_fd) {
  // Dies with the spawning thread; the getppid check closes the race with
  // a parent that died before prctl.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != parent) ::_exit(126);
  // dup2 clears FD_CLOEXEC on the copy, so exactly these three survive exec.
  if (::dup2(stdin_fd, 0) < 0 || ::dup2(stdout_fd, 1) < 0 ||
      ::dup2(stderr_fd, 2) < 0) {
    ::_exit(126);
  }
  // The test process blocks or ignores signals of its own (gRPC ignores
  // SIGPIPE); the child starts with the defaults.
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  ::signal(SIGPIPE, SIG_DFL);
  ::execve(argv[0], argv, envp);
  ::_exit(127);
}

absl::Status Pipe(common::UniqueFd& read_end, common::UniqueFd& write_end) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    return absl::ErrnoToStatus(errno, "pipe2");
  }
  read_end.reset(fds[0]);
  write_end.reset(fds[1]);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<ChildProcess>> ChildProcess::Spawn(
    const std::vector<std::string>& argv, const SpawnOptions& options) {
  if (argv.empty()) return absl::InvalidArgumentError("empty argv");
  // Everything the child needs is made before fork: it may not allocate.
  std::vector<std::string> args = argv;
  std::vector<char*> raw;
  for (std::string& a : args) raw.push_back(a.data());
  raw.push_back(nullptr);
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    const std::string name = entry.substr(0, entry.find('=') + 1);
    bool replaced = false;
    for (const std::string& o : options.env) replaced |= o.starts_with(name);
    if (!replaced) env.push_back(entry);
  }
  env.insert(env.end(), options.env.begin(), options.env.end());
  std::vector<char*> raw_env;
  for (std::string& e : env) raw_env.push_back(e.data());
  raw_env.push_back(nullptr);

  std::unique_ptr<ChildProcess> child(new ChildProcess());
  common::UniqueFd child_stdin, child_stdout, child_stderr;
  if (options.pipe_stdin) {
    if (absl::Status s = Pipe(child_stdin, child->stdin_); !s.ok()) return s;
  } else {
    child_stdin.reset(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  }
  if (!options.output_file.empty()) {
    child_stderr.reset(::open(options.output_file.c_str(),
                              O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (!child_stderr.valid()) {
      return absl::ErrnoToStatus(errno,
                                 absl::StrCat("opening ", options.output_file));
    }
  } else {
    child_stderr.reset(::fcntl(2, F_DUPFD_CLOEXEC, 3));
  }
  if (options.pipe_stdout) {
    if (absl::Status s = Pipe(child->stdout_, child_stdout); !s.ok()) return s;
  } else {
    child_stdout.reset(::fcntl(child_stderr.get(), F_DUPFD_CLOEXEC, 3));
  }
  if (!child_stdin.valid() || !child_stdout.valid() || !child_stderr.valid()) {
    return absl::ErrnoToStatus(errno, "setting up the child's stdio");
  }

  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) return absl::ErrnoToStatus(errno, "fork");
  if (pid == 0) {
    ExecChild(raw.data(), raw_env.data(), parent, child_stdin.get(),
              child_stdout.get(), child_stderr.get());
  }
  child->pid_ = pid;
  return child;
}

ChildProcess::~ChildProcess() { Kill(); }

void ChildProcess::Reaped(int wait_status) {
  ExitStatus e;
  if (WIFEXITED(wait_status)) {
    e.exited = true;
    e.code = WEXITSTATUS(wait_status);
  } else if (WIFSIGNALED(wait_status)) {
    e.signal = WTERMSIG(wait_status);
  }
  ended_ = e;
}

bool ChildProcess::Running() {
  if (ended_ || pid_ < 0) return false;
  int wait_status = 0;
  pid_t r;
  do {
    r = ::waitpid(pid_, &wait_status, WNOHANG);
  } while (r < 0 && errno == EINTR);
  if (r == pid_) {
    Reaped(wait_status);
    return false;
  }
  if (r < 0) {
    // ECHILD: someone else reaped it; it is gone all the same.
    ended_ = ExitStatus{};
    return false;
  }
  return true;
}

void ChildProcess::Signal(int signal) {
  if (Running()) ::kill(pid_, signal);
}

std::optional<ExitStatus> ChildProcess::Wait(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  // waitpid has no timeout; a short poll costs nothing next to process
  // start-up and keeps this free of SIGCHLD handling, which the test
  // process may not own.
  while (Running()) {
    if (absl::Now() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return ended_;
}

ExitStatus ChildProcess::WaitOrKill(absl::Duration timeout) {
  if (std::optional<ExitStatus> e = Wait(timeout)) return *e;
  ExitStatus e = Kill();
  e.timed_out = true;
  return e;
}

ExitStatus ChildProcess::Kill() {
  if (Running()) {
    ::kill(pid_, SIGKILL);
    int wait_status = 0;
    pid_t r;
    do {
      r = ::waitpid(pid_, &wait_status, 0);
    } while (r < 0 && errno == EINTR);
    if (r == pid_) {
      Reaped(wait_status);
    } else {
      ended_ = ExitStatus{};
    }
  }
  return ended_.value_or(ExitStatus{});
}

absl::StatusOr<std::string> ChildProcess::ReadLine(absl::Duration timeout) {
  if (!stdout_.valid()) {
    return absl::FailedPreconditionError("the child's stdout is not a pipe");
  }
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    if (size_t nl = stdout_buffer_.find('\n'); nl != std::string::npos) {
      std::string line = stdout_buffer_.substr(0, nl);
      stdout_buffer_.erase(0, nl + 1);
      return line;
    }
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(absl::StrCat(
          "no line from pid ", pid_, " within ", absl::FormatDuration(timeout),
          "; got so far: '", stdout_buffer_, "'"));
    }
    struct pollfd p = {stdout_.get(), POLLIN, 0};
    const int ready = ::poll(&p, 1,
                             static_cast<int>(absl::ToInt64Milliseconds(
                                 left + absl::Milliseconds(1))));
    if (ready < 0 && errno != EINTR) return absl::ErrnoToStatus(errno, "poll");
    if (ready <= 0) continue;
    char buffer[4096];
    const ssize_t n = ::read(stdout_.get(), buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::ErrnoToStatus(errno, "read");
    if (n == 0) {
      return absl::UnavailableError(
          absl::StrCat("pid ", pid_, " closed its stdout; got so far: '",
                       stdout_buffer_, "'"));
    }
    stdout_buffer_.append(buffer, static_cast<size_t>(n));
  }
}

absl::StatusOr<std::string> LineStarting(ChildProcess& p,
                                         const std::string& prefix,
                                         absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  std::string seen;
  while (absl::Now() < deadline) {
    auto line = p.ReadLine(deadline - absl::Now());
    if (!line.ok()) {
      return absl::Status(
          line.status().code(),
          absl::StrCat("waiting for \"", prefix,
                       "\": ", line.status().message(), "; it said: ", seen));
    }
    if (absl::StartsWith(*line, prefix)) return *line;
    absl::StrAppend(&seen, *line, " | ");
  }
  return absl::DeadlineExceededError(absl::StrCat(
      "no line starting \"", prefix, "\" in time; it said: ", seen));
}

}  // namespace deltad::testing_util
