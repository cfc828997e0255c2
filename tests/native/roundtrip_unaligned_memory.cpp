// engines: uring aio psync
// Memory that O_DIRECT cannot take (off a page or sector boundary) goes through bounce buffers and reads
// back exactly, for pieces smaller and larger than a bounce slot; so does aligned memory whose requests the
// caller asks to stage (the same path), at aligned and unaligned file offsets.
#include "helpers.h"

int main(int argc, char** argv) {
  return t::per_engine_main(argc, argv, [](const std::string& engine) {
    t::ScratchDir dir;
    swapio::io::Handle h(t::options(engine, 64 << 10, 8));
    for (size_t shift : {1, 512, 4095})
      for (size_t n : {size_t(4096), size_t(64) << 10, (size_t(1) << 20) + 4096, size_t(3) << 20})
        t::round_trip(h, dir.file("f"), n, 4096, shift);
    for (int64_t off : {0, 4096, 4097})
      for (size_t n : {size_t(4096), size_t(64) << 10, (size_t(1) << 20) + 4096, size_t(3) << 20})
        t::round_trip(h, dir.file("f"), n, off, 0, /*staged=*/true);
    return t::kPass;
  });
}
