// engines: uring aio psync
// A request spread over several workers (stripes of whole blocks, edges joined to the outer ones) reads
// back exactly, whatever its alignment.
#include "helpers.h"

int main(int argc, char** argv) {
  return t::per_engine_main(argc, argv, [](const std::string& engine) {
    t::ScratchDir dir;
    swapio::io::Handle h(t::options(engine, 64 << 10, 8, 3));
    for (size_t n : {size_t(4097), (size_t(1) << 20) + 3, size_t(3) << 20})
      for (int64_t off : {0, 1, 4096})
        for (size_t shift : {0, 1}) t::round_trip(h, dir.file("f"), n, off, shift);
    return t::kPass;
  });
}
