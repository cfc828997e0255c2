// engines: uring aio psync
// A request may outlive its handle; destroying a handle finishes the work queued on it; dropping a request
// without waiting leaks nothing (LeakSanitizer checks that in CI).
#include "helpers.h"

using namespace swapio::io;

int main(int argc, char** argv) {
  return t::per_engine_main(argc, argv, [](const std::string& engine) {
    t::ScratchDir dir;
    std::vector<uint8_t> data = t::pattern(8 << 20, 3);
    std::shared_ptr<Request> kept;
    {
      std::string path = dir.file(engine);
      {
        Handle h(t::options(engine, 256 << 10, 4, 2));
        for (int i = 0; i < 50; i++) h.submit(Op::write, t::addr(data.data()), data.size(), path, 0, false);
        kept = h.submit(Op::write, t::addr(data.data()), data.size(), path, 0, false);
      }  // destructor drains the queue
      CHECK(kept->done());
      CHECK(kept->result() == static_cast<int64_t>(data.size()));
      std::vector<uint8_t> back(data.size());
      Handle h(t::options(engine));
      CHECK(h.submit(Op::read, t::addr(back.data()), back.size(), path, 0, false)->result() ==
            static_cast<int64_t>(back.size()));
      CHECK(back == data);
      h.close();
      bool refused = false;
      try {
        h.submit(Op::read, t::addr(back.data()), 1, path, 0, false);
      } catch (const swapio::ArgError&) {
        refused = true;
      }
      CHECK(refused);
    }
    return t::kPass;
  });
}
