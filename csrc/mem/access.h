#pragma once
// Whether caller memory may be read or written, asked of the kernel without touching it. O_DIRECT into a
// read-only page fails with EFAULT, but a bounce copy into one would crash the process (a read-only
// np.memmap as a pread destination): requests that bounce are checked first.
#include <cstddef>

namespace swapio::mem {

enum class Access { read, write };

// 0 if every byte of [p, p + n) is mapped with that access; -EFAULT if not; 0 where the kernel cannot tell.
int check_access(const void* p, size_t n, Access access);

}  // namespace swapio::mem
