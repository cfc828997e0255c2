// engines: uring aio psync
// Offsets and lengths off the file system's block go through the page cache at the edges, O_DIRECT in the
// middle, and read back exactly.
#include "helpers.h"

int main(int argc, char** argv) {
  return t::per_engine_main(argc, argv, [](const std::string& engine) {
    t::ScratchDir dir;
    swapio::io::Handle h(t::options(engine, 64 << 10, 8));
    for (size_t n : {size_t(1), size_t(511), size_t(4095), size_t(4097), (size_t(1) << 20) + 3})
      for (int64_t off : {1, 512, 4097}) t::round_trip(h, dir.file("f"), n, off, 0);
    return t::kPass;
  });
}
