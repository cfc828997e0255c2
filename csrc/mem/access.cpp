#include "mem/access.h"

#include <fcntl.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>

#ifndef MADV_POPULATE_READ  // glibc headers older than Linux 5.14
#define MADV_POPULATE_READ 22
#define MADV_POPULATE_WRITE 23
#endif

namespace swapio::mem {
namespace {

// PROCMAP_QUERY (Linux 6.11+, <linux/fs.h>): the mapping that holds an address, one ioctl on
// /proc/self/maps (about 1 us) instead of parsing the whole file. Declared here for older headers.
struct ProcmapQuery {
  uint64_t size, query_flags, query_addr;
  uint64_t vma_start, vma_end, vma_flags, vma_page_size, vma_offset, inode;
  uint32_t dev_major, dev_minor, vma_name_size, build_id_size;
  uint64_t vma_name_addr, build_id_addr;
};
constexpr unsigned long kProcmapQuery = _IOWR('f', 17, ProcmapQuery);
constexpr uint64_t kVmaReadable = 1, kVmaWritable = 2;

// 0 / -EFAULT when the query answers, 1 when this kernel has no PROCMAP_QUERY.
int check_with_procmap(uintptr_t begin, uintptr_t end, Access access) {
  int fd = ::open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 1;
  const uint64_t need = access == Access::write ? kVmaWritable : kVmaReadable;
  int rc = 0;
  for (uintptr_t at = begin; at < end;) {  // one mapping per step; a gap between mappings is a fault
    ProcmapQuery q;
    std::memset(&q, 0, sizeof(q));
    q.size = sizeof(q);
    q.query_addr = at;
    if (ioctl(fd, kProcmapQuery, &q) != 0) {
      rc = errno == ENOENT ? -EFAULT : 1;
      break;
    }
    if ((q.vma_flags & need) != need || q.vma_end <= at) {
      rc = -EFAULT;
      break;
    }
    at = q.vma_end;
  }
  ::close(fd);
  return rc;
}

}  // namespace

int check_access(const void* p, size_t n, Access access) {
  if (n == 0) return 0;
  const auto begin = reinterpret_cast<uintptr_t>(p);
  int rc = check_with_procmap(begin, begin + n, access);
  if (rc <= 0) return rc;
  // Older kernels: prefault the range as the copy would (MADV_POPULATE_*, Linux 5.14+), which fails
  // instead of faulting: EFAULT (no such access) or ENOMEM (a gap). Anything else (EINVAL: no such advice
  // on this kernel, or device memory) leaves nothing more to learn.
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t start = begin & ~(page - 1);
  const int advice = access == Access::write ? MADV_POPULATE_WRITE : MADV_POPULATE_READ;
  if (madvise(reinterpret_cast<void*>(start), begin + n - start, advice) == 0) return 0;
  return errno == EFAULT || errno == ENOMEM ? -EFAULT : 0;
}

}  // namespace swapio::mem
