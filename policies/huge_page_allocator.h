#ifndef DELTAD_POLICIES_HUGE_PAGE_ALLOCATOR_H_
#define DELTAD_POLICIES_HUGE_PAGE_ALLOCATOR_H_

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

namespace deltad::policy {

// A std allocator for the policy's large random-access arrays (the tensor
// slots and candidate lists). A sampled release decision reads about
// sqrt(N) random tensors: at a million tensors, 150 MiB of slots, each read
// also missed the TLB on 4 KiB pages, which in a virtual machine costs a
// two-level page walk. Arrays of 2 MiB and more get their own mapping,
// marked for transparent huge pages (a hint: where THP is off, or only
// "madvise" as on Debian, they are ordinary pages or huge ones
// respectively); smaller ones come from operator new as usual. Measured
// with bench/policy_micro at a million tensors: docs/BENCHMARKS.md.
template <typename T>
class HugePageAllocator {
 public:
  using value_type = T;
  static constexpr size_t kHugePageBytes = size_t{2} << 20;

  HugePageAllocator() noexcept = default;
  template <typename U>
  HugePageAllocator(const HugePageAllocator<U>&) noexcept {}

  T* allocate(size_t n) {
    if (n > SIZE_MAX / sizeof(T)) throw std::bad_array_new_length();
    const size_t bytes = n * sizeof(T);
    if (bytes < kHugePageBytes) {
      // Aligned as T asks (a Tensor: its cache line), past what plain
      // operator new promises.
      return static_cast<T*>(
          ::operator new (bytes, std::align_val_t{alignof(T)}));
    }
    const size_t mapped = Mapped(bytes);
    void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    madvise(p, mapped, MADV_HUGEPAGE);  // a hint; failing changes nothing
    return static_cast<T*>(p);
  }

  void deallocate(T* p, size_t n) noexcept {
    const size_t bytes = n * sizeof(T);
    if (bytes < kHugePageBytes) {
      ::operator delete (p, std::align_val_t{alignof(T)});
    } else {
      munmap(p, Mapped(bytes));
    }
  }

  template <typename U>
  bool operator==(const HugePageAllocator<U>&) const noexcept {
    return true;
  }

  // What allocate() maps for an array of `bytes` (2 MiB or more).
  static size_t Mapped(size_t bytes) {
    return (bytes + kHugePageBytes - 1) & ~(kHugePageBytes - 1);
  }
};

// Hands the whole huge pages of `v`'s storage past its size back to the
// kernel, keeping the capacity: the next growth finds them zeroed, which is
// all a vector asks of storage it has not constructed in. Without it a
// table keeps resident every page its largest day ever touched. Storage
// under 2 MiB (operator new's) is left alone; returns the bytes of the
// range discarded (resident or not).
template <typename T>
size_t DiscardUnusedCapacity(std::vector<T, HugePageAllocator<T>>& v) noexcept {
  constexpr size_t kPage = HugePageAllocator<T>::kHugePageBytes;
  const size_t capacity_bytes = v.capacity() * sizeof(T);
  if (capacity_bytes < kPage) return 0;
  const uintptr_t base = reinterpret_cast<uintptr_t>(v.data());
  const uintptr_t end = base + HugePageAllocator<T>::Mapped(capacity_bytes);
  // Rounded to the next huge page of the address space: a huge page that
  // still holds an element stays whole.
  const uintptr_t unused =
      (base + v.size() * sizeof(T) + kPage - 1) & ~(kPage - 1);
  if (unused >= end) return 0;
  if (madvise(reinterpret_cast<void*>(unused), end - unused, MADV_DONTNEED) !=
      0) {
    return 0;
  }
  return end - unused;
}

}  // namespace deltad::policy

#endif  // DELTAD_POLICIES_HUGE_PAGE_ALLOCATOR_H_
