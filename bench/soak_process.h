#ifndef DELTAD_BENCH_SOAK_PROCESS_H_
#define DELTAD_BENCH_SOAK_PROCESS_H_

#include <sys/types.h>

#include <chrono>
#include <string>
#include <vector>

namespace deltad::bench {

// soak's child processes (the daemon and the trainers), what they print and
// how they ended, and its own progress notes on stderr.

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d);
// Seconds since soak started, as its lines on stderr are stamped.
double SinceStart();

void Note(const std::string& what);

std::string ReadFile(const std::string& path);

// The last `n` lines of `text`, for quoting a failed process's output.
std::string Tail(const std::string& text, int n);

// fork + exec with stdout and stderr to `output`, stdin from /dev/null,
// SIGKILL when this process dies (PR_SET_PDEATHSIG), so that a crashed or
// killed soak leaves no daemon or trainer behind. Spawned from the main
// thread only: the death signal follows the thread that forked. gRPC has
// threads, so only async-signal-safe calls happen in the child.
// `nice` > 0 lowers the child's CPU priority.
pid_t Spawn(const std::vector<std::string>& args, const std::string& output,
            int nice = 0);

// "exit code 1", "killed by signal 9 (Killed)": a waitpid status in words.
std::string DescribeWait(int status);

}  // namespace deltad::bench

#endif  // DELTAD_BENCH_SOAK_PROCESS_H_
