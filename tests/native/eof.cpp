// engines: uring aio psync
// A read that runs past the end of the file fails with ENODATA (never garbage, never a hang), whether the
// end falls inside an O_DIRECT block, inside the buffered tail, or before the read starts.
#include "helpers.h"

using namespace swapio::io;

int main(int argc, char** argv) {
  return t::per_engine_main(argc, argv, [](const std::string& engine) {
    t::ScratchDir dir;
    std::string path = dir.file("short");
    std::vector<uint8_t> data = t::pattern(10000, 1);
    {
      Handle h(t::options(engine, 4096, 4, 2));
      CHECK(h.submit(Op::write, t::addr(data.data()), data.size(), path, 0, false)->result() == 10000);
      struct Case { int64_t off, len; } cases[] = {{0, 10001}, {0, 16384}, {8192, 4096}, {20000, 512}, {9999, 2}};
      for (auto c : cases) {
        std::vector<uint8_t> buf(c.len);
        auto req = h.submit(Op::read, t::addr(buf.data()), c.len, path, c.off, false);
        bool raised = false;
        try {
          req->result();
        } catch (const swapio::IoError& e) {
          raised = e.err() == ENODATA && e.path() == path;
        }
        CHECK(raised);
      }
    }
    return t::kPass;
  });
}
