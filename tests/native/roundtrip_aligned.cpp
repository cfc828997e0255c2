// engines: uring aio psync
// Page-aligned memory, offsets and lengths go to disk with no copy (O_DIRECT) and read back exactly.
#include "helpers.h"

int main(int argc, char** argv) {
  return t::per_engine_main(argc, argv, [](const std::string& engine) {
    t::ScratchDir dir;
    swapio::io::Handle h(t::options(engine, 64 << 10, 8));
    for (size_t n : {size_t(4096), size_t(64) << 10, (size_t(1) << 20) + 4096, size_t(3) << 20})
      for (int64_t off : {0, 4096, 1 << 20}) t::round_trip(h, dir.file("f"), n, off, 0);
    return t::kPass;
  });
}
