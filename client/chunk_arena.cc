#include "client/chunk_arena.h"

#include <algorithm>
#include <cstdio>
#include <iterator>
#include <limits>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace deltad::client {

namespace {

constexpr int64_t kAlign = 256;

// The block size that serves `bytes`: a multiple of 256, and above 1 KiB
// one of four steps per power of two, so a block wastes under a quarter.
int64_t ClassBytes(int64_t bytes) {
  const int64_t size = std::max(bytes, kAlign);
  int64_t power = 1;
  while (power <= size / 2) power *= 2;
  const int64_t step = std::max(power / 4, kAlign);
  return (size + step - 1) / step * step;
}

void Warn(const absl::Status& status, const char* what) {
  std::fprintf(stderr, "deltad client: %s: %s\n", what,
               std::string(status.message()).c_str());
}

}  // namespace

absl::StatusOr<std::unique_ptr<ChunkArena>> ChunkArena::Create(
    ChunkMapper& mapper, int64_t chunk_bytes, int64_t max_bytes) {
  if (chunk_bytes <= 0 || max_bytes <= 0 || max_bytes < chunk_bytes ||
      chunk_bytes % kAlign != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a chunk arena needs a chunk size that is a positive multiple of ",
        kAlign, " and a maximum of at least one chunk; got chunks of ",
        chunk_bytes, " bytes and a maximum of ", max_bytes, " bytes"));
  }
  const int64_t max_chunks = (max_bytes + chunk_bytes - 1) / chunk_bytes;
  if (max_chunks > std::numeric_limits<int64_t>::max() / 2 / chunk_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("twice ", max_bytes, " bytes of address space in ",
                     chunk_bytes, "-byte chunks does not fit in 64 bits"));
  }
  const int64_t reserved = 2 * max_chunks * chunk_bytes;
  absl::StatusOr<uintptr_t> base = mapper.Reserve(reserved, chunk_bytes);
  if (!base.ok()) return base.status();
  return std::unique_ptr<ChunkArena>(
      new ChunkArena(mapper, chunk_bytes, max_bytes, *base, reserved));
}

ChunkArena::ChunkArena(ChunkMapper& mapper, int64_t chunk_bytes,
                       int64_t max_bytes, uintptr_t base,
                       int64_t reserved_bytes)
    : mapper_(mapper),
      chunk_bytes_(chunk_bytes),
      max_bytes_(max_bytes),
      base_(base),
      reserved_bytes_(reserved_bytes) {
  free_slots_[0] = reserved_bytes / chunk_bytes;
}

ChunkArena::~ChunkArena() {
  // The lock is not needed here (nobody may use a dying arena), but taking
  // it keeps every mapper call under mu_, as promised.
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [first, run] : runs_) {
    for (size_t i = 0; i < run.chunks.size(); ++i) {
      (void)mapper_.Unmap(SlotAddress(first + static_cast<int64_t>(i)),
                          chunk_bytes_);
    }
  }
  for (const auto& [first, run] : kept_) {
    for (size_t i = 0; i < run.chunks.size(); ++i) {
      (void)mapper_.Unmap(SlotAddress(first + static_cast<int64_t>(i)),
                          chunk_bytes_);
    }
  }
  for (const auto& [slot, page] : pages_) {
    (void)mapper_.Unmap(SlotAddress(slot), chunk_bytes_);
  }
  for (const auto& [slot, chunk] : stuck_) {
    (void)mapper_.Unmap(SlotAddress(slot), chunk_bytes_);
  }
  for (const auto& [id, handle] : handles_) mapper_.Release(handle);
  mapper_.Unreserve(base_, reserved_bytes_);
}

absl::Status ChunkArena::AddChunk(uint64_t chunk_id, int fd, int64_t bytes) {
  if (bytes != chunk_bytes_) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk ", chunk_id, " has ", bytes,
                     " bytes; this arena's chunks have ", chunk_bytes_));
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (handles_.contains(chunk_id)) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk ", chunk_id, " is already held"));
  }
  const int64_t held = static_cast<int64_t>(handles_.size()) * chunk_bytes_;
  if (held + bytes > max_bytes_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("taking chunk ", chunk_id, " would hold ", held + bytes,
                     " bytes, past the arena's maximum of ", max_bytes_));
  }
  absl::StatusOr<uint64_t> handle = mapper_.Import(fd, bytes);
  if (!handle.ok()) return handle.status();
  handles_[chunk_id] = *handle;
  free_chunks_.push_back(chunk_id);
  return absl::OkStatus();
}

absl::StatusOr<void*> ChunkArena::Allocate(int64_t bytes) {
  if (bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot allocate ", bytes, " device bytes"));
  }
  std::lock_guard<std::mutex> lock(mu_);
  absl::StatusOr<void*> p =
      bytes >= chunk_bytes_ / 2 ? AllocateRun(bytes) : AllocateBlock(bytes);
  if (p.ok()) allocated_ += bytes;
  return p;
}

absl::StatusOr<void*> ChunkArena::AllocateRun(int64_t bytes) {
  const int64_t count = (bytes - 1) / chunk_bytes_ + 1;
  if (auto kept = kept_by_count_.find(count); kept != kept_by_count_.end()) {
    auto [first, run] = TakeKept(kept);
    run.requested = bytes;
    runs_[first] = std::move(run);
    return reinterpret_cast<void*>(SlotAddress(first));
  }
  UnkeepUntil(count);
  if (static_cast<int64_t>(free_chunks_.size()) < count) {
    return absl::ResourceExhaustedError(
        absl::StrCat("device memory is full: ", bytes, " bytes need ", count,
                     " chunks; ", Describe()));
  }
  int64_t first = TakeSlots(count);
  if (first < 0 && !kept_.empty()) {
    // Kept runs hold addresses too; unmapped, theirs coalesce.
    UnkeepUntil(std::numeric_limits<int64_t>::max());
    first = TakeSlots(count);
  }
  if (first < 0) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "no run of ", count, " free chunk addresses is left for ", bytes,
        " bytes: the address range is too scattered; ", Describe()));
  }
  Run run;
  run.first_slot = first;
  run.requested = bytes;
  run.chunks.reserve(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    const uint64_t chunk = free_chunks_.back();
    absl::Status mapped =
        mapper_.Map(handles_.at(chunk), SlotAddress(first + i), chunk_bytes_);
    if (!mapped.ok()) {
      // Undo in reverse, so that the chunks go back as they came.
      for (int64_t j = i - 1; j >= 0; --j) {
        UnmapToFree(first + j, run.chunks[static_cast<size_t>(j)]);
      }
      ReturnSlots(first + i, count - i);
      return mapped;
    }
    free_chunks_.pop_back();
    run.chunks.push_back(chunk);
  }
  runs_[first] = std::move(run);
  return reinterpret_cast<void*>(SlotAddress(first));
}

absl::StatusOr<void*> ChunkArena::AllocateBlock(int64_t bytes) {
  const int64_t block_bytes = ClassBytes(bytes);
  std::set<int64_t>& partial = partial_[block_bytes];
  int64_t slot = 0;
  if (!partial.empty()) {
    slot = *partial.begin();
  } else {
    UnkeepUntil(1);
    if (free_chunks_.empty()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("device memory is full: ", bytes,
                       " bytes need a chunk for blocks of ", block_bytes,
                       " and none is free; ", Describe()));
    }
    slot = TakeTopSlot();
    if (slot < 0) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "no free chunk address is left for ", bytes, " bytes; ", Describe()));
    }
    const uint64_t chunk = free_chunks_.back();
    absl::Status mapped =
        mapper_.Map(handles_.at(chunk), SlotAddress(slot), chunk_bytes_);
    if (!mapped.ok()) {
      ReturnSlots(slot, 1);
      return mapped;
    }
    free_chunks_.pop_back();
    Page page;
    page.chunk = chunk;
    page.block_bytes = block_bytes;
    page.blocks = chunk_bytes_ / block_bytes;
    page.allocated.assign(static_cast<size_t>(page.blocks), false);
    pages_[slot] = std::move(page);
    partial.insert(slot);
  }
  Page& page = pages_.at(slot);
  if (page.live == 0) empty_pages_.erase(block_bytes);
  int64_t block = 0;
  if (!page.free_blocks.empty()) {
    block = page.free_blocks.back();
    page.free_blocks.pop_back();
  } else {
    block = page.unused++;
  }
  page.allocated[static_cast<size_t>(block)] = true;
  ++page.live;
  if (page.live == page.blocks) partial.erase(slot);
  return reinterpret_cast<void*>(SlotAddress(slot) +
                                 static_cast<uintptr_t>(block * block_bytes));
}

void ChunkArena::Free(void* p, int64_t bytes) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(p);
  if (address < base_ ||
      address >= base_ + static_cast<uintptr_t>(reserved_bytes_)) {
    return;
  }
  const int64_t offset = static_cast<int64_t>(address - base_);
  const int64_t slot = offset / chunk_bytes_;
  const int64_t within = offset % chunk_bytes_;
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = runs_.find(slot); it != runs_.end() && within == 0) {
    // The size recorded at Allocate is the one taken off, whatever the
    // caller passes, so a wrong one cannot skew the accounting.
    Run run = std::move(it->second);
    runs_.erase(it);
    allocated_ -= run.requested;
    const auto count = static_cast<int64_t>(run.chunks.size());
    kept_chunks_ += count;
    kept_by_count_.emplace(count, slot);
    kept_[slot] = std::move(run);
    return;
  }
  auto it = pages_.find(slot);
  if (it == pages_.end()) return;
  Page& page = it->second;
  // Only the caller knows the size asked for; it must at least be one this
  // page serves, or the accounting (and perhaps the pointer) is wrong.
  if (bytes <= 0 || bytes >= chunk_bytes_ / 2 ||
      ClassBytes(bytes) != page.block_bytes || within % page.block_bytes != 0) {
    return;
  }
  const int64_t block = within / page.block_bytes;
  if (block >= page.blocks || !page.allocated[static_cast<size_t>(block)]) {
    return;
  }
  page.allocated[static_cast<size_t>(block)] = false;
  allocated_ -= bytes;
  std::set<int64_t>& partial = partial_[page.block_bytes];
  if (--page.live == 0) {
    if (empty_pages_.contains(page.block_bytes)) {
      partial.erase(slot);
      const uint64_t chunk = page.chunk;
      pages_.erase(it);
      UnmapToFree(slot, chunk);
      return;
    }
    // The class's first empty page stays mapped for its next block, so
    // that an allocate-and-free pair maps nothing.
    empty_pages_[page.block_bytes] = slot;
  }
  page.free_blocks.push_back(block);
  partial.insert(slot);
}

std::vector<uint64_t> ChunkArena::ShrinkTo(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<uint64_t> released;
  const int64_t over =
      static_cast<int64_t>(handles_.size()) - bytes / chunk_bytes_;
  if (over > 0) UnkeepUntil(over);
  while (static_cast<int64_t>(handles_.size()) * chunk_bytes_ > bytes &&
         !free_chunks_.empty()) {
    const uint64_t chunk = free_chunks_.back();
    free_chunks_.pop_back();
    auto it = handles_.find(chunk);
    mapper_.Release(it->second);
    handles_.erase(it);
    released.push_back(chunk);
  }
  return released;
}

int64_t ChunkArena::held_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(handles_.size()) * chunk_bytes_;
}

int64_t ChunkArena::free_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return (static_cast<int64_t>(free_chunks_.size() + empty_pages_.size()) +
          kept_chunks_) *
         chunk_bytes_;
}

int64_t ChunkArena::allocated_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return allocated_;
}

int64_t ChunkArena::TakeSlots(int64_t count) {
  for (auto it = free_slots_.begin(); it != free_slots_.end(); ++it) {
    if (it->second < count) continue;
    const int64_t first = it->first;
    const int64_t left = it->second - count;
    free_slots_.erase(it);
    if (left > 0) free_slots_[first + count] = left;
    return first;
  }
  return -1;
}

int64_t ChunkArena::TakeTopSlot() {
  if (free_slots_.empty()) return -1;
  auto last = std::prev(free_slots_.end());
  const int64_t slot = last->first + last->second - 1;
  if (--last->second == 0) free_slots_.erase(last);
  return slot;
}

void ChunkArena::ReturnSlots(int64_t first, int64_t count) {
  auto next = free_slots_.lower_bound(first);
  if (next != free_slots_.end() && next->first == first + count) {
    count += next->second;
    next = free_slots_.erase(next);
  }
  if (next != free_slots_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == first) {
      prev->second += count;
      return;
    }
  }
  free_slots_[first] = count;
}

void ChunkArena::UnmapToFree(int64_t slot, uint64_t chunk) {
  absl::Status unmapped = mapper_.Unmap(SlotAddress(slot), chunk_bytes_);
  if (!unmapped.ok()) {
    Warn(unmapped, "a device chunk stays out of use until exit");
    stuck_[slot] = chunk;
    return;
  }
  free_chunks_.push_back(chunk);
  ReturnSlots(slot, 1);
}

std::pair<int64_t, ChunkArena::Run> ChunkArena::TakeKept(
    std::multimap<int64_t, int64_t>::iterator by_count) {
  const int64_t first = by_count->second;
  kept_by_count_.erase(by_count);
  auto it = kept_.find(first);
  Run run = std::move(it->second);
  kept_.erase(it);
  kept_chunks_ -= static_cast<int64_t>(run.chunks.size());
  return {first, std::move(run)};
}

void ChunkArena::UnkeepUntil(int64_t chunks) {
  // Empty pages first: one chunk each, mapped again at the cost of one Map.
  while (static_cast<int64_t>(free_chunks_.size()) < chunks &&
         !empty_pages_.empty()) {
    const auto [block_bytes, slot] = *empty_pages_.begin();
    empty_pages_.erase(empty_pages_.begin());
    partial_[block_bytes].erase(slot);
    auto page = pages_.find(slot);
    const uint64_t chunk = page->second.chunk;
    pages_.erase(page);
    UnmapToFree(slot, chunk);
  }
  while (static_cast<int64_t>(free_chunks_.size()) < chunks &&
         !kept_by_count_.empty()) {
    const auto [first, run] = TakeKept(std::prev(kept_by_count_.end()));
    for (size_t i = 0; i < run.chunks.size(); ++i) {
      UnmapToFree(first + static_cast<int64_t>(i), run.chunks[i]);
    }
  }
}

std::string ChunkArena::Describe() const {
  return absl::StrCat(free_chunks_.size() + empty_pages_.size() + kept_chunks_,
                      " of ", handles_.size(), " chunks (", chunk_bytes_,
                      " bytes each) free, ", allocated_, " bytes allocated");
}

}  // namespace deltad::client
