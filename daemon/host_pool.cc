#include "daemon/host_pool.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"

namespace deltad::daemon {

absl::StatusOr<std::unique_ptr<HostPool>> HostPool::Create(int64_t total_bytes,
                                                           int64_t slab_bytes) {
  const int64_t page = ::sysconf(_SC_PAGESIZE);
  if (slab_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("host pool slab size must be positive, got ", slab_bytes));
  }
  if (page > 0 && slab_bytes % page != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("host pool slab size ", slab_bytes,
                     " is not a multiple of the page size ", page));
  }
  if (total_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "host pool total size must be positive, got ", total_bytes));
  }
  if (total_bytes < slab_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("host pool total size ", total_bytes,
                     " is smaller than one slab of ", slab_bytes, " bytes"));
  }
  const int64_t count = total_bytes / slab_bytes;
  // Each slab holds a descriptor for the life of the pool; better a clear
  // error now than EMFILE after creating a thousand of them.
  struct rlimit nofile;
  if (::getrlimit(RLIMIT_NOFILE, &nofile) == 0 &&
      nofile.rlim_cur != RLIM_INFINITY &&
      static_cast<uint64_t>(count) >= nofile.rlim_cur) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "host pool of ", total_bytes, " bytes in slabs of ", slab_bytes,
        " bytes needs ", count, " descriptors, and RLIMIT_NOFILE is ",
        nofile.rlim_cur, ": raise the limit or use larger slabs"));
  }

  std::vector<Entry> slabs(count);
  for (int64_t i = 0; i < count; ++i) {
    absl::StatusOr<common::UniqueFd> fd = NewSegment(i, slab_bytes);
    if (!fd.ok()) {
      return absl::Status(fd.status().code(),
                          absl::StrCat("creating host slab ", i + 1, " of ",
                                       count, ": ", fd.status().message()));
    }
    slabs[i].fd = *std::move(fd);
  }
  // The constructor is private, hence no make_unique.
  std::unique_ptr<HostPool> pool(new HostPool(slab_bytes));
  {
    std::lock_guard<std::mutex> lock(pool->mu_);
    pool->slabs_ = std::move(slabs);
    // Popped from the back: the first grants get ids 0, 1, 2, ...
    pool->free_.reserve(count);
    for (int64_t i = count - 1; i >= 0; --i) pool->free_.push_back(i);
  }
  return pool;
}

HostPool::~HostPool() =
    default;  // each Entry's common::UniqueFd closes its memfd

absl::StatusOr<common::UniqueFd> HostPool::NewSegment(uint64_t id,
                                                      int64_t bytes) {
  const std::string name = absl::StrCat("deltad-slab-", id);
  common::UniqueFd fd(
      ::memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid()) {
    const int err = errno;
    return absl::ErrnoToStatus(
        err, absl::StrCat("memfd_create ", name,
                          err == EMFILE || err == ENFILE
                              ? " (each slab holds a descriptor: raise "
                                "RLIMIT_NOFILE or use larger slabs)"
                              : ""));
  }
  if (::ftruncate(fd.get(), bytes) != 0) {
    return absl::ErrnoToStatus(
        errno, absl::StrCat("ftruncate of ", name, " to ", bytes, " bytes"));
  }
  // F_SEAL_SEAL too, so that no holder can add seals of its own: F_SEAL_WRITE
  // would lock the daemon out of hole-punching the slab on release.
  if (::fcntl(fd.get(), F_ADD_SEALS,
              F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("sealing ", name));
  }
  return fd;
}

Slab HostPool::SlabAt(uint64_t id) const {
  Slab s;
  s.id = id;
  s.fd = slabs_[id].fd.get();
  s.bytes = slab_bytes_;
  return s;
}

absl::StatusOr<std::vector<Slab>> HostPool::Grant(uint64_t session,
                                                  int64_t quota_bytes) {
  if (quota_bytes < slab_bytes_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "host quota of ", quota_bytes, " bytes for session ", session,
        " is smaller than one slab of ", slab_bytes_, " bytes"));
  }
  const int64_t want = quota_bytes / slab_bytes_;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_session_.find(session);
  const int64_t held =
      it == by_session_.end() ? 0 : static_cast<int64_t>(it->second.size());
  if (held >= want) return std::vector<Slab>();
  const int64_t needed = want - held;
  if (needed > static_cast<int64_t>(free_.size())) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "host pool has ", static_cast<int64_t>(free_.size()) * slab_bytes_,
        " bytes free, asked ", needed * slab_bytes_, " (session ", session,
        " holds ", held * slab_bytes_, " of a quota of ", quota_bytes,
        " bytes)"));
  }
  std::vector<uint64_t>& ids = by_session_[session];
  std::vector<Slab> granted;
  granted.reserve(needed);
  for (int64_t i = 0; i < needed; ++i) {
    const uint64_t id = free_.back();
    free_.pop_back();
    slabs_[id].state = SlabState::kGranted;
    slabs_[id].session = session;
    ids.push_back(id);
    granted.push_back(SlabAt(id));
  }
  return granted;
}

absl::Status HostPool::ReleaseSession(uint64_t session) {
  // Slabs move to kWiping under the lock; the system calls run outside it so
  // that grants to other sessions do not wait on them.
  std::vector<std::pair<uint64_t, common::UniqueFd>> wiping;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = by_session_.find(session);
    if (it == by_session_.end()) return absl::OkStatus();
    for (uint64_t id : it->second) {
      slabs_[id].state = SlabState::kWiping;
      wiping.emplace_back(id, std::move(slabs_[id].fd));
    }
    by_session_.erase(it);
  }

  std::vector<std::pair<uint64_t, absl::StatusOr<common::UniqueFd>>> fresh;
  fresh.reserve(wiping.size());
  for (auto& [id, old_fd] : wiping) {
    // Punching the old file frees its pages now, even while the previous
    // holder keeps it open, and zeroes what that holder still maps. Best
    // effort: the fresh memfd below is what guarantees the next session
    // reads zeros.
    ::fallocate(old_fd.get(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0,
                slab_bytes_);
    old_fd.reset();
    fresh.emplace_back(id, NewSegment(id, slab_bytes_));
  }

  std::string errors;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [id, fd] : fresh) {
    Entry& e = slabs_[id];
    e.session = 0;
    if (fd.ok()) {
      e.fd = *std::move(fd);
      e.state = SlabState::kFree;
      free_.push_back(id);
    } else {
      e.state = SlabState::kRetired;
      absl::StrAppend(&errors, errors.empty() ? "" : "; ", "slab ", id, ": ",
                      fd.status().message());
    }
  }
  if (!errors.empty()) {
    return absl::InternalError(absl::StrCat(
        "releasing session ", session,
        ": could not give slabs a fresh segment, retired them: ", errors));
  }
  return absl::OkStatus();
}

HostPoolStats HostPool::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  HostPoolStats s;
  s.slab_bytes = slab_bytes_;
  for (const Entry& e : slabs_) {
    switch (e.state) {
      case SlabState::kFree:
        ++s.free_slabs;
        break;
      case SlabState::kGranted:
        ++s.granted_slabs;
        break;
      case SlabState::kWiping:
        ++s.wiping_slabs;
        break;
      case SlabState::kRetired:
        ++s.retired_slabs;
        break;
    }
  }
  s.total_bytes = static_cast<int64_t>(slabs_.size()) * slab_bytes_;
  s.free_bytes = s.free_slabs * slab_bytes_;
  s.granted_bytes = s.granted_slabs * slab_bytes_;
  s.sessions = static_cast<int64_t>(by_session_.size());
  return s;
}

std::vector<Slab> HostPool::SlabsOf(uint64_t session) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Slab> out;
  auto it = by_session_.find(session);
  if (it == by_session_.end()) return out;
  out.reserve(it->second.size());
  for (uint64_t id : it->second) out.push_back(SlabAt(id));
  std::sort(out.begin(), out.end(),
            [](const Slab& a, const Slab& b) { return a.id < b.id; });
  return out;
}

absl::StatusOr<std::vector<common::side::Grant>> HostPool::DuplicateSlabsOf(
    uint64_t session) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<common::side::Grant> out;
  auto it = by_session_.find(session);
  if (it == by_session_.end()) return out;
  std::vector<uint64_t> ids = it->second;
  std::sort(ids.begin(), ids.end());
  for (uint64_t id : ids) {
    common::side::Grant slab;
    slab.id = id;
    slab.bytes = slab_bytes_;
    slab.fd.reset(::fcntl(slabs_[id].fd.get(), F_DUPFD_CLOEXEC, 0));
    if (!slab.fd.valid()) {
      return absl::ErrnoToStatus(
          errno, absl::StrCat("duplicating the descriptor of slab ", id));
    }
    out.push_back(std::move(slab));
  }
  return out;
}

}  // namespace deltad::daemon
