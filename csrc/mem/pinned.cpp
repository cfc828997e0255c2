#include "mem/pinned.h"

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>

#include "common/errors.h"

namespace swapio::mem {
namespace {
std::atomic<size_t> g_mapped{0};
}  // namespace

size_t pinned_bytes_mapped() { return g_mapped.load(); }

PinnedBlock pinned_alloc(size_t nbytes, bool lock) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  PinnedBlock b;
  b.size = nbytes;
  b.mapped = nbytes == 0 ? page : (nbytes + page - 1) / page * page;
  if (b.mapped < nbytes) throw ArgError("pinned allocation size overflows");
  // mmap gives page alignment (more than any DIO alignment we have met) and returns the memory to the
  // OS at free, unlike a heap allocation. Blocks of 2 MiB and more are 2 MiB aligned and marked for
  // transparent huge pages: fewer pages for the kernel to pin per I/O and for the CPU to walk.
  const size_t huge = size_t(2) << 20;
  const bool use_huge = nbytes >= huge;
  if (use_huge) b.mapped = (nbytes + huge - 1) / huge * huge;
  const size_t extra = use_huge ? huge : 0;
  void* p = mmap(nullptr, b.mapped + extra, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    int err = errno;
    throw IoError(err, "cannot allocate " + std::to_string(nbytes) + " bytes of pinned memory: " +
                           std::strerror(err), "", 0);
  }
  if (use_huge) {  // trim the mapping to the aligned part
    auto start = reinterpret_cast<uintptr_t>(p);
    uintptr_t aligned = (start + huge - 1) & ~uintptr_t(huge - 1);
    if (aligned > start) munmap(p, aligned - start);
    if (aligned + b.mapped < start + b.mapped + extra)
      munmap(reinterpret_cast<void*>(aligned + b.mapped), start + extra - aligned);
    p = reinterpret_cast<void*>(aligned);
    madvise(p, b.mapped, MADV_HUGEPAGE);  // a hint; ignored where THP is off
  }
  b.ptr = p;
  g_mapped += b.mapped;
  if (lock) {
    if (mlock(p, b.mapped) == 0)
      b.locked = true;
    else
      b.lock_errno = errno;
  }
  return b;
}

void pinned_free(PinnedBlock& b) noexcept {
  if (!b.ptr) return;
  if (b.locked) munlock(b.ptr, b.mapped);
  munmap(b.ptr, b.mapped);
  g_mapped -= b.mapped;
  b.ptr = nullptr;
}

}  // namespace swapio::mem
