// Every engine moves exact bytes for aligned and unaligned memory, offsets and lengths.
#include "helpers.h"

using namespace swapio::io;

int main() {
  t::ScratchDir dir;
  const size_t sizes[] = {1, 511, 512, 4095, 4096, 4097, (1 << 20) + 3, 3 << 20};
  const int64_t offsets[] = {0, 1, 512, 4096, 4097};
  for (const std::string& engine : t::usable_engines()) {
    for (int64_t threads : {1, 3}) {
      Handle h(t::options(engine, 64 << 10, 8, threads));
      for (size_t n : sizes) {
        for (int64_t off : offsets) {
          for (size_t mem_shift : {0, 1, 512}) {
            std::string path = dir.file(engine + "-" + std::to_string(n) + "-" + std::to_string(off));
            std::vector<uint8_t> src_store(n + 4096 * 2), dst_store(n + 4096 * 2);
            uint8_t* src = src_store.data() + (4096 - t::addr(src_store.data()) % 4096) + mem_shift;
            uint8_t* dst = dst_store.data() + (4096 - t::addr(dst_store.data()) % 4096) + mem_shift;
            auto data = t::pattern(n, static_cast<uint32_t>(n + off));
            std::memcpy(src, data.data(), n);
            CHECK(h.submit(Op::write, t::addr(src), n, path, off, false)->result() == static_cast<int64_t>(n));
            CHECK(h.submit(Op::read, t::addr(dst), n, path, off, false)->result() == static_cast<int64_t>(n));
            CHECK(std::memcmp(dst, data.data(), n) == 0);
            unlink(path.c_str());
          }
        }
      }
    }
  }
  return t::kPass;
}
