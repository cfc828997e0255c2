#pragma once
#include <cstddef>

namespace swapio::io {

// Copies caller memory into a 16-byte aligned bounce buffer that only the device will read next: on x86 with
// non-temporal stores, so the copy neither evicts the cache nor leaves dirty lines for the DMA to snoop.
// Measured here: with memcpy, copies into bounce buffers ran at ~3 GB/s during O_DIRECT writes and bounced
// writes reached 0.66x of zero-copy ones; with streaming stores, about 0.9x.
void copy_to_device_buffer(void* dst, const void* src, size_t n);

}  // namespace swapio::io
