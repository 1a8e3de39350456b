#include "client/session_keeper.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <utility>

namespace deltad::client {

namespace {

long long Ms(std::chrono::steady_clock::duration d) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(d).count();
}

std::string HeldBack(int64_t n) {
  return n > 0 ? " (" + std::to_string(n) + " more like it held back)" : "";
}

}  // namespace

SessionKeeper::SessionKeeper(Options options, Hooks hooks)
    : options_(options),
      hooks_(std::move(hooks)),
      jitter_(static_cast<unsigned>(::getpid())) {}

SessionKeeper::~SessionKeeper() { Stop(); }

void SessionKeeper::Start(const absl::Status& first) {
  std::lock_guard<std::mutex> lock(mu_);
  if (thread_.joinable() || stopping_) return;
  attached_ = first.ok();
  if (!attached_ && !options_.reattach) {
    next_try_ = Clock::time_point::max();
    std::fprintf(stderr,
                 "deltad client: no session with deltad (%s); training on "
                 "in-process decisions\n",
                 std::string(first.message()).c_str());
  } else if (!attached_) {
    detached_since_ = Clock::now();
    attempts_ = 1;
    ++stats_.attach_failures;
    delay_ = options_.first_retry;
    next_try_ = Clock::now() + NextDelayLocked();
    std::fprintf(stderr,
                 "deltad client: no session with deltad (%s); training on "
                 "in-process decisions, attaching when it answers\n",
                 std::string(first.message()).c_str());
  }
  thread_ = std::thread([this] { Run(); });
}

void SessionKeeper::Lost(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    ++stats_.sessions_lost;
    ++losses_;
    attached_ = false;
    end_pending_ = true;
    detached_since_ = Clock::now();
    attempts_ = 0;
    delay_ = options_.first_retry;
    next_try_ = Clock::now();  // a restarted daemon is back soon
  }
  int64_t held = 0;
  if (lost_log_.Allow(&held)) {
    std::fprintf(stderr,
                 "deltad client: lost the session with deltad: %s; training "
                 "on in-process decisions, reattaching in the background%s\n",
                 why.c_str(), HeldBack(held).c_str());
  }
  wake_.notify_all();
}

void SessionKeeper::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

SessionKeeper::Stats SessionKeeper::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

SessionKeeper::Clock::duration SessionKeeper::NextDelayLocked() {
  // Up to a quarter less than the delay, then the delay doubles.
  const Clock::duration d = delay_;
  const auto quarter = std::max<int64_t>(1, Ms(d) / 4);
  const auto off = static_cast<int64_t>(jitter_() % quarter);
  delay_ = std::min<Clock::duration>(2 * delay_, options_.max_retry);
  return d - std::chrono::milliseconds(off);
}

void SessionKeeper::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    const bool checking = attached_ && hooks_.check != nullptr;
    wake_.wait_until(
        lock,
        checking    ? Clock::now() + options_.check_every
        : attached_ ? Clock::time_point::max()
                    : next_try_,
        [&] { return stopping_ || (!attached_ && Clock::now() >= next_try_); });
    if (stopping_) return;
    if (attached_) {
      if (checking) {
        lock.unlock();
        hooks_.check();
        lock.lock();
      }
      continue;
    }
    const bool end_first = end_pending_;
    const uint64_t losses = losses_;
    ++attempts_;
    lock.unlock();
    // A lost session is ended before another is opened: the daemon allows
    // one per process and GPU.
    const bool ended = !end_first || hooks_.end_lost();
    absl::StatusOr<std::string> attached =
        absl::FailedPreconditionError("the lost session is still open");
    if (ended && options_.reattach) attached = hooks_.attach();
    lock.lock();
    if (stopping_) return;
    // Lost again meanwhile: that loss's state stands, and its session is
    // the one to end next.
    if (losses_ != losses) continue;
    if (ended) end_pending_ = false;
    if (ended && !options_.reattach) {
      next_try_ = Clock::time_point::max();
      continue;
    }
    if (attached.ok()) {
      attached_ = true;
      std::fprintf(stderr,
                   "deltad client: attached to deltad: %s (after %d "
                   "attempts, %lld ms on in-process decisions)\n",
                   attached->c_str(), attempts_,
                   Ms(Clock::now() - detached_since_));
      continue;
    }
    ++stats_.attach_failures;
    const Clock::duration wait = NextDelayLocked();
    next_try_ = Clock::now() + wait;
    int64_t held = 0;
    if (retry_log_.Allow(&held)) {
      std::fprintf(stderr,
                   "deltad client: still no session with deltad after %d "
                   "attempts in %lld ms (%s); next attempt in %lld ms%s\n",
                   attempts_, Ms(Clock::now() - detached_since_),
                   std::string(attached.status().message()).c_str(), Ms(wait),
                   HeldBack(held).c_str());
    }
  }
}

}  // namespace deltad::client
