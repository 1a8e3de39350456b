// The Client's executor thread: the daemon's orders carried out off the
// training thread, prefetches, chunk rebalancing and periodic flushes.
#include <algorithm>
#include <chrono>

#include "client/client.h"

namespace deltad::client {

void Client::ExecutorLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    work_.wait_for(lock, std::chrono::milliseconds(options_.flush_interval_ms),
                   [&] { return stopping_ || !jobs_.empty() || ahead_ready_; });
    if (stopping_) break;
    while (!jobs_.empty() && !stopping_) {
      const Job job = jobs_.front();
      jobs_.pop_front();
      lock.unlock();
      switch (job.kind) {
        case Job::kOffload:
          (void)Offload(job.id, Origin::kDaemonOrder);
          break;
        case Job::kEvict:
          (void)Evict(job.id, Origin::kDaemonOrder);
          break;
        case Job::kPrefetch:
          (void)Reload(job.id, Need::kPrefetchOrder);
          break;
        case Job::kPrefetchHint:
          (void)Reload(job.id, Need::kPrefetchHint);
          break;
      }
      lock.lock();
      if (job.release()) UnorderLocked(job.id);
      if (job.release() && queued_releases_ > 0) {
        --queued_releases_;
        changed_.notify_all();
      }
    }
    // After a budget order (a cut, or the daemon asking for what it lent
    // beyond the budget because another session is short), chunks past the
    // budget go back as they come free, and chunks short of it are asked
    // for again; every 20 ms until the device holds the budget.
    std::shared_ptr<DaemonLink> chunk_link;
    const int64_t chunk_budget = budget_bytes_;
    const bool sync_chunks = stats_.connected &&
                             !device_->chunk_backend().empty() && chunks_due_ &&
                             NowNs() >= next_chunk_check_ns_;
    if (sync_chunks) {
      chunk_link = link_;
      next_chunk_check_ns_ = NowNs() + 20'000'000;
    }
    lock.unlock();
    if (sync_chunks) {
      const int64_t want = InWholeChunks(*chunk_link, chunk_budget);
      (void)SyncChunks(chunk_link, want);
      // Chunks in use past the budget although its bytes fit: rounding (a
      // tensor of a chunk and a bit takes two) and pages of small blocks
      // hold more than the bytes say, and another session waits for those
      // chunks. Tensors go until enough whole chunks come free, every 20 ms
      // while the chunks are due; each round releases the excess at the
      // device's rate of bytes to chunks, since a tensor frees more chunk
      // than its bytes and the whole excess would release up to twice it.
      // Only the daemon's chunks are owed: those an earlier session left
      // in use (the daemon restarted) are this process's alone.
      const int64_t in_use =
          device_->chunk_bytes_held() - device_->chunk_bytes_free();
      const int64_t owed =
          std::min(in_use, SessionChunkBytes(*chunk_link)) - want;
      if (owed > 0) {
        int64_t held_bytes;
        {
          std::lock_guard<std::mutex> relock(mu_);
          held_bytes = device_bytes_;
        }
        const int64_t release = std::max<int64_t>(
            1, static_cast<int64_t>(static_cast<double>(owed) *
                                    static_cast<double>(held_bytes) /
                                    static_cast<double>(in_use)));
        (void)ReleaseInProcess(release, NowNs());
        (void)SyncChunks(chunk_link, want);
      }
      // Short too (the others had not given theirs back yet) keeps it due.
      if (device_->chunk_bytes_held() == want) {
        std::lock_guard<std::mutex> relock(mu_);
        // Unless a newer order came meanwhile.
        if (budget_bytes_ == chunk_budget) chunks_due_ = false;
      }
    }
    FlushIfDue(/*force=*/true);
    // Last: an order that came meanwhile goes first.
    CopyAheadWhileIdle();
    lock.lock();
  }
}

}  // namespace deltad::client
