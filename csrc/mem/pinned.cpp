#include "mem/pinned.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "common/errors.h"

namespace swapio::mem {

PinnedBlock pinned_alloc(size_t nbytes, bool lock) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  PinnedBlock b;
  b.size = nbytes;
  b.mapped = nbytes == 0 ? page : (nbytes + page - 1) / page * page;
  if (b.mapped < nbytes) throw ArgError("pinned allocation size overflows");
  // mmap gives page alignment (more than any DIO alignment we have met) and returns the memory to the
  // OS at free, unlike a heap allocation.
  void* p = mmap(nullptr, b.mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    int err = errno;
    throw IoError(err, "cannot allocate " + std::to_string(nbytes) + " bytes of pinned memory: " +
                           std::strerror(err), "", 0);
  }
  b.ptr = p;
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
  b.ptr = nullptr;
}

}  // namespace swapio::mem
