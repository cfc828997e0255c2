// engines: uring aio psync null
// An injected error (EIO, ENOSPC) fails only the request its piece belongs to, with errno, path and the
// piece's offset; the handle goes on working; what was written before reads back intact; nothing leaks.
#include "helpers.h"

using namespace swapio::io;

int main(int argc, char** argv) {
  return t::per_engine_main(argc, argv, [](const std::string& engine) {
    t::ScratchDir dir;
    const int64_t block = 64 << 10;
    std::vector<uint8_t> good = t::pattern(16 * block, 1), bad = t::pattern(16 * block, 2), back(good.size());
    {  // warm-up (see t::resources)
      Handle warm(t::options(engine, block, 4));
      warm.submit(Op::write, t::addr(good.data()), good.size(), dir.file("good"), 1, false)->result();
    }
    for (int err : {EIO, ENOSPC}) {
      const t::Resources before = t::resources();
      {
        HandleOptions o = t::options(engine, block, 4);
        o.fault = std::string("piece=20,errno=") + (err == EIO ? "EIO" : "ENOSPC");
        Handle h(o);
        CHECK(h.submit(Op::write, t::addr(good.data()), good.size(), dir.file("good"), 0, false)->result() ==
              static_cast<int64_t>(good.size()));
        auto failed = h.submit(Op::write, t::addr(bad.data()), bad.size(), dir.file("bad"), block, false);
        bool raised = false;
        try {
          failed->result();
        } catch (const swapio::IoError& e) {  // piece 20 is the 4th of the second request
          raised = e.err() == err && e.path() == dir.file("bad") && e.offset() == block + 3 * block;
        }
        CHECK(raised);
        CHECK(h.submit(Op::read, t::addr(back.data()), back.size(), dir.file("good"), 0, false)->result() ==
              static_cast<int64_t>(back.size()));
        if (engine != "null") CHECK(back == good);
      }
      CHECK(t::released(before));
    }
    return t::kPass;
  });
}
