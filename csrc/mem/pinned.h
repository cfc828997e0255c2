#pragma once
// Page-aligned, page-locked host memory. Locking can be refused (RLIMIT_MEMLOCK); the block is still usable,
// and `lock_errno` says why, so the caller can warn once.
#include <cstddef>

namespace swapio::mem {

struct PinnedBlock {
  void* ptr = nullptr;
  size_t size = 0;    // bytes asked for
  size_t mapped = 0;  // bytes mapped (whole pages, at least one)
  bool locked = false;
  int lock_errno = 0;
};

PinnedBlock pinned_alloc(size_t nbytes, bool lock);  // throws IoError(ENOMEM) when the memory is not there
void pinned_free(PinnedBlock& block) noexcept;
size_t pinned_bytes_mapped();  // of every block not yet freed

}  // namespace swapio::mem
