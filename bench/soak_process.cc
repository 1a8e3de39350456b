#include "bench/soak_process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace deltad::bench {
namespace {

const Clock::time_point kStart = Clock::now();

}  // namespace

double Seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

double SinceStart() { return Seconds(Clock::now() - kStart); }

void Note(const std::string& what) {
  std::fprintf(stderr, "soak [%6.1f s]: %s\n", SinceStart(), what.c_str());
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string Tail(const std::string& text, int n) {
  // Skips the final newline, then counts n line breaks back.
  size_t pos = text.size() > 0 ? text.size() - 1 : 0;
  while (pos > 0) {
    const size_t nl = text.rfind('\n', pos - 1);
    if (nl == std::string::npos) return text;
    pos = nl;
    if (--n == 0) return text.substr(pos + 1);
  }
  return text;
}

pid_t Spawn(const std::vector<std::string>& args, const std::string& output,
            int nice) {
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.data()));
  argv.push_back(nullptr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid != 0) return pid;  // -1 on failure
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(127);  // the parent died before prctl
  if (nice > 0) setpriority(PRIO_PROCESS, 0, nice);
  const int in = open("/dev/null", O_RDONLY);
  const int out = open(output.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (in < 0 || out < 0) _exit(127);
  dup2(in, 0);
  dup2(out, 1);
  dup2(out, 2);
  execv(argv[0], argv.data());
  _exit(127);
}

std::string DescribeWait(int status) {
  if (WIFEXITED(status)) return absl::StrCat("exit code ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return absl::StrCat("killed by signal ", WTERMSIG(status), " (",
                        strsignal(WTERMSIG(status)), ")");
  }
  return absl::StrCat("wait status ", status);
}

}  // namespace deltad::bench
