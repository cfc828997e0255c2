// Pinned blocks are page aligned, usable, and freed (LeakSanitizer has nothing to say about mmap, so
// this checks alignment and that zero-byte requests still give a valid page).
#include "helpers.h"
#include "mem/pinned.h"

int main() {
  for (size_t n : {size_t(0), size_t(1), size_t(4096), size_t(5 << 20)}) {
    swapio::mem::PinnedBlock b = swapio::mem::pinned_alloc(n, true);
    CHECK(b.ptr != nullptr);
    CHECK(t::addr(b.ptr) % 4096 == 0);
    CHECK(b.mapped >= n && b.mapped % 4096 == 0);
    std::memset(b.ptr, 0xab, b.mapped);
    swapio::mem::pinned_free(b);
    CHECK(b.ptr == nullptr);
  }
  return t::kPass;
}
